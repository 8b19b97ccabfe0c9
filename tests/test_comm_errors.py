"""Bad input raises on every rank with the numbers; dead peers raise CommTimeoutError."""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks

BACKENDS = ("mpi", "gloo")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", (2, 4))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend: str, nprocs: int) -> None:
    outs = run_ranks("comm_errors.py", nprocs, backend, timeout=220)
    found = re.findall(r"rank (\d+): ok (\d+) errors", "\n".join(outs))
    assert sorted(int(r) for r, _ in found) == list(range(nprocs)), outs
    assert {int(n) for _, n in found} == {int(found[0][1])}, found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", (2, 4))
@pytest.mark.parametrize("backend", BACKENDS)
def test_silent_peer_times_out(backend: str, nprocs: int) -> None:
    outs = run_ranks("comm_timeout.py", nprocs, backend, timeout=100)
    found = dict(re.findall(r"rank (\d+): ok timeout ([0-9.]+)", "\n".join(outs)))
    assert sorted(int(r) for r in found) == list(range(nprocs)), outs
    assert 0.9 <= float(found["0"]) < 5.0, found  # the 1 s timeout, not the group's 60 s
