"""Tables as module state: what ``.to()``, ``state_dict()`` and ``load_state_dict()``
need from every placement's module.

``Module._apply(fn)`` is how torch moves a module (``.to``, ``.cuda``, ``.cpu``) and
casts it (``.half``, ``.to(dtype)``). Table storage follows a move but never a cast:
the optimizers and kernels read float32 rows and int64 clocks, and rounding a table
would lose its values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ps.checkpoint import TablePart

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
    when it is not a tensor of ``target``'s shape and kind (float or integer)."""
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
