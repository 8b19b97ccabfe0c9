"""Work that rank 0 does alone for the group (a save, creating shared tables), with
every rank learning whether it worked instead of waiting for a rank that failed."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from comm import ProcessGroup
from ps.checkpoint import TablePart, write_checkpoint
from ps.table import TableSpec


def agree(group: ProcessGroup, error: BaseException | None, what: str) -> None:
    """Collective (one small allreduce): raise on every rank if ``what`` failed on any
    rank: a failed rank raises its own ``error``, the others a RuntimeError naming the
    failed ranks. Also a barrier: no rank returns before every rank got here."""
    if group.size > 1:
        flags = torch.zeros(group.size, dtype=torch.int64)
        flags[group.rank] = 0 if error is None else 1
        failed = group.allreduce(flags, op="max")
        bad = [r for r in range(group.size) if int(failed[r])]
        if error is None and bad:
            who = (
                f"rank {bad[0]} (see its error)"
                if len(bad) == 1
                else f"ranks {bad} (see their errors)"
            )
            raise RuntimeError(f"{what} failed on {who}")
    if error is not None:
        raise error


def run_on_rank0(group: ProcessGroup, action: Callable[[], Any], what: str) -> None:
    """Collective: rank 0 runs ``action``; every rank returns once it is done, or raises
    if it failed (rank 0 with its own error, the others naming rank 0)."""
    error: Exception | None = None
    if group.rank == 0:
        try:
            action()
        except Exception as e:  # every rank must learn it (one small allreduce)
            error = e
    agree(group, error, what)


def write_from_rank0(
    group: ProcessGroup,
    path: str | os.PathLike[str],
    parts: list[tuple[TableSpec, TablePart]],
    writer: str,
) -> None:
    """Collective: rank 0 writes ``parts`` (whole tables, the same on every rank) to the ps
    checkpoint ``path``; every rank returns once it is complete, or raises if rank 0's
    write failed (rank 0 with its own error, the others naming it) instead of waiting."""
    run_on_rank0(
        group,
        lambda: write_checkpoint(path, [(spec, [part]) for spec, part in parts], writer=writer),
        f"saving {str(path)!r}",
    )
