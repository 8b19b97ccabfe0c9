"""Tables as module state: what ``.to()``, ``state_dict()`` and ``load_state_dict()``
need from every placement's module.

``Module._apply(fn)`` is how torch moves a module (``.to``, ``.cuda``, ``.cpu``) and
casts it (``.half``, ``.to(dtype)``). Table storage follows a move but never a cast:
rows keep their table's type (``TableConfig.dtype``), state float32 and clocks int64,
and rounding a table would lose its values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch

from ps.checkpoint import TablePart
from ps.table import TORCH_ROW_DTYPES

PART_KEYS = ("ids", "weight", "state", "clocks")  # a table's entries: prefix + name + "." + key


def target_device(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.device:
    """Where ``Module._apply``'s ``fn`` would put ``t`` (asked of an empty tensor)."""
    return fn(torch.empty(0, dtype=t.dtype, device=t.device)).device


def apply_keep_dtype(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` when it keeps the dtype (a move); else ``t`` moved where ``fn`` would put
    it, dtype kept (tables stay float32 rows and int64 clocks)."""
    probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
    if probe.dtype == t.dtype:
        return fn(t)
    return t.to(probe.device)


def copy_checked(target: torch.Tensor, value: object, what: str) -> str | None:
    """Copy a state-dict entry into ``target`` in place; an error text (nothing copied)
    when it is not a tensor of ``target``'s shape and kind (float or integer). A float
    of another width converts to ``target``'s (narrower: rounded to the nearest)."""
    if not isinstance(value, torch.Tensor):
        return f"{what}: expected a tensor, got {type(value).__name__}"
    if tuple(value.shape) != tuple(target.shape) or (
        value.is_floating_point() != target.is_floating_point()
    ):
        return (
            f"{what}: got {value.dtype} {tuple(value.shape)}, expected {target.dtype} "
            f"{tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(value)
    return None


def warn_converted(tables: Mapping[str, tuple[torch.dtype, torch.dtype]], source: str) -> None:
    """One warning for a load that converted rows of another type: ``tables`` maps each
    table to ``(saved type, its type)``; ``source`` says what was loaded."""
    names = ", ".join(f"{name!r} ({_short(a)} -> {_short(b)})" for name, (a, b) in tables.items())
    warnings.warn(
        f"loading {source}: the rows of table(s) {names} were saved as another type and "
        "were converted to the table's row type (rounded to the nearest where it cannot "
        "hold them)",
        stacklevel=3,
    )


def _short(dtype: torch.dtype) -> str:
    """``"fp16"`` for torch.float16 (the names of ``TableConfig.dtype``)."""
    names = {v: k for k, v in TORCH_ROW_DTYPES.items()}
    return names.get(dtype, str(dtype))


def part_from_state_dict(
    state_dict: Mapping[str, object], prefix: str, name: str, ours: set[str], missing: list[str]
) -> TablePart | None:
    """Table ``name``'s rows in ``state_dict`` (entries ``<prefix><name>.<key>`` for
    :data:`PART_KEYS`) as a host :class:`TablePart`. Adds its keys to ``ours``; None (its
    absent keys added to ``missing``) when some are not there; TypeError when an entry is
    not a tensor (the caller names the table)."""
    keys = [f"{prefix}{name}.{k}" for k in PART_KEYS]
    ours.update(keys)
    absent = [k for k in keys if k not in state_dict]
    if absent:
        missing.extend(absent)
        return None
    values: list[torch.Tensor] = []
    for key in keys:
        v = state_dict[key]
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{key}: expected a tensor, got {type(v).__name__}")
        values.append(v.detach())
    ids, weights, state, clocks = values
    return TablePart(
        ids=ids.to("cpu", torch.int64),
        weights=weights.to("cpu", torch.float32),
        state=state.to("cpu", torch.float32),
        clocks=clocks.to("cpu", torch.int64),
    )
