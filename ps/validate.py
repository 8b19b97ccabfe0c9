"""Request checks shared by every store.

They run before a store changes anything, so a bad request leaves the table as it
was, and every store reports the same mistake with the same words (table name,
offending value, what was expected).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ps.table import TableSpec


def unknown_table(name: object, known: Iterable[str]) -> ValueError:
    names = sorted(known)
    return ValueError(f"unknown table {name!r}; known tables: {names}")


def check_ids(spec: TableSpec, ids: object, op: str) -> torch.Tensor:
    """``ids`` must be a 1-D int64 tensor of row ids in ``[0, num_rows)``; returns it."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"{op} table {spec.name!r}: ids must be a torch.Tensor of int64, "
            f"got {type(ids).__name__}"
        )
    if ids.dtype != torch.int64:
        raise TypeError(f"{op} table {spec.name!r}: ids must be int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{op} table {spec.name!r}: ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() > 0:
        bad = (ids < 0) | (ids >= spec.num_rows)  # [N]
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"{op} table {spec.name!r}: id {int(ids[pos])} at position {pos} is out of "
                f"range; valid ids are [0, {spec.num_rows})"
            )
    return ids


def check_grads(spec: TableSpec, ids: torch.Tensor, grads: object) -> torch.Tensor:
    """``grads`` must be float32 ``[len(ids), dim]`` and finite; returns it."""
    if not isinstance(grads, torch.Tensor):
        raise TypeError(
            f"push table {spec.name!r}: grads must be a torch.Tensor of float32, "
            f"got {type(grads).__name__}"
        )
    if grads.dtype != torch.float32:
        raise TypeError(f"push table {spec.name!r}: grads must be float32, got {grads.dtype}")
    expected = (int(ids.shape[0]), spec.dim)
    if tuple(grads.shape) != expected:
        raise ValueError(
            f"push table {spec.name!r}: grads have shape {tuple(grads.shape)}, "
            f"expected {expected} (len(ids), dim)"
        )
    if grads.numel() > 0:
        finite = torch.isfinite(grads).all(dim=1)  # [N]
        if not bool(finite.all()):
            pos = int(torch.nonzero(~finite)[0, 0])
            raise ValueError(
                f"push table {spec.name!r}: gradient of row id {int(ids[pos])} (position "
                f"{pos}) contains NaN or Inf; nothing was applied"
            )
    return grads
