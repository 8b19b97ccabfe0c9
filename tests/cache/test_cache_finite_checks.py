"""The finite check of a batched push through the cache: one verdict read for every table
of the push when the cached rows are on a device (``nan_policy="skip"`` tables
included), the same outcomes as with host records: a skip table's non-finite rows are
dropped, any other table's raise before anything is applied."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import cache
import ps
from comm import boundary

pytestmark = pytest.mark.timeout(60)

IDS = torch.tensor([1, 2, 7])


def cached(n: int, policy: str, device: str | None, grouped: bool = True) -> cache.CachedStore:
    """``n`` tables ``t0..`` of 10 rows x 2 (SGD) with ``nan_policy``, behind a cache
    pushing every update at once (write bound 0)."""
    inner = ps.InProcessStore()
    for i in range(n):
        inner.create_table(
            ps.TableSpec(name=f"t{i}", num_rows=10, dim=2, optimizer=ps.SGD(lr=0.1),
                         nan_policy=policy)
        )  # fmt: skip
    config = cache.CacheConfig(capacity_rows=5, group_tables=grouped)
    store = cache.CachedStore(inner, config, device=device, owns_store=True)
    store.pull_many([ps.PullRequest(f"t{i}", IDS) for i in range(n)])
    return store


def counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of :func:`comm.boundary.read` and :func:`comm.boundary.to_host`."""
    calls: Counter[str] = Counter()
    for name in ("read", "to_host"):
        fn = getattr(boundary, name)

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(boundary, name, wrapped)
    return calls


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("tables", [3, 26])
def test_one_verdict_read_per_push_on_a_device(
    policy: str, tables: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finite gradients of every table: one read of the verdicts, one copy of the rows
    due to the store, whatever the number of tables and their policy."""
    store = cached(tables, policy, "cpu")
    calls = counting(monkeypatch)
    store.push_many([ps.PushRequest(f"t{i}", IDS, torch.ones(3, 2)) for i in range(tables)])
    assert calls == Counter(read=1, to_host=1)
    store.flush()
    assert [int(store.inner.clocks(f"t{i}", IDS).sum()) for i in range(tables)] == [3] * tables
    store.close()


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host-records", "device-rows"])
@pytest.mark.parametrize("grouped", [True, False], ids=["shared-cache", "cache-per-table"])
def test_a_skip_table_drops_its_non_finite_rows(
    device: str | None, grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = cached(3, "skip", device, grouped)
    bad = torch.ones(3, 2)
    bad[1, 0] = float("nan")  # row id 2 of table t1
    calls = counting(monkeypatch)
    store.push_many(
        [ps.PushRequest("t0", IDS, torch.ones(3, 2)), ps.PushRequest("t1", IDS, bad),
         ps.PushRequest("t2", IDS, torch.ones(3, 2))]
    )  # fmt: skip
    if device is not None:  # the verdicts, t1's row mask, the rows due to the store
        assert calls == Counter(read=1, to_host=2)
    store.flush()
    assert store.inner.clocks("t1", IDS).tolist() == [1, 0, 1]
    assert store.inner.clocks("t0", IDS).tolist() == [1, 1, 1]
    assert torch.isfinite(store.pull("t1", IDS).rows).all()
    store.close()


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host-records", "device-rows"])
def test_a_raise_table_stops_the_push_next_to_skip_tables(device: str | None) -> None:
    """A non-finite gradient of a "raise" table names its row and applies nothing, also
    when skip tables in the same push had rows to drop."""
    inner = ps.InProcessStore()
    for name, policy in (("s", "skip"), ("r", "raise")):
        inner.create_table(
            ps.TableSpec(name=name, num_rows=10, dim=2, optimizer=ps.SGD(lr=0.1),
                         nan_policy=policy)
        )  # fmt: skip
    store = cache.CachedStore(
        inner, cache.CacheConfig(capacity_rows=5, group_tables=True), device=device
    )
    store.pull_many([ps.PullRequest(t, IDS) for t in ("s", "r")])
    bad_s, bad_r = torch.ones(3, 2), torch.ones(3, 2)
    bad_s[0, 1] = float("inf")
    bad_r[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"push table 'r': gradient of row id 7 \(position 2\)"):
        store.push_many([ps.PushRequest("s", IDS, bad_s), ps.PushRequest("r", IDS, bad_r)])
    store.flush()
    assert int(inner.clocks("s", IDS).sum()) == 0 and int(inner.clocks("r", IDS).sum()) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_all_finite_settles_by_the_sum_and_sees_past_an_overflow(threads: int) -> None:
    """ps.validate.all_finite on host float32: a NaN or an infinity anywhere (the sum is
    then not finite) is found; finite values whose sum overflows to infinity are finite."""
    from ps.validate import all_finite

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(5000, 16)
        assert all_finite(x) and all_finite(torch.zeros(0, 4))
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[4321, 7] = bad
            assert not all_finite(y) and not all_finite(y.t())  # strided too
        both = x.clone()
        both[1, 0], both[2, 0] = float("inf"), float("-inf")  # a NaN sum
        assert not all_finite(both)
        huge = torch.full((64, 16), 3e38)  # finite, but the sum overflows
        assert not torch.isfinite(huge.sum()) and all_finite(huge)
    finally:
        torch.set_num_threads(before)
