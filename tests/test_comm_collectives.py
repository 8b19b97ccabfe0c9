"""Every collective at 1, 2 and 4 ranks under mpirun and torch.distributed gloo.

One launch per (backend, ranks) runs the whole numpy-checked battery of
``tests/ranks/comm_cases.py`` (with validation on, then off); see that file for
the cases. Bad input, timeouts and launcher detection have their own files.
"""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks

BACKENDS = ("mpi", "gloo")
RANKS = (1, 2, 4)


def ok_counts(outputs: list[str], what: str) -> dict[int, int]:
    """``{rank: N}`` from every ``rank R: ok N <what>`` line in the launch's output."""
    text = "\n".join(outputs)
    return {int(r): int(n) for r, n in re.findall(rf"rank (\d+): ok (\d+) {what}", text)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", RANKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_battery(backend: str, nprocs: int) -> None:
    outs = run_ranks("comm_collectives.py", nprocs, backend, args=["1234"], timeout=280)
    counts = ok_counts(outs, "cases")
    assert sorted(counts) == list(range(nprocs)), outs
    assert len(set(counts.values())) == 1, f"ranks ran different numbers of cases: {counts}"
    assert counts[0] > 300, counts  # the whole battery ran, twice (validate on and off)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_other_seed_subset(backend: str) -> None:
    """A second seed on the collectives whose splits and values depend on it."""
    outs = run_ranks(
        "comm_collectives.py", 2, backend, args=["99", "alltoallv", "async", "split"], timeout=180
    )
    counts = ok_counts(outs, "cases")
    assert sorted(counts) == [0, 1], outs
