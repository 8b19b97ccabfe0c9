"""Row-wise Adagrad entry points of the fused Triton backward (kept names; thin wrappers).

Both call :mod:`embedding.kernels.triton_optimizers` with a
:class:`ps.optimizers.RowWiseAdagrad` built from ``lr`` and ``eps``, whose update is::

    state[r] += mean(g_r ** 2)
    weight[r] -= lr * g_r / (sqrt(state[r]) + eps)

``state`` is float32 ``[R]`` or ``[R, 1]`` (the ps layout).
"""

from __future__ import annotations

import torch

from embedding.kernels.triton_optimizers import apply_rows_, fused_backward_
from ps.optimizers import RowWiseAdagrad


def _optimizer(fn: str, lr: float, eps: float) -> RowWiseAdagrad:
    if not (lr > 0 and eps > 0):
        raise ValueError(f"{fn}: lr and eps must be > 0, got lr={lr} eps={eps}")
    return RowWiseAdagrad(lr=float(lr), eps=float(eps))


def fused_backward_rowwise_adagrad_(
    weight: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    grad_output: torch.Tensor,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    lr: float,
    eps: float,
    clocks: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    """Backward of :func:`~embedding.kernels.triton_pool.pooled_lookup` + row-wise Adagrad,
    in place (:func:`~embedding.kernels.triton_optimizers.fused_backward_`)."""
    opt = _optimizer("fused_backward_rowwise_adagrad_", lr, eps)
    fused_backward_(
        weight, state, ids, offsets, grad_output, opt,
        mode=mode, per_sample_weights=per_sample_weights, clocks=clocks, validate=validate,
    )  # fmt: skip


def rowwise_adagrad_rows_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
    clocks: torch.Tensor | None = None,
) -> None:
    """Row-wise Adagrad on already coalesced gradients ``grads[u]`` for distinct ``rows[u]``
    (:func:`~embedding.kernels.triton_optimizers.apply_rows_`)."""
    opt = _optimizer("rowwise_adagrad_rows_", lr, eps)
    apply_rows_(weight, state, rows, grads, opt, clocks=clocks)
