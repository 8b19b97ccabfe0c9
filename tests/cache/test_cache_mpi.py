"""The cache over a real MPI store (server ranks under mpirun, no mocks).

``tests/cache/ranks/cache_mpi_bound.py`` checks, with workers taking turns to pull, that no
served row is more than the read bound behind the PS (direct clock comparison and the
cache's own exact staleness histogram agree), that no update is lost (exact SGD sums),
and, with one worker and bounds 0, bit-identity with a plain in-process store.
"""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks

SCRIPT = "cache_mpi_bound.py"


def _oks(outs: list[str], role: str) -> list[int]:
    return sorted(int(r) for r in re.findall(rf"rank (\d+): ok {role}", "\n".join(outs)))


GPU = pytest.mark.gpu


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("nprocs", "servers", "s_r", "s_w", "device"),
    [
        (2, 1, 0, 0, "host"),
        (4, 2, 2, 2, "host"),
        (3, 1, 2, 2, "cpu"),
        pytest.param(2, 1, 0, 0, "cuda", marks=GPU),
        pytest.param(3, 1, 2, 2, "cuda", marks=GPU),
    ],
    ids=[
        "1worker-1server-bounds0",
        "2workers-2servers-bounds2",
        "2workers-1server-bounds2-rows-in-tensors",
        "1worker-1server-bounds0-cuda",
        "2workers-sharing-the-gpu-1server-bounds2-cuda",
    ],
)
def test_read_bound_respected_over_mpi(
    nprocs: int, servers: int, s_r: int, s_w: int, device: str
) -> None:
    """``device``: where the cache keeps its rows (host records, or tensors on the CPU
    or on one GPU that the workers share)."""
    args = ["--servers", servers, "--read-bound", s_r, "--write-bound", s_w, "--device", device]
    outs = run_ranks(SCRIPT, nprocs, "mpi", [str(a) for a in args], timeout=130)
    workers = nprocs - servers
    assert _oks(outs, "worker") == list(range(workers)), outs
    assert _oks(outs, "server") == list(range(workers, nprocs)), outs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3, 4], ids=["1server", "2servers", "3servers"])
def test_the_copy_is_the_servers_row_over_mpi(nprocs: int) -> None:
    """``tests/cache/ranks/cache_mpi_local_step.py``: one worker, row-wise Adagrad and Adam
    tables, bounds (3, 0): every served copy (stepped by the optimizer with the state
    read from the servers) equals the servers' row right then; the SGD step does not."""
    outs = run_ranks("cache_mpi_local_step.py", nprocs, "mpi", [], timeout=130)
    assert _oks(outs, "worker") == [0], outs
    assert _oks(outs, "server") == list(range(1, nprocs)), outs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3, 4], ids=["1server", "2servers", "3servers"])
def test_written_back_copies_over_mpi(nprocs: int) -> None:
    """``tests/cache/ranks/cache_mpi_write_back.py``: one worker writes its copies back to
    the servers (``WRITE`` messages); served rows and the servers' rows and accumulators
    equal an uncached in-process run bit for bit."""
    outs = run_ranks("cache_mpi_write_back.py", nprocs, "mpi", [], timeout=130)
    assert _oks(outs, "worker") == [0], outs
    assert _oks(outs, "server") == list(range(1, nprocs)), outs
