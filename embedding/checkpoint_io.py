"""Embedding tables written by rank 0 alone for the group (whole tables, the same on
every rank), with every rank learning whether the write worked instead of waiting for
a rank that failed (:func:`comm.run_on_rank0`)."""

from __future__ import annotations

import os

from comm import ProcessGroup, run_on_rank0
from ps.checkpoint import TablePart, write_checkpoint
from ps.table import TableSpec


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
