"""Tables as module state: what ``.to()``, ``state_dict()`` and ``load_state_dict()``
need from every placement's module.

``Module._apply(fn)`` is how torch moves a module (``.to``, ``.cuda``, ``.cpu``) and
casts it (``.half``, ``.to(dtype)``). Table storage follows a move but never a cast:
the optimizers and kernels read float32 rows and int64 clocks, and rounding a table
would lose its values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
