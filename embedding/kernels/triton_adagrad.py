"""Triton backward of the pooled lookup fused with row-wise Adagrad, in place.

Same layout as :mod:`embedding.kernels.triton_pool`; ``grad_output`` ``[B, D]`` is
the gradient of the pooled output. The gradient of a touched row ``r`` is::

    g_r = sum over occurrences i with ids_i == r of  psw_i / len(bag_i)^[mean] * grad_output[bag_i]

and row-wise Adagrad (exactly :class:`ps.optimizers.RowWiseAdagrad.apply`)::

    state[r] += mean(g_r ** 2)
    weight[r] -= lr * (g_r / (sqrt(state[r]) + eps))

Deterministic and race-free without atomics: the host sorts the occurrences by
row with a stable ``torch.sort`` and cuts them into runs of equal rows (a CSR:
``row_ptr [U + 1]``, per-occurrence bag and scale in sorted order). Then ONE
program per unique row sums its run in a fixed order, updates its own state entry
and its own row. Rows not in the batch are not touched at all (lazy, like the ps).
Divisions and the square root use IEEE round-to-nearest (``div_rn``/``sqrt_rn``)
so the GPU matches the torch formula to the last bits, not just approximately.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embedding.kernels._checks import block_d, check_lookup_args, check_mode

#: Widest column tile; a wider row is handled in several passes by the same program.
MAX_BLOCK_D = 1024
#: Occurrences summed per step of a row's loop.
BLOCK_N = 16


@triton.jit
def _row_grad(
    grad_ptr,
    stride_g,
    occ_bag_ptr,
    occ_scale_ptr,
    start,
    end,
    cols,
    col_mask,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Columns ``cols`` of one row's gradient: the scaled sum of its occurrences' bag grads."""
    g = tl.zeros([BLOCK_D], dtype=tl.float32)
    for pos in range(start, end, BLOCK_N):
        idx = pos + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        m = idx < end
        bags = tl.load(occ_bag_ptr + idx, mask=m, other=0)
        tile = tl.load(
            grad_ptr + bags[:, None] * stride_g + cols[None, :],
            mask=m[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if HAS_SCALE:
            s = tl.load(occ_scale_ptr + idx, mask=m, other=0.0)
            tile = tile * s[:, None]
        g += tl.sum(tile, axis=0)
    return g


@triton.jit
def _rowwise_adagrad_kernel(
    weight_ptr,
    stride_w,
    state_ptr,
    clocks_ptr,
    uniq_ptr,
    row_ptr_ptr,
    occ_bag_ptr,
    occ_scale_ptr,
    grad_ptr,
    stride_g,
    D,
    Df,
    lr,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_CLOCKS: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    row = tl.load(uniq_ptr + u).to(tl.int64)
    start = tl.load(row_ptr_ptr + u)
    end = tl.load(row_ptr_ptr + u + 1)
    lane = tl.arange(0, BLOCK_D)
    if NUM_D_BLOCKS == 1:
        # The whole row fits one tile: sum the occurrences once, keep g in registers.
        col_mask = lane < D
        g = _row_grad(
            grad_ptr, stride_g, occ_bag_ptr, occ_scale_ptr, start, end, lane, col_mask,
            HAS_SCALE, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        acc = tl.load(state_ptr + row) + tl.div_rn(tl.sum(g * g, axis=0), Df)
        tl.store(state_ptr + row, acc)
        denom = tl.sqrt_rn(acc) + eps
        ptrs = weight_ptr + row * stride_w + lane
        w = tl.load(ptrs, mask=col_mask, other=0.0).to(tl.float32)
        w = w - lr * tl.div_rn(g, tl.zeros_like(g) + denom)
        tl.store(ptrs, w.to(weight_ptr.dtype.element_ty), mask=col_mask)
    else:
        # Wide rows: pass 1 sums g^2 tile by tile, pass 2 recomputes each tile of g
        # (cheaper than a scratch [U, D] buffer) and updates it.
        sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for blk in range(NUM_D_BLOCKS):
            cols = blk * BLOCK_D + lane
            col_mask = cols < D
            g = _row_grad(
                grad_ptr, stride_g, occ_bag_ptr, occ_scale_ptr, start, end, cols, col_mask,
                HAS_SCALE, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            sq += g * g
        acc = tl.load(state_ptr + row) + tl.div_rn(tl.sum(sq, axis=0), Df)
        tl.store(state_ptr + row, acc)
        denom = tl.sqrt_rn(acc) + eps
        for blk in range(NUM_D_BLOCKS):
            cols = blk * BLOCK_D + lane
            col_mask = cols < D
            g = _row_grad(
                grad_ptr, stride_g, occ_bag_ptr, occ_scale_ptr, start, end, cols, col_mask,
                HAS_SCALE, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            ptrs = weight_ptr + row * stride_w + cols
            w = tl.load(ptrs, mask=col_mask, other=0.0).to(tl.float32)
            w = w - lr * tl.div_rn(g, tl.zeros_like(g) + denom)
            tl.store(ptrs, w.to(weight_ptr.dtype.element_ty), mask=col_mask)
    if HAS_CLOCKS:
        tl.store(clocks_ptr + row, tl.load(clocks_ptr + row) + 1)


def occurrence_csr(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group the occurrences by row: ``(unique [U], row_ptr [U+1], bag [N], scale [N])``.

    ``unique`` is sorted; the occurrences of ``unique[u]`` are positions
    ``row_ptr[u]:row_ptr[u+1]`` of ``bag`` (their bag index) and ``scale`` (their
    factor), in their original order (stable sort), so the sums are reproducible.
    """
    n = ids.numel()
    lengths = offsets[1:] - offsets[:-1]  # [B]
    bag_of = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=ids.device), lengths, output_size=n
    )  # [N]
    sorted_ids, order = torch.sort(ids, stable=True)  # [N], [N]
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # [U], [U]
    row_ptr = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    occ_scale = scale[order].contiguous() if scale is not None else None
    return unique, row_ptr, bag_of[order].contiguous(), occ_scale


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
    """Backward of :func:`~embedding.kernels.triton_pool.pooled_lookup` + row-wise Adagrad.

    Updates ``weight`` ``[R, D]`` and ``state`` (float32, ``[R]`` or ``[R, 1]``,
    contiguous) in place for the rows in ``ids``; ``grad_output`` is ``[B, D]``
    with ``B = len(offsets) - 1``. ``clocks`` (int64 ``[R]``, optional) gets +1
    per touched row, as a ps store counts updates. ``validate=False`` skips the
    checks that read tensor values (a CUDA sync).
    """
    fn = "fused_backward_rowwise_adagrad_"
    mean = check_mode(fn, mode)
    check_lookup_args(fn, weight, ids, offsets, per_sample_weights, validate=validate)
    rows, dim = weight.shape
    num_bags = offsets.numel() - 1
    if state.dtype != torch.float32 or state.numel() != rows or not state.is_contiguous():
        raise ValueError(
            f"{fn}: state must be a contiguous float32 tensor with one entry per weight row "
            f"({rows}), got {state.dtype} shape {tuple(state.shape)}"
        )
    if tuple(grad_output.shape) != (num_bags, dim) or grad_output.stride(-1) != 1:
        raise ValueError(
            f"{fn}: grad_output must be [num_bags, dim] = [{num_bags}, {dim}] with contiguous "
            f"rows, got shape {tuple(grad_output.shape)} strides {grad_output.stride()}"
        )
    if clocks is not None and (
        clocks.dtype != torch.int64 or clocks.numel() != rows or not clocks.is_contiguous()
    ):
        raise ValueError(
            f"{fn}: clocks must be a contiguous int64 tensor with {rows} entries, "
            f"got {clocks.dtype} shape {tuple(clocks.shape)}"
        )
    for name, t in (("state", state), ("grad_output", grad_output)):
        if t.device != weight.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but weight is on {weight.device}")
    if not (lr > 0 and eps > 0):
        raise ValueError(f"{fn}: lr and eps must be > 0, got lr={lr} eps={eps}")
    if ids.numel() == 0 or dim == 0:
        return

    # Per-occurrence factor: the user weight, divided by the bag length for mean.
    scale: torch.Tensor | None = None
    if per_sample_weights is not None:
        scale = per_sample_weights.to(torch.float32)
    if mean:
        counts = offsets[1:] - offsets[:-1]  # [B]
        occ_len = torch.repeat_interleave(
            counts.to(torch.float32), counts, output_size=ids.numel()
        )  # [N], >= 1: every occurrence sits in a non-empty bag
        scale = 1.0 / occ_len if scale is None else scale / occ_len
    unique, row_ptr, occ_bag, occ_scale = occurrence_csr(ids, offsets, scale)

    bd = block_d(dim, MAX_BLOCK_D)
    _rowwise_adagrad_kernel[(unique.numel(),)](
        weight,
        weight.stride(0),
        state,
        clocks if clocks is not None else state,
        unique,
        row_ptr,
        occ_bag,
        occ_scale if occ_scale is not None else grad_output,
        grad_output,
        grad_output.stride(0),
        dim,
        float(dim),
        float(lr),
        float(eps),
        HAS_SCALE=occ_scale is not None,
        HAS_CLOCKS=clocks is not None,
        NUM_D_BLOCKS=triton.cdiv(dim, bd),
        BLOCK_N=BLOCK_N,
        BLOCK_D=bd,
    )


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
    """Row-wise Adagrad on already coalesced gradients: ``grads[u]`` for row ``rows[u]``.

    For callers that combine row gradients themselves first (data parallel:
    allgatherv of every rank's ``(rows, grads)``, then coalesce). ``rows`` int64
    ``[U]`` must be distinct (not checked: duplicates would race), ``grads``
    ``[U, D]``; ``weight``/``state``/``clocks`` as in :func:`fused_backward_rowwise_adagrad_`.
    It is the same kernel with one "occurrence" per row.
    """
    fn = "rowwise_adagrad_rows_"
    n, dim = weight.shape
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != weight.device:
        raise TypeError(f"{fn}: rows must be a 1-D int64 tensor on {weight.device}, got "
                        f"{rows.dtype} shape {tuple(rows.shape)} on {rows.device}")  # fmt: skip
    u = rows.numel()
    offsets = torch.arange(u + 1, dtype=torch.int64, device=weight.device)  # one row per "bag"
    if tuple(grads.shape) != (u, dim):
        raise ValueError(
            f"{fn}: grads must be [len(rows), dim] = [{u}, {dim}], got {tuple(grads.shape)}"
        )
    fused_backward_rowwise_adagrad_(
        weight, state, rows, offsets, grads,
        mode="sum", per_sample_weights=None, lr=lr, eps=eps, clocks=clocks, validate=False,
    )  # fmt: skip
