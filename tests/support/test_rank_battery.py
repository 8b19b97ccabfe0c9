"""The rank battery: a failing check fails its own test and no other.

A battery of three checks (ok, a check that raises on rank 0 while its peers wait in a
collective, ok) at 1, 2 and 4 ranks under mpirun and gloo: the checks before and after
the failing one report their "ok" lines, the failing one's report names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_battery import RankBattery


def probe_plan(backend: str, nprocs: int, workdir: Path) -> list[list[str]]:
    return [
        ["battery_probe", "ok", "before"],
        ["battery_probe", "fail"],
        ["battery_probe", "ok", "after"],
    ]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_a_failed_check_fails_alone(tmp_path: Path, backend: str, nprocs: int) -> None:
    battery = RankBattery(tmp_path, checks=probe_plan)
    text = battery.output(backend, nprocs)
    for name in ("before", "after"):
        lines = [f"rank {r}/{nprocs}: probe {name} ok" for r in range(nprocs)]
        battery.expect(backend, nprocs, lines)  # raises with the output if one is missing
    assert "this check fails on purpose" in text, text
    assert "==== the launch failed in check 'battery_probe fail'" in text, text
    assert text.count("==== the launch failed") == 1, text
