"""``comm.init("auto")`` picks the backend from the launcher."""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ("mpi", "gloo"))
def test_auto_picks_launcher_backend(backend: str) -> None:
    # mpirun sets PMI_* -> mpi; RANK/WORLD_SIZE/MASTER_ADDR (torchrun style) -> gloo on CPU
    outs = run_ranks("comm_auto.py", 2, backend, args=[backend, "2"], timeout=100)
    found = re.findall(rf"rank (\d+): ok auto {backend}", "\n".join(outs))
    assert sorted(int(r) for r in found) == [0, 1], outs
