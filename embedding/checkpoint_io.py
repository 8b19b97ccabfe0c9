"""Writing a collection's tables from one rank: the collective half of ``save``."""

from __future__ import annotations

import os

import torch

from comm import ProcessGroup
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
    error: Exception | None = None
    if group.rank == 0:
        try:
            write_checkpoint(path, [(spec, [part]) for spec, part in parts], writer=writer)
        except Exception as e:  # every rank must learn it (one small allreduce)
            error = e
    if group.size > 1:
        failed = group.allreduce(torch.tensor([0 if error is None else 1], dtype=torch.int64))
        if error is None and int(failed[0]) > 0:
            raise RuntimeError(f"saving {str(path)!r} failed on rank 0 (see its error)")
    if error is not None:
        raise error
