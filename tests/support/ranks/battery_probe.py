"""Rank script for tests/support/test_rank_battery.py: ``run(group, ["ok", NAME])`` prints
``probe NAME ok`` after a barrier; ``run(group, ["fail"])`` raises on rank 0 while the
other ranks wait in a barrier that rank 0 never joins (as a real failed check leaves
its peers inside a collective)."""

from __future__ import annotations

import comm


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    if args[:1] == ["ok"]:
        group.barrier()
        print(f"rank {group.rank}/{group.size}: probe {args[1]} ok", flush=True)
        return
    if args == ["fail"]:
        if group.rank == 0:
            raise AssertionError("probe: this check fails on purpose")
        group.barrier()
        return
    raise ValueError(f"expected 'ok NAME' or 'fail', got {args!r}")
