"""Every multi-rank comm check at 1, 2 and 4 ranks, under mpirun and torch.distributed gloo.

One launch per (backend, ranks) runs ``tests/comm/ranks/comm_suite.py``: launcher
detection by ``comm.init("auto")``, the whole numpy-checked battery of
``tests/comm/ranks/comm_cases.py`` (validation on, then off), a second seed on the
seed-dependent suites, bad input on every rank (``comm_errors.py``) and a silent
peer timing out (``comm_timeout.py``). The tests below each read their lines of
that one launch's output. A failed launch fails every test of its (backend, ranks).
"""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks

BACKENDS = ("mpi", "gloo")
RANKS = (1, 2, 4)
LAUNCHES = [(backend, nprocs) for backend in BACKENDS for nprocs in RANKS]


@pytest.fixture(scope="module", params=LAUNCHES, ids=[f"{b}-{n}" for b, n in LAUNCHES])
def suite(request: pytest.FixtureRequest) -> tuple[str, int, str]:
    """(backend, ranks, every rank's output) of the launch for that (backend, ranks)."""
    backend, nprocs = request.param
    outs = run_ranks("comm_suite.py", nprocs, backend, args=[str(nprocs)], timeout=400)
    return backend, nprocs, "\n".join(outs)


def per_rank(text: str, what: str) -> dict[int, str]:
    """``{rank: value}`` from every ``rank R: ok <what>`` line (``what`` is a regex
    with one group). mpirun passes the ranks' lines through one stream, and one
    rank's line may run into the next one's, so the values must end by themselves."""
    return {int(r): v for r, v in re.findall(rf"rank (\d+): ok {what}", text)}


@pytest.mark.timeout(450)  # the first test of each launch waits for it
def test_auto_picks_launcher_backend(suite: tuple[str, int, str]) -> None:
    # mpirun sets PMI_* -> mpi; RANK/WORLD_SIZE/MASTER_ADDR (torchrun style) -> gloo on CPU
    backend, nprocs, text = suite
    found = per_rank(text, r"auto (mpi|gloo)")  # mpirun may join lines: no \w+
    assert found == dict.fromkeys(range(nprocs), backend), text


@pytest.mark.timeout(450)
def test_collectives_battery(suite: tuple[str, int, str]) -> None:
    _, nprocs, text = suite
    counts = {r: int(n) for r, n in per_rank(text, r"(\d+) cases").items()}
    assert sorted(counts) == list(range(nprocs)), text
    assert len(set(counts.values())) == 1, f"ranks ran different numbers of cases: {counts}"
    assert counts[0] > 300, counts  # the whole battery ran, twice (validate on and off)


@pytest.mark.timeout(450)
def test_collectives_other_seed_subset(suite: tuple[str, int, str]) -> None:
    """A second seed on the collectives whose splits and values depend on it."""
    _, nprocs, text = suite
    counts = {r: int(n) for r, n in per_rank(text, r"(\d+) seed-99 cases").items()}
    assert sorted(counts) == list(range(nprocs)), text
    assert len(set(counts.values())) == 1 and counts[0] > 0, counts


@pytest.mark.timeout(450)
def test_bad_input_raises_on_every_rank(suite: tuple[str, int, str]) -> None:
    _, nprocs, text = suite
    counts = {r: int(n) for r, n in per_rank(text, r"(\d+) errors").items()}
    assert sorted(counts) == list(range(nprocs)), text
    assert len(set(counts.values())) == 1, counts


@pytest.mark.timeout(450)
def test_silent_peer_times_out(suite: tuple[str, int, str]) -> None:
    _, nprocs, text = suite
    found = {r: float(s) for r, s in per_rank(text, r"timeout ([0-9.]+)").items()}
    if nprocs == 1:
        assert not found, text  # a lone rank has no peer to wait for
        return
    assert sorted(found) == list(range(nprocs)), text
    assert 0.9 <= found[0] < 5.0, found  # the 1 s timeout, not the group's 60 s
