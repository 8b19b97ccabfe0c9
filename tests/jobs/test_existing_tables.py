"""``--existing-tables``: a fresh job that finds its hybrid tables already in a store
(a shared store such as Redis outlives a run) stops and says so; ``reuse`` trains on
from their rows, ``replace`` drops them and equals a run on an empty store, a shape
mismatch names the table and both shapes. On the in-process store and a real
``redis-server``; two workers sharing one Redis are covered by test_dlrm_launchers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import comm
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train
from hybridrec.launch.existing_tables import ExistingTablesError
from ps import InProcessStore, Store

RUN: dict[str, Any] = dict(
    data="synthetic", synthetic_samples=600, synthetic_rows=50, batch_size=60, dim=8,
    bottom_mlp=[16, 8], top_mlp=[16, 1], placement="hybrid", max_steps=2, verbose=False,
    progress=False,
)  # fmt: skip


def run(store: Store, **kw: Any) -> dict[str, Any]:
    return train(DLRMJobConfig(**{**RUN, **kw}), comm.LocalGroup(), store)


def rows(store: Store) -> torch.Tensor:
    return store.pull("cat0", torch.arange(50)).rows  # [50, dim]


def fail_reuse_and_mismatch(store: Store) -> torch.Tensor:
    """The checks both stores pass; returns the rows after a reused run."""
    run(store)
    after_first = rows(store).clone()
    refused = r"already holds table\(s\) 'cat0', 'cat1', 'cat2', 'cat3' and 22 more.*--resume"
    with pytest.raises(ExistingTablesError, match=refused + ".*reuse.*replace"):
        run(store)
    assert torch.equal(rows(store), after_first)  # a refused run changes nothing
    run(store, existing_tables="reuse")
    reused = rows(store).clone()
    assert not torch.equal(reused, after_first)  # trained on from the first run's rows
    with pytest.raises(ValueError, match=r"table 'cat0' is already in the parameter-server store "
                       r"with another spec: the store has 50 x 8 \(rows x dim\), this job needs "
                       r"50 x 4.*--existing-tables replace"):  # fmt: skip
        run(store, existing_tables="reuse", dim=4, bottom_mlp=[16, 4])
    return reused


def test_in_process_store() -> None:
    store = InProcessStore()
    fail_reuse_and_mismatch(store)
    fresh = InProcessStore()
    run(fresh)
    run(fresh, existing_tables="reuse")
    assert torch.equal(rows(store), rows(fresh))  # the refused runs in between changed nothing
    replaced = InProcessStore()
    run(replaced)
    run(replaced, existing_tables="replace")  # dropped and made again: a first run's rows
    first = InProcessStore()
    run(first)
    assert torch.equal(rows(replaced), rows(first)) and not torch.equal(rows(first), rows(store))
    run(replaced, existing_tables="replace", dim=4, bottom_mlp=[16, 4])  # another shape
    assert rows(replaced).shape == (50, 4)


@pytest.mark.timeout(180)
def test_redis_store() -> None:
    from ps import RedisStore
    from redis_server import redis_server

    with redis_server() as srv, RedisStore(srv.url) as store:
        reused = fail_reuse_and_mismatch(store)
        run(store, existing_tables="replace")  # dropped and made again: a first run's rows
        replaced = rows(store)
        srv.client().flushdb()
        run(store)
        assert torch.equal(replaced, rows(store)) and not torch.equal(replaced, reused)
        run(store, existing_tables="replace", dim=4, bottom_mlp=[16, 4])  # another shape
        assert rows(store).shape == (50, 4)
