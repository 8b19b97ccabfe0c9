"""Triton backward of the pooled lookup fused with every ps optimizer, in place.

Same layout as :mod:`embedding.kernels.triton_pool`; ``grad_output`` ``[B, D]`` is
the gradient of the pooled output and ``state`` ``[R, S]`` the ps optimizer's
per-row state (``S = optimizer.state_dim(D)``, the columns
:mod:`ps.optimizers` documents). The gradient of a touched row ``r`` is::

    g_r = sum over occurrences i with ids_i == r of  psw_i / len(bag_i)^[mean] * grad_output[bag_i]

and the update is the optimizer's own ``apply`` (:class:`ps.optimizers.SGD`,
``RowWiseAdagrad``, ``Adagrad``, ``Adam``, ``FTRL``), written out per row in one
kernel family switched by the ``OPT`` constexpr. Divisions and square roots are
IEEE round-to-nearest (``div_rn``/``sqrt_rn``): Triton's plain ``/`` and ``sqrt``
are approximate on NVIDIA GPUs and the point is to match the torch formula.

Per call, with no host synchronisation (every size is known on the host)::

    1. _occurrence_kernel   bag [N] int32 (bag of each id) and, for weights or
                            mean, scale [N] float32 = psw_i / len(bag_i)^[mean]
    2. torch.sort(stable)   sorted ids [N] and order [N] (int32 keys when R < 2**31);
       torch.searchsorted   run_end [N]: where the run of equal ids at each position ends
    3. _update_kernel       program p owns sorted positions [p*ROWS, (p+1)*ROWS);
                            each position that starts a run of equal ids (a "lead")
                            owns its run; the program sums its leads' runs (one
                            contiguous stretch of sorted positions) BLOCK_N
                            occurrences per step into g [ROWS, BLOCK_D] (scale *
                            grad_output[bag], routed to lanes by a one-hot dot;
                            +-Inf and NaN go around the dot, to their own lane),
                            then each lead applies the optimizer to its row and
                            +1 to its clock

Each touched row is updated by exactly one lane of one program, and a run is
summed in a fixed order (the stable sort keeps the occurrences in batch order),
so the result is deterministic and race-free without atomics. Rows not in the
batch are not read or written (lazy, as the ps). :func:`apply_rows_` is the same
update kernel over gradients already coalesced per distinct row (data parallel).

Narrow rows (an fp16 or bf16 ``weight`` with its ``rounding`` keys,
:class:`ps.kernels.narrow_rows.RoundingKeys`): a row is widened as it is loaded, the
update runs in float32 as for a float32 row, and the result is stored stochastically
rounded with the bits of :func:`ps.rounding.round_to` (the same hash on ``tl.uint64``,
one per group of four columns, keyed by the row's table seed, its id in the table and
its clock after the update), so these rows equal the float32 kernel's result passed
through ``round_to``. Clocks are required then (they key the rounding).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from embedding.kernels._checks import block_d, cdiv, check_lookup_args, check_mode
from ps.kernels.narrow_rows import RoundingKeys
from ps.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad

# Optimizer switch (the OPT constexpr). Hyperparameters arrive as one float64 tensor
# (``hyper``, cached per optimizer config and device) so that Adam's bias correction can
# be computed in float64 like the ps, which Triton's float32 scalar arguments cannot carry.
OPT_SGD: tl.constexpr = tl.constexpr(0)  # hyper: lr
OPT_MOMENTUM: tl.constexpr = tl.constexpr(1)  # hyper: lr, momentum
OPT_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(2)  # hyper: lr, eps
OPT_ADAGRAD: tl.constexpr = tl.constexpr(3)  # hyper: lr, eps
OPT_ADAM: tl.constexpr = tl.constexpr(4)  # hyper: lr, eps, b1, 1-b1, b2, 1-b2, wd, log b1, log b2
OPT_FTRL: tl.constexpr = tl.constexpr(5)  # hyper: alpha, beta, l1, l2

#: The largest finite float32: ``|x| <= FLT_MAX`` is False exactly for +-Inf and NaN.
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)

# Row types of the weight (the ROUND constexpr): float32, or narrow rows stored rounded.
ROUND_NONE: tl.constexpr = tl.constexpr(0)
ROUND_FP16: tl.constexpr = tl.constexpr(1)
ROUND_BF16: tl.constexpr = tl.constexpr(2)
_ROUND_CODES = {torch.float16: 1, torch.bfloat16: 2}

#: Widest column block; a wider row is handled in several blocks by the same program
#: (256 would need up to 254 registers per thread for FTRL).
MAX_BLOCK_D = 128


def optimizer_code(opt: Optimizer) -> int:
    """The ``OPT`` constexpr of a ps optimizer; TypeError for an optimizer without a kernel."""
    if isinstance(opt, SGD):
        return int(OPT_MOMENTUM if opt.momentum > 0 else OPT_SGD)
    if isinstance(opt, RowWiseAdagrad):
        return int(OPT_ROWWISE_ADAGRAD)
    if isinstance(opt, Adagrad):
        return int(OPT_ADAGRAD)
    if isinstance(opt, Adam):
        return int(OPT_ADAM)
    if isinstance(opt, FTRL):
        return int(OPT_FTRL)
    raise TypeError(f"no Triton update for optimizer {type(opt).__name__} ({opt!r})")


def _hyper_values(opt: Optimizer) -> list[float]:
    if isinstance(opt, SGD):
        return [opt.lr, opt.momentum]
    if isinstance(opt, RowWiseAdagrad | Adagrad):
        return [opt.lr, opt.eps]
    if isinstance(opt, Adam):
        b1, b2 = float(opt.betas[0]), float(opt.betas[1])
        # b ** t = exp(t * log b); b == 0 (allowed) makes every power 0, as exp(-inf) does.
        log_b1 = math.log(b1) if b1 > 0 else -math.inf
        log_b2 = math.log(b2) if b2 > 0 else -math.inf
        return [opt.lr, opt.eps, b1, 1.0 - b1, b2, 1.0 - b2, opt.weight_decay, log_b1, log_b2]
    if isinstance(opt, FTRL):
        return [opt.alpha, opt.beta, opt.l1, opt.l2]
    raise TypeError(f"no Triton update for optimizer {type(opt).__name__} ({opt!r})")


@functools.cache
def hyper_tensor(opt: Optimizer, device: torch.device) -> torch.Tensor:
    """The optimizer's hyperparameters as a float64 tensor on ``device`` (one copy per config).

    Float32 terms are rounded from these float64 values inside the kernel, exactly as
    torch rounds a Python float scalar against a float32 tensor.
    """
    return torch.tensor(_hyper_values(opt), dtype=torch.float64, device=device)


@triton.jit(do_not_specialize=["num_bags"])  # a new value every batch: one compile for all
def _occurrence_kernel(
    offsets_ptr,
    psw_ptr,
    bag_ptr,
    scale_ptr,
    num_bags,
    HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For BAGS bags: bag[i] = b and (weights or mean) scale[i] = psw_i / len(b)^[mean]."""
    bags = tl.program_id(0) * BAGS + tl.arange(0, BAGS)  # [BAGS]
    bag_mask = bags < num_bags
    start = tl.load(offsets_ptr + bags, mask=bag_mask, other=0)
    end = tl.load(offsets_ptr + bags + 1, mask=bag_mask, other=0)
    length = end - start
    lenf = tl.maximum(length, 1).to(tl.float32)
    for j in range(0, tl.max(length, axis=0), BLOCK_N):
        idx = start[:, None] + j + tl.arange(0, BLOCK_N)[None, :]  # [BAGS, BLOCK_N]
        m = bag_mask[:, None] & (idx < end[:, None])
        tl.store(bag_ptr + idx, (bags[:, None] + tl.zeros_like(idx)).to(tl.int32), mask=m)
        if HAS_WEIGHTS or MEAN:
            if HAS_WEIGHTS:
                s = tl.load(psw_ptr + idx, mask=m, other=0.0).to(tl.float32)
            else:
                s = tl.zeros_like(idx).to(tl.float32) + 1.0
            if MEAN:
                s = tl.div_rn(s, lenf[:, None] + tl.zeros_like(s))
            tl.store(scale_ptr + idx, s, mask=m)


