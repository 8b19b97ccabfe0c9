"""``--ps`` parsing, role assignment and the launch context of the jobs."""

from __future__ import annotations

import pytest
import torch

from comm import LocalGroup, Role, Topology
from hybridrec.launch.roles import (
    Launch,
    PSChoice,
    check_batch_size,
    describe_roles,
    open_ps,
    parse_ps,
)
from ps import InProcessStore


def test_parse_every_form() -> None:
    assert parse_ps("local") == PSChoice("local")
    assert parse_ps("mpi") == PSChoice("mpi", num_servers=1)
    assert parse_ps("mpi:3") == PSChoice("mpi", num_servers=3)
    assert parse_ps("redis://u:pw@127.0.0.1:6380/2") == PSChoice(
        "redis", url="redis://u:pw@127.0.0.1:6380/2"
    )
    assert parse_ps("rediss://h:1/0?cluster=1") == PSChoice(
        "redis", url="rediss://h:1/0", cluster=True
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("mpi:0", "server count after 'mpi:' must be >= 1"),
        ("mpi:x", "server count"),
        ("redis://h:1/0?foo=1", "unknown query options \\['foo'\\]"),
        ("etcd://h", "expected 'local', 'mpi'"),
    ],
)
def test_bad_values_say_what_is_expected(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ps(value)


def test_local_is_a_worker_with_an_in_process_store() -> None:
    r = open_ps("local", LocalGroup())
    assert r.role is Role.WORKER and isinstance(r.store, InProcessStore)
    with pytest.raises(ValueError, match="needs the MPI backend"):
        open_ps("mpi", LocalGroup())


def test_roles_are_described_and_checked() -> None:
    assert describe_roles(Topology(world_size=3, num_servers=1), "mpi") == (
        "3 ranks: 2 workers + 1 PS server (mpi)"
    )
    assert describe_roles(Topology(world_size=5, num_servers=2), "mpi") == (
        "5 ranks: 3 workers + 2 PS servers (mpi)"
    )
    assert describe_roles(Topology(world_size=1), "local") == "1 rank: 1 worker (local)"
    with pytest.raises(ValueError, match="--batch-size 10 must be a multiple of the 3 worker"):
        check_batch_size(10, Topology(world_size=4, num_servers=1))


def test_batch_splits_over_model_replicas() -> None:
    """Ranks holding one model between them (tp x pp) see the same samples: the batch
    needs to split over the replicas only."""
    check_batch_size(2, Topology(world_size=4), ranks_per_replica=4)  # one replica
    check_batch_size(6, Topology(world_size=5, num_servers=1), ranks_per_replica=2)
    with pytest.raises(ValueError, match="--batch-size 3 must be a multiple of the 2 model"):
        check_batch_size(3, Topology(world_size=4), ranks_per_replica=2)
    check_batch_size(3, Topology(world_size=4), ranks_per_replica=3)  # the mesh names that


def test_launch_opens_roles_and_always_closes() -> None:
    with Launch("local", ps="local", batch_size=4, threads=1) as job:
        assert job.is_worker and job.group.size == 1 and isinstance(job.store, InProcessStore)
        assert job.describe() == "1 rank: 1 worker (local)"
        assert torch.get_num_threads() == 1
    assert job.world is None and job.role is None  # store and world closed
    failed = Launch("local", ps="mpi")
    with pytest.raises(ValueError, match="--ps mpi needs the MPI backend"), failed:
        pass
    assert failed.world is None  # closed although __enter__ failed
    with pytest.raises(ValueError, match="expected 'local', 'mpi'"):
        Launch("local", ps="etcd://h")  # before any process group starts
