"""Triton gather + pool over one flat table-batched weight (FBGEMM TBE-like).

::

    weight  [R, D]       every table of the group; ids already offset by table base
    ids     [N]          int32/int64 row of each occurrence
    offsets [B + 1]      bag b is ids[offsets[b]:offsets[b + 1]] (B = tables x batch)
    psw     [N] or None  per-id weight
    out     [B, D]       sum_i psw_i * weight[ids_i]   (mean: / len(bag); empty bag: 0)

One program per (bag, column tile): it walks its bag ``BLOCK_N`` ids at a time,
loads a ``[BLOCK_N, BLOCK_D]`` tile of rows and adds the column sums into a
float32 accumulator. Columns past ``D`` are masked, so ``D`` need not be a power
of two. Nothing is written twice, so there are no atomics and the result is
deterministic.

``triton`` must be importable; ``TRITON_INTERPRET=1`` must be set before this
module is imported to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embedding.kernels._checks import block_d, check_lookup_args, check_mode

#: Widest column tile; wider rows take several programs along the grid's 2nd axis.
MAX_BLOCK_D = 256
#: Ids loaded per step of a bag's loop.
BLOCK_N = 16


@triton.jit
def _pool_kernel(
    weight_ptr,
    stride_w,
    ids_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    D,
    HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_mask = cols < D
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for pos in range(start, end, BLOCK_N):
        idx = pos + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        id_mask = idx < end
        rows = tl.load(ids_ptr + idx, mask=id_mask, other=0).to(tl.int64)
        tile = tl.load(
            weight_ptr + rows[:, None] * stride_w + cols[None, :],
            mask=id_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if HAS_WEIGHTS:
            w = tl.load(psw_ptr + idx, mask=id_mask, other=0.0).to(tl.float32)
            tile = tile * w[:, None]
        acc += tl.sum(tile, axis=0)
    if MEAN:
        length = tl.maximum(end - start, 1).to(tl.float32)
        acc = tl.div_rn(acc, tl.zeros_like(acc) + length)  # div_rn does not broadcast
    tl.store(out_ptr + bag * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Pooled rows ``[B, D]`` (dtype of ``weight``) of the bags ``offsets`` cuts ``ids`` into.

    ``mode`` is ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag
    length, as FBGEMM's TBE does; ``F.embedding_bag`` refuses weights with mean).
    Equal to ``F.embedding_bag(ids, weight, offsets, mode=mode,
    per_sample_weights=psw, include_last_offset=True)`` up to float32 rounding.
    The result carries no autograd graph: the caller's ``autograd.Function`` routes
    the gradient to :func:`embedding.kernels.triton_adagrad.fused_backward_rowwise_adagrad_`.
    ``validate=False`` skips the checks that read tensor values (a CUDA sync).
    """
    mean = check_mode("pooled_lookup", mode)
    check_lookup_args("pooled_lookup", weight, ids, offsets, per_sample_weights, validate=validate)
    num_bags = offsets.numel() - 1
    dim = weight.shape[1]
    out = torch.empty((num_bags, dim), dtype=weight.dtype, device=weight.device)  # [B, D]
    if num_bags == 0 or dim == 0:
        return out
    bd = block_d(dim, MAX_BLOCK_D)
    ids_c = ids.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else ids_c
    grid = (num_bags, triton.cdiv(dim, bd))
    _pool_kernel[grid](
        weight,
        weight.stride(0),
        ids_c,
        offsets.contiguous(),
        psw,
        out,
        dim,
        HAS_WEIGHTS=per_sample_weights is not None,
        MEAN=mean,
        BLOCK_N=BLOCK_N,
        BLOCK_D=bd,
    )
    return out