@triton.jit
def _add_nonfinite(
    g, grad_ptr, stride_g, order_ptr, bag_ptr, scale_ptr, c, hi, pos, end, cols, col_mask,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``g`` plus the +-Inf and NaN values of the occurrences at sorted positions
    ``[c, c + BLOCK_N)``, each added to the lane that owns it only.

    The one-hot product took these values as zeros (``0 x Inf`` would be NaN in every
    lane), so here they are re-read one occurrence at a time and added where they
    belong: a lane owning +Inf becomes +Inf, +Inf and -Inf (or a NaN) NaN, as its plain
    sum would; a lane that owns none keeps its finite sum bit for bit. Only a step that
    saw a non-finite value comes here, so its cost does not matter.
    """
    for k in range(BLOCK_N):
        q = c + k
        m = q < hi
        src = tl.load(order_ptr + q, mask=m, other=0)
        bag = tl.load(bag_ptr + src, mask=m, other=0).to(tl.int64)
        row = tl.load(grad_ptr + bag * stride_g + cols, mask=m & col_mask, other=0.0)
        row = row.to(tl.float32)  # [BLOCK_D]
        if HAS_SCALE:
            row = row * tl.load(scale_ptr + src, mask=m, other=0.0)
        bad = (tl.abs(row) > FLT_MAX) | (row != row)  # +-Inf or NaN
        mine = (q >= pos) & (q < end)  # [ROWS]: the lane that owns q, if any
        g = tl.where(mine[:, None] & bad[None, :], g + row[None, :], g)
    return g


@triton.jit
def _grad_block(
    grad_ptr,
    stride_g,
    order_ptr,
    bag_ptr,
    scale_ptr,
    pos,
    end,
    lead,
    cols,
    col_mask,
    FROM_RUNS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Columns ``cols`` of the gradient of each lead lane's row: ``[ROWS, BLOCK_D]`` float32.

    FROM_RUNS: lane r owns the occurrences at sorted positions [pos[r], end[r]) (its
    run; empty unless lead[r]). The runs of a program's leads are contiguous in sorted
    order, so the program walks [first lead, last end) densely, BLOCK_N occurrences per
    step whatever the run lengths: a ``[BLOCK_N, BLOCK_D]`` gather of ``grad_output``
    rows (times their scale), summed into each owning lane by a one-hot
    ``[ROWS, BLOCK_N]`` product (``tl.dot`` in IEEE float32: exact products by 1 and 0,
    a fixed summation order). The product takes +-Inf and NaN as zeros, since
    ``0 x Inf = NaN`` would reach every lane of the program; a step that holds one adds
    them to their owners afterwards (:func:`_add_nonfinite`), so a non-finite gradient
    stays in its row as in the plain sum. Otherwise the gradients are already
    coalesced: row pos[r] of ``grad_ptr``.
    """
    if FROM_RUNS:
        g = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        lo = tl.min(tl.where(lead, pos, tl.max(end, axis=0)), axis=0)
        hi = tl.max(end, axis=0)
        for c in range(lo, hi, BLOCK_N):
            q = c + tl.arange(0, BLOCK_N)  # [BLOCK_N] sorted positions
            m = q < hi
            src = tl.load(order_ptr + q, mask=m, other=0)  # position in the batch
            # int64: a bag index times the row stride passes 2**31 on large batches
            # (26 tables x 655 k bags x 128 columns).
            bag = tl.load(bag_ptr + src, mask=m, other=0).to(tl.int64)
            tile = tl.load(
                grad_ptr + bag[:, None] * stride_g + cols[None, :],
                mask=m[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            if HAS_SCALE:
                tile = tile * tl.load(scale_ptr + src, mask=m, other=0.0)[:, None]
            own = (q[None, :] >= pos[:, None]) & (q[None, :] < end[:, None])  # [ROWS, BLOCK_N]
            finite = tl.abs(tile) <= FLT_MAX  # [BLOCK_N, BLOCK_D]; False for +-Inf and NaN
            g += tl.dot(own.to(tl.float32), tl.where(finite, tile, 0.0), input_precision="ieee")
            if tl.sum(tl.where(finite, 0, 1), axis=None) > 0:
                g = _add_nonfinite(
                    g, grad_ptr, stride_g, order_ptr, bag_ptr, scale_ptr, c, hi, pos, end,
                    cols, col_mask, HAS_SCALE, BLOCK_N,
                )  # fmt: skip
    else:
        g = tl.load(
            grad_ptr + pos[:, None] * stride_g + cols[None, :],
            mask=lead[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
    return g


@triton.jit
def _splitmix64(z):
    """SplitMix64's output on ``tl.uint64`` (wrapping): :func:`ps.routing.splitmix64`."""
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _row_keys(keys_ptr, row_ids_ptr, row, version, lead, HAS_ROW_IDS: tl.constexpr):
    """The rounding key ``[ROWS]`` uint64 of each lead lane's flat ``row`` at ``version``
    (:func:`ps.rounding.rounding_bits`' per-row key). ``keys_ptr``: int64 ``[T, starts
    [T + 1], seeds [T]]``; a row's table is the last one starting at or before it."""
    num_tables = tl.load(keys_ptr)
    table = tl.zeros_like(row)
    for t in range(1, num_tables):
        table += (row >= tl.load(keys_ptr + 1 + t)).to(tl.int64)
    seed = tl.load(keys_ptr + 2 + num_tables + table, mask=lead, other=0)
    if HAS_ROW_IDS:
        ids = tl.load(row_ids_ptr + row, mask=lead, other=0)
    else:
        ids = row - tl.load(keys_ptr + 1 + table, mask=lead, other=0)
    seed_key = _splitmix64(seed.to(tl.uint64, bitcast=True) & 0x7FFFFFFFFFFFFFFF)
    key = _splitmix64(ids.to(tl.uint64, bitcast=True) ^ seed_key)
    return _splitmix64(key + version.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)


@triton.jit
def _fmix64(h):
    """murmur3's 64-bit finaliser on ``tl.uint64`` (wrapping)."""
    h = (h ^ (h >> 33)) * 0xFF51AFD7ED558CCD
    h = (h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53
    return h ^ (h >> 33)


@triton.jit
def _draws(key, blk, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The 16-bit random draws ``[ROWS, BLOCK_D]`` uint32 of columns ``blk * BLOCK_D +
    lane`` of each row's ``key`` ``[ROWS]`` (:func:`ps.rounding.rounding_bits`): one hash
    per group of four columns ``[ROWS, BLOCK_D // 4]``, column ``4g + l`` its lane ``l``."""
    groups = blk * (BLOCK_D // 4) + tl.arange(0, BLOCK_D // 4)  # [G]
    h = _fmix64(key[:, None] + (groups[None, :] + 1).to(tl.uint64) * 0xD1B54A32D192ED03)
    shifts = (tl.arange(0, 4) * 16).to(tl.uint64)  # [4]
    lanes = (h[:, :, None] >> shifts[None, None, :]) & 0xFFFF  # [ROWS, G, 4]
    return tl.reshape(lanes, (ROWS, BLOCK_D)).to(tl.uint32)  # row-major: column 4g + l


@triton.jit
def _rounded_bits(w, r, ROUND: tl.constexpr):
    """float32 ``w`` ``[ROWS, BLOCK_D]`` stochastically rounded to fp16 or bf16, as uint16
    bits: the steps of ``ps/kernels/narrow_rows.c`` (``nr_round_f16``/``nr_round_bf16``)
    with the 16-bit random draws ``r`` ``[ROWS, BLOCK_D]`` (:func:`_draws`)."""
    u = w.to(tl.uint32, bitcast=True)
    finite = (u & 0x7F800000) != 0x7F800000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if ROUND == ROUND_BF16:
        out = tl.where(finite, (u + (r & 0xFFFF)) >> 16, tl.where(nan, 0x7FC0, u >> 16))
    else:
        mag = tl.abs(w)
        small = mag < 6.103515625e-05  # 2**-14, fp16's smallest normal
        shifted = tl.where(small, mag + 6.103515625e-05, mag)
        up = (shifted.to(tl.uint32, bitcast=True) + (r & 0x1FFF)) & 0xFFFFE000
        half = (up >> 13) - (112 << 10)
        half = tl.where(small, half - 0x400, half)
        half = tl.where(up > 0x477FE000, 0x7BFF, half)  # past 65504: 65504
        half = tl.where(finite, half, tl.where(nan, 0x7E00, 0x7C00))
        out = ((u >> 16) & 0x8000) | half
    return out.to(tl.uint16)


@triton.jit(do_not_specialize=["n"])  # ids per batch vary: one compile for every count
def _update_kernel(
    weight_ptr,
    stride_w,
    state_ptr,
    stride_s,
    clocks_ptr,
    hyper_ptr,
    sorted_ptr,
    run_end_ptr,
    order_ptr,
    bag_ptr,
    scale_ptr,
    grad_ptr,
    stride_g,
    n,
    D,
    keys_ptr,  # narrow rows: the rounding keys (see _row_keys)
    row_ids_ptr,
    OPT: tl.constexpr,
    FROM_RUNS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_CLOCKS: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_ROW_IDS: tl.constexpr,
):
    """One program: ROWS sorted positions; each lead lane updates its row in place."""
    pos = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    in_range = pos < n
    row = tl.load(sorted_ptr + pos, mask=in_range, other=0).to(tl.int64)
    if FROM_RUNS:
        prev = tl.load(sorted_ptr + pos - 1, mask=in_range & (pos > 0), other=-1).to(tl.int64)
        lead = in_range & (row != prev)
        # Where each lead's run ends; 0 for the others, which own nothing.
        end = tl.load(run_end_ptr + pos, mask=lead, other=0).to(tl.int64)
    else:
        lead = in_range
        end = pos
    lane = tl.arange(0, BLOCK_D)
    srow = state_ptr + row * stride_s  # [ROWS] start of each row's state
    lr = tl.load(hyper_ptr).to(tl.float32)

    # Per-row terms that need the whole row (row-wise Adagrad) or come once per row (Adam).
    denom = tl.zeros([ROWS], dtype=tl.float32)
    size = tl.zeros([ROWS], dtype=tl.float32)
    g_whole = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)  # the row's gradient, one block
    if OPT == OPT_ROWWISE_ADAGRAD:
        if NUM_D_BLOCKS == 1:  # sum the occurrences once, keep g for the update
            g_whole = _grad_block(
                grad_ptr, stride_g, order_ptr, bag_ptr, scale_ptr, pos, end, lead,
                lane, lane < D, FROM_RUNS, HAS_SCALE, ROWS, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            sq = tl.sum(g_whole * g_whole, axis=1)
        else:  # wide rows: a first pass for sum(g^2); the update pass recomputes g
            sq = tl.zeros([ROWS], dtype=tl.float32)
            for blk in range(NUM_D_BLOCKS):
                cols = blk * BLOCK_D + lane
                g = _grad_block(
                    grad_ptr, stride_g, order_ptr, bag_ptr, scale_ptr, pos, end, lead,
                    cols, cols < D, FROM_RUNS, HAS_SCALE, ROWS, BLOCK_N, BLOCK_D,
                )  # fmt: skip
                sq += tl.sum(g * g, axis=1)
        acc = tl.load(srow, mask=lead, other=0.0) + tl.div_rn(sq, tl.zeros_like(sq) + D)
        tl.store(srow, acc, mask=lead)
        denom = tl.sqrt_rn(acc) + tl.load(hyper_ptr + 1).to(tl.float32)
    if OPT == OPT_ADAM:
        t = tl.load(srow + 2 * D, mask=lead, other=0.0) + 1.0  # this row's step count
        t64 = t.to(tl.float64)
        bias2 = 1.0 - tl.exp(t64 * tl.load(hyper_ptr + 8))  # 1 - b2 ** t
        bias1 = 1.0 - tl.exp(t64 * tl.load(hyper_ptr + 7))  # 1 - b1 ** t
        size = (tl.load(hyper_ptr) * tl.sqrt(bias2) / bias1).to(tl.float32)  # [ROWS]
    key = tl.zeros([ROWS], dtype=tl.uint64)
    if ROUND != ROUND_NONE:  # each row's clock after this update keys its rounding
        version = tl.load(clocks_ptr + row, mask=lead, other=0) + 1
        key = _row_keys(keys_ptr, row_ids_ptr, row, version, lead, HAS_ROW_IDS)

    for blk in range(NUM_D_BLOCKS):
        cols = blk * BLOCK_D + lane
        col_mask = cols < D
        if OPT == OPT_ROWWISE_ADAGRAD and NUM_D_BLOCKS == 1:
            g = g_whole
        else:
            g = _grad_block(
                grad_ptr, stride_g, order_ptr, bag_ptr, scale_ptr, pos, end, lead,
                cols, col_mask, FROM_RUNS, HAS_SCALE, ROWS, BLOCK_N, BLOCK_D,
            )  # fmt: skip
        m2 = lead[:, None] & col_mask[None, :]
        w_ptrs = weight_ptr + row[:, None] * stride_w + cols[None, :]
        s_ptrs = srow[:, None] + cols[None, :]  # the first D state columns of each row
        w = tl.load(w_ptrs, mask=m2, other=0.0).to(tl.float32)
        if OPT == OPT_SGD:
            w = w - lr * g
        elif OPT == OPT_MOMENTUM:
            buf = tl.load(s_ptrs, mask=m2, other=0.0) * tl.load(hyper_ptr + 1).to(tl.float32) + g
            tl.store(s_ptrs, buf, mask=m2)
            w = w - lr * buf
        elif OPT == OPT_ROWWISE_ADAGRAD:
            w = w - lr * tl.div_rn(g, tl.zeros_like(g) + denom[:, None])
        elif OPT == OPT_ADAGRAD:
            eps = tl.load(hyper_ptr + 1).to(tl.float32)
            acc2 = tl.load(s_ptrs, mask=m2, other=0.0) + g * g
            tl.store(s_ptrs, acc2, mask=m2)
            w = w - lr * tl.div_rn(g, tl.sqrt_rn(acc2) + eps)
        elif OPT == OPT_ADAM:
            eps = tl.load(hyper_ptr + 1).to(tl.float32)
            wd = tl.load(hyper_ptr + 6).to(tl.float32)
            if wd > 0:
                g = g + wd * w  # L2 on touched rows, as the ps
            mom = tl.load(s_ptrs, mask=m2, other=0.0) * tl.load(hyper_ptr + 2).to(tl.float32)
            mom = mom + tl.load(hyper_ptr + 3).to(tl.float32) * g
            var = tl.load(s_ptrs + D, mask=m2, other=0.0) * tl.load(hyper_ptr + 4).to(tl.float32)
            var = var + tl.load(hyper_ptr + 5).to(tl.float32) * g * g
            tl.store(s_ptrs, mom, mask=m2)
            tl.store(s_ptrs + D, var, mask=m2)
            w = w - tl.div_rn(mom, tl.sqrt_rn(var) + eps) * size[:, None]
        else:  # OPT_FTRL
            alpha = lr
            beta = tl.load(hyper_ptr + 1).to(tl.float32)
            l1 = tl.load(hyper_ptr + 2).to(tl.float32)
            l2 = tl.load(hyper_ptr + 3).to(tl.float32)
            z = tl.load(s_ptrs, mask=m2, other=0.0)
            nsum = tl.load(s_ptrs + D, mask=m2, other=0.0)
            n_new = nsum + g * g
            sigma = tl.div_rn(tl.sqrt_rn(n_new) - tl.sqrt_rn(nsum), tl.zeros_like(g) + alpha)
            z = z + (g - sigma * w)
            tl.store(s_ptrs, z, mask=m2)
            tl.store(s_ptrs + D, n_new, mask=m2)
            den = tl.div_rn(beta + tl.sqrt_rn(n_new), tl.zeros_like(g) + alpha) + l2
            sign = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
            w = tl.where(tl.abs(z) <= l1, 0.0, -tl.div_rn(z - sign * l1, den))
        if ROUND == ROUND_NONE:
            tl.store(w_ptrs, w.to(weight_ptr.dtype.element_ty), mask=m2)
        else:
            bits = _rounded_bits(w, _draws(key, blk, ROWS, BLOCK_D), ROUND)
            tl.store(w_ptrs, bits.to(weight_ptr.dtype.element_ty, bitcast=True), mask=m2)

    if OPT == OPT_ADAM:
        tl.store(srow + 2 * D, t, mask=lead)
    if HAS_CLOCKS:
        c_ptrs = clocks_ptr + row
        tl.store(c_ptrs, tl.load(c_ptrs, mask=lead, other=0) + 1, mask=lead)


def update_config(dim: int, *, from_runs: bool) -> dict[str, int]:
    """Tile shape and warps of :func:`_update_kernel` for rows of ``dim`` columns.

    A fixed heuristic, not autotuned: the kernel updates weights in place, so an
    autotuner's repeated trial runs would have to copy the whole table first.
    ``ROWS = 16`` sorted positions per program (``tl.dot`` needs 16); a step gathers
    ``BLOCK_N`` = 32 occurrences at ``BLOCK_D <= 64``, 16 at 128 (a gather tile of
    2048 elements); ``BLOCK_D`` is at least 16 (``tl.dot`` again; masks cover the
    rest) and at most :data:`MAX_BLOCK_D`. With 8 warps ptxas (sm_90) reports 80-144
    registers per thread for every optimizer at D = 64 and 128 (the check for
    non-finite gradients in each step costs up to 30 of them), so one to three
    programs share an SM.
    """
    bd = max(16, block_d(dim, MAX_BLOCK_D))
    return {
        "ROWS": 16,
        "BLOCK_N": (32 if bd <= 64 else 16) if from_runs else 1,
        "BLOCK_D": bd,
        "NUM_D_BLOCKS": cdiv(dim, bd),
        "num_warps": 8 if from_runs or bd > 64 else 4,
    }


def _check_update_args(
    fn: str,
    weight: torch.Tensor,
    state: torch.Tensor,
    optimizer: Optimizer,
    clocks: torch.Tensor | None,
    rounding: RoundingKeys | None = None,
) -> int:
    """Shapes, dtypes and devices of the in-place targets; returns the state's row stride."""
    _check_rounding(fn, weight, clocks, rounding)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{fn}: optimizer must be a ps Optimizer, got {type(optimizer).__name__}")
    optimizer_code(optimizer)  # TypeError for an optimizer without a kernel
    rows, dim = weight.shape
    s = optimizer.state_dim(dim)
    if (
        state.dtype != torch.float32
        or not state.is_contiguous()
        or state.numel() != rows * s
        or (state.dim() == 2 and state.shape[0] != rows)
        or state.dim() not in (1, 2)
    ):
        raise ValueError(
            f"{fn}: state must be a contiguous float32 tensor [{rows}, {s}] "
            f"({optimizer.name}: {s} columns per row of {dim}), "
            f"got {state.dtype} shape {tuple(state.shape)}"
        )
    if state.device != weight.device:
        raise ValueError(f"{fn}: state is on {state.device} but weight is on {weight.device}")
    if clocks is not None and (
        clocks.dtype != torch.int64
        or clocks.numel() != rows
        or not clocks.is_contiguous()
        or clocks.device != weight.device
    ):
        raise ValueError(
            f"{fn}: clocks must be a contiguous int64 tensor with {rows} entries on "
            f"{weight.device}, got {clocks.dtype} shape {tuple(clocks.shape)} on {clocks.device}"
        )
    return s


def _check_rounding(
    fn: str, weight: torch.Tensor, clocks: torch.Tensor | None, rounding: RoundingKeys | None
) -> None:
    """A float32 ``weight`` takes no rounding keys; an fp16/bf16 one needs keys of its type
    on its device, and clocks (they key the rounding)."""
    narrow = weight.dtype in _ROUND_CODES
    if not narrow:
        if rounding is not None:
            raise ValueError(
                f"{fn}: rounding keys are for fp16/bf16 rows, got a {weight.dtype} weight"
            )
        return
    if rounding is None or clocks is None:
        raise ValueError(
            f"{fn}: a {weight.dtype} weight is updated with stochastic rounding: pass its "
            "rounding keys and its clocks"
        )
    if rounding.dtype != weight.dtype or rounding.starts.device != weight.device:
        raise ValueError(
            f"{fn}: rounding keys of {rounding.dtype} on {rounding.starts.device} for a "
            f"{weight.dtype} weight on {weight.device}"
        )


def _rounding_args(weight: torch.Tensor, rounding: RoundingKeys | None) -> dict[str, object]:
    """The kernel's rounding arguments: packed keys ``[T, starts, seeds]``, row ids, flags."""
    if rounding is None:
        return {"keys_ptr": weight, "row_ids_ptr": weight, "ROUND": 0, "HAS_ROW_IDS": False}
    t = torch.tensor([rounding.seeds.numel()], dtype=torch.int64, device=weight.device)
    packed = torch.cat([t, rounding.starts, rounding.seeds])  # [2T + 2]
    ids = rounding.row_ids
    return {
        "keys_ptr": packed,
        "row_ids_ptr": ids if ids is not None else packed,
        "ROUND": _ROUND_CODES[weight.dtype],
        "HAS_ROW_IDS": ids is not None,
    }


def fused_backward_(
    weight: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    grad_output: torch.Tensor,
    optimizer: Optimizer,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    clocks: torch.Tensor | None = None,
    validate: bool = True,
    rounding: RoundingKeys | None = None,
) -> None:
    """Backward of :func:`~embedding.kernels.triton_pool.pooled_lookup` + ``optimizer``, in place.

    Updates ``weight`` ``[R, D]`` and ``state`` (float32, contiguous, ``[R, S]`` with
    ``S = optimizer.state_dim(D)``; ``[R]`` also for row-wise Adagrad) for the rows in
    ``ids`` exactly as ``optimizer.apply`` does on the coalesced row gradients;
    ``grad_output`` is ``[B, D]`` with ``B = len(offsets) - 1``. ``clocks`` (int64
    ``[R]``, optional) gets +1 per touched row, as a ps store counts updates.
    ``validate=False`` skips the checks that read tensor values (a CUDA sync); the
    launch itself never synchronises. An fp16/bf16 ``weight`` needs its ``rounding``
    keys and ``clocks`` (see the module docstring).
    """
    fn = "fused_backward_"
    mean = check_mode(fn, mode)
    check_lookup_args(fn, weight, ids, offsets, per_sample_weights, validate=validate)
    stride_s = _check_update_args(fn, weight, state, optimizer, clocks, rounding)
    rows, dim = weight.shape
    num_bags = offsets.numel() - 1
    if tuple(grad_output.shape) != (num_bags, dim) or grad_output.stride(-1) != 1:
        raise ValueError(
            f"{fn}: grad_output must be [num_bags, dim] = [{num_bags}, {dim}] with contiguous "
            f"rows, got shape {tuple(grad_output.shape)} strides {grad_output.stride()}"
        )
    if grad_output.device != weight.device:
        raise ValueError(
            f"{fn}: grad_output is on {grad_output.device} but weight is on {weight.device}"
        )
    n = ids.numel()
    if n == 0 or dim == 0:
        return
    if num_bags >= 2**31 or n >= 2**31:
        raise ValueError(f"{fn}: at most 2**31 - 1 bags and ids, got {num_bags} and {n}")
    device = weight.device

    # 1. The bag (and factor) of every occurrence, in batch order.
    has_scale = per_sample_weights is not None or mean
    bag = torch.empty(n, dtype=torch.int32, device=device)  # [N]
    scale = torch.empty(n, dtype=torch.float32, device=device) if has_scale else bag  # [N]
    offs = offsets.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else offs
    _occurrence_kernel[(cdiv(num_bags, 64),)](
        offs, psw, bag, scale, num_bags,
        HAS_WEIGHTS=per_sample_weights is not None, MEAN=mean, BAGS=64, BLOCK_N=8,
    )  # fmt: skip

    # 2. Occurrences grouped by row, in batch order within a row (stable). Sorting 32-bit
    # keys takes half the radix passes of 64-bit ones.
    keys = ids.to(torch.int32) if rows < 2**31 else ids
    sorted_ids, order = torch.sort(keys, stable=True)  # [N], [N]
    # End of each position's run (used at run starts): a binary search, no unique (a sync).
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True, out_int32=n < 2**31)  # [N]

    # 3. One lane per run of equal ids: sum, update, clock.
    cfg = update_config(dim, from_runs=True)
    _update_kernel[(cdiv(n, cfg["ROWS"]),)](
        weight, weight.stride(0), state if stride_s else weight, stride_s,
        clocks if clocks is not None else weight, hyper_tensor(optimizer, device),
        sorted_ids, run_end, order, bag, scale, grad_output, grad_output.stride(0), n, dim,
        OPT=optimizer_code(optimizer), FROM_RUNS=True, HAS_SCALE=has_scale,
        HAS_CLOCKS=clocks is not None, **_rounding_args(weight, rounding), **cfg,
    )  # fmt: skip


def apply_rows_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    optimizer: Optimizer,
    *,
    clocks: torch.Tensor | None = None,
    rounding: RoundingKeys | None = None,
) -> None:
    """``optimizer`` on already coalesced gradients, in place: ``grads[u]`` for row ``rows[u]``.

    For callers that combine row gradients themselves first (data parallel:
    allgatherv of every rank's ``(rows, grads)``, then coalesce). ``rows`` int64 or
    int32 ``[U]`` must be distinct (not checked: duplicates would race), ``grads``
    ``[U, D]`` with contiguous rows; ``weight``/``state``/``clocks`` as in
    :func:`fused_backward_` (``rounding`` too). The same update kernel, one lane per row.
    """
    fn = "apply_rows_"
    stride_s = _check_update_args(fn, weight, state, optimizer, clocks, rounding)
    dim = weight.shape[1]
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: rows must be a 1-D int32/int64 tensor, "
                        f"got {rows.dtype} shape {tuple(rows.shape)}")  # fmt: skip
    u = rows.numel()
    if tuple(grads.shape) != (u, dim) or (u and grads.stride(-1) != 1):
        raise ValueError(
            f"{fn}: grads must be [len(rows), dim] = [{u}, {dim}] with contiguous rows, "
            f"got shape {tuple(grads.shape)} strides {grads.stride()}"
        )
    for name, t in (("rows", rows), ("grads", grads)):
        if t.device != weight.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but weight is on {weight.device}")
    if u == 0 or dim == 0:
        return
    rows_c = rows.contiguous()
    cfg = update_config(dim, from_runs=False)
    _update_kernel[(cdiv(u, cfg["ROWS"]),)](
        weight, weight.stride(0), state if stride_s else weight, stride_s,
        clocks if clocks is not None else weight, hyper_tensor(optimizer, weight.device),
        rows_c, rows_c, rows_c, rows_c, grads, grads, grads.stride(0), u, dim,
        OPT=optimizer_code(optimizer), FROM_RUNS=False, HAS_SCALE=False,
        HAS_CLOCKS=clocks is not None, **_rounding_args(weight, rounding), **cfg,
    )  # fmt: skip
