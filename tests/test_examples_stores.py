"""``--ps`` parsing and role assignment for the example jobs."""

from __future__ import annotations

import pytest

from comm import LocalGroup, Role
from hybridrec.launch import PSChoice, open_ps, parse_ps
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
