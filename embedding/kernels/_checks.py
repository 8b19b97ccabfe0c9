"""Argument checks shared by the Triton kernels (cheap ones always; data ones on request)."""

from __future__ import annotations

import torch

MODES = ("sum", "mean")


def check_mode(fn: str, mode: object) -> bool:
    """Validate ``mode``; returns True for ``"mean"``."""
    if mode not in MODES:
        raise ValueError(f"{fn}: mode must be one of {MODES}, got {mode!r}")
    return mode == "mean"


def check_lookup_args(
    fn: str,
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    validate: bool,
) -> None:
    """Shapes, dtypes and devices of a pooled lookup; with ``validate`` also the values.

    ``validate=True`` reads ``offsets[0]``, ``offsets[-1]``, the min/max id and
    the monotonicity of ``offsets``: a device sync on CUDA, so hot loops whose
    batches were already checked (``KeyedJaggedIds`` does) pass ``validate=False``.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(
            f"{fn}: weight must be a 2-D floating tensor [rows, dim], "
            f"got {weight.dtype} shape {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError(f"{fn}: weight rows must be contiguous, got strides {weight.stride()}")
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"{fn}: {name} must be a 1-D int32/int64 tensor, "
                f"got {t.dtype} shape {tuple(t.shape)}"
            )
        if t.device != weight.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but weight is on {weight.device}")
    if offsets.numel() < 1:
        raise ValueError(f"{fn}: offsets must have num_bags + 1 >= 1 entries, got 0")
    if per_sample_weights is not None:
        if per_sample_weights.shape != ids.shape or not per_sample_weights.is_floating_point():
            raise ValueError(
                f"{fn}: per_sample_weights must be a floating tensor shaped like ids "
                f"{tuple(ids.shape)}, got {per_sample_weights.dtype} "
                f"shape {tuple(per_sample_weights.shape)}"
            )
        if per_sample_weights.device != weight.device:
            raise ValueError(
                f"{fn}: per_sample_weights is on {per_sample_weights.device} "
                f"but weight is on {weight.device}"
            )
    if not validate:
        return
    n = ids.numel()
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != n:
        raise ValueError(
            f"{fn}: offsets must start at 0 and end at len(ids) = {n}, got {first} and {last}"
        )
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        bad = int(torch.nonzero(offsets[1:] < offsets[:-1])[0, 0])
        raise ValueError(
            f"{fn}: offsets must be non-decreasing, but offsets[{bad}] = {int(offsets[bad])} "
            f"> offsets[{bad + 1}] = {int(offsets[bad + 1])}"
        )
    if n:
        lo, hi = int(ids.min()), int(ids.max())
        rows = weight.shape[0]
        if lo < 0 or hi >= rows:
            raise ValueError(
                f"{fn}: ids must be in [0, {rows}) (weight rows), got min {lo} max {hi}"
            )


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (plain Python: ``triton.cdiv`` costs microseconds)."""
    return -(-a // b)


def block_d(dim: int, cap: int) -> int:
    """Power-of-two tile width for ``dim`` columns, at most ``cap`` (masks cover the rest)."""
    b = 1
    while b < dim and b < cap:
        b *= 2
    return b


def pool_bucket(num_ids: int, num_bags: int) -> int:
    """Average ids per bag rounded up to a power of two, capped at 64 (a tuning key).

    From sizes the host already knows (``len(ids)``, ``len(offsets) - 1``): no sync.
    """
    avg = -(-num_ids // max(num_bags, 1))  # ceil
    return min(block_d(max(avg, 1), 64), 64)
