"""Triton gather + pool over one flat table-batched weight (FBGEMM TBE-like).

::

    weight  [R, D]       every table of the group; ids already offset by table base
    ids     [N]          int32/int64 row of each occurrence
    offsets [B + 1]      bag b is ids[offsets[b]:offsets[b + 1]] (B = tables x batch)
    psw     [N] or None  per-id weight
    out     [B, D]       sum_i psw_i * weight[ids_i]   (mean: / len(bag); empty bag: 0)

fp16 and bf16 weights are widened as they are loaded and pooled in float32 (the output
is float32 then).

One program per (tile of BAGS bags, column tile of BLOCK_D). It walks its bags
together, BLOCK_N ids of each bag per step: a ``[BAGS, BLOCK_N, BLOCK_D]`` gather
of rows summed over the ids into a float32 ``[BAGS, BLOCK_D]`` accumulator, for as
many steps as the longest bag of the tile needs. Several bags per program keep a
pooling-1 launch (one row per bag) from being all per-program overhead; several
ids per bag give long bags many loads in flight. Columns past ``D`` are masked,
so ``D`` need not be a power of two. Each output element is written by one
program: no atomics, deterministic for a given config.

On a GPU the tile shape and warps are autotuned per (D, average-pooling bucket,
weights or not, dtypes) over :data:`FWD_CONFIGS` (the forward only writes its
output, so trial runs are harmless). In Triton's interpreter, or with
``HYBRIDREC_TRITON_AUTOTUNE=0``, the launcher uses :func:`default_config` instead.

``triton`` must be importable; ``TRITON_INTERPRET=1`` must be set before this
module is imported to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embedding.kernels import autotune_enabled
from embedding.kernels._checks import block_d, cdiv, check_lookup_args, check_mode, pool_bucket

#: Widest column tile; wider rows take several programs along the grid's 2nd axis.
MAX_BLOCK_D = 256
#: Most elements of one [BAGS, BLOCK_N, BLOCK_D] gather tile a config may ask for.
MAX_TILE = 8192


def _config(bags: int, block_n: int, warps: int, stages: int = 2) -> triton.Config:
    return triton.Config({"BAGS": bags, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


#: The autotuner's candidates: many bags of one id (pooling ~1) to few bags of many ids
#: (long bags); BLOCK_D comes from D (see :func:`pooled_lookup`), not from the config.
#: Eight, because each is compiled (about a second) on the first call per key.
FWD_CONFIGS = [
    _config(64, 1, 4),
    _config(32, 1, 4),
    _config(16, 2, 4),
    _config(8, 4, 4),
    _config(4, 8, 4),
    _config(2, 16, 4),
    _config(1, 32, 4),
    _config(4, 8, 8, 3),
]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Drop configs whose gather tile would not fit the registers at this BLOCK_D."""
    bd = int(kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 1)))  # type: ignore[call-overload]
    keep = [c for c in configs if c.kwargs["BAGS"] * c.kwargs["BLOCK_N"] * bd <= MAX_TILE]
    return keep or configs[-1:]


def default_config(dim: int, pooling: int) -> dict[str, int]:
    """The config used without autotuning: many bags per program at pooling <= 2,
    else a few bags of 8 ids each; ``num_warps`` 4."""
    bags, block_n = (32, 1) if pooling <= 2 else (4, 8)
    bd = block_d(dim, MAX_BLOCK_D)
    while bags > 1 and bags * block_n * bd > MAX_TILE:
        bags //= 2
    return {"BAGS": bags, "BLOCK_N": block_n, "num_warps": 4}


# num_bags changes with every batch and pooling is only an autotune key: specialising on
# them (Triton compiles a variant for a value of 1 and for multiples of 16) would compile
# the same code again per batch size and per pooling bucket.
@triton.jit(do_not_specialize=["num_bags", "pooling"])
def _pool_kernel(
    weight_ptr,
    stride_w,
    ids_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    num_bags,
    D,
    pooling,  # average ids per bag, power-of-two bucket: an autotune key only
    HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bags = tl.program_id(0) * BAGS + tl.arange(0, BAGS)  # [BAGS]
    bag_mask = bags < num_bags
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_mask = cols < D
    start = tl.load(offsets_ptr + bags, mask=bag_mask, other=0)
    end = tl.load(offsets_ptr + bags + 1, mask=bag_mask, other=0)
    if WIDE_INDEX:
        start = start.to(tl.int64)
        end = end.to(tl.int64)
    else:  # 32-bit index math: fewer registers and instructions per address
        start = start.to(tl.int32)
        end = end.to(tl.int32)
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(end - start, axis=0), BLOCK_N):
        idx = start[:, None] + j + tl.arange(0, BLOCK_N)[None, :]  # [BAGS, BLOCK_N]
        id_mask = idx < end[:, None]
        rows = tl.load(ids_ptr + idx, mask=id_mask, other=0)
        rows = rows.to(tl.int64) if WIDE_INDEX else rows.to(tl.int32)
        tile = tl.load(
            weight_ptr + rows[:, :, None] * stride_w + cols[None, None, :],
            mask=id_mask[:, :, None] & col_mask[None, None, :],
            other=0.0,
        ).to(tl.float32)  # [BAGS, BLOCK_N, BLOCK_D]
        if HAS_WEIGHTS:
            w = tl.load(psw_ptr + idx, mask=id_mask, other=0.0).to(tl.float32)
            tile = tile * w[:, :, None]
        acc += tl.sum(tile, axis=1)
    if MEAN:
        length = tl.maximum(end - start, 1).to(tl.float32)  # [BAGS]
        acc = tl.div_rn(acc, tl.zeros_like(acc) + length[:, None])  # div_rn does not broadcast
    out_rows = bags.to(tl.int64) if WIDE_INDEX else bags
    tl.store(
        out_ptr + out_rows[:, None] * D + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=bag_mask[:, None] & col_mask[None, :],
    )


_pool_kernel_tuned = triton.autotune(
    configs=FWD_CONFIGS,
    key=["D", "pooling", "HAS_WEIGHTS", "MEAN", "BLOCK_D"],
    prune_configs_by={"early_config_prune": _prune},
    warmup=5,
    rep=20,
)(_pool_kernel)


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Pooled rows ``[B, D]`` of the bags ``offsets`` cuts ``ids`` into: float32 for an fp16
    or bf16 ``weight`` (rows widened, pooled in float32), else the dtype of ``weight``.

    ``mode`` is ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag
    length, as FBGEMM's TBE does; ``F.embedding_bag`` refuses weights with mean).
    Equal to ``F.embedding_bag(ids, weight, offsets, mode=mode,
    per_sample_weights=psw, include_last_offset=True)`` up to float32 rounding.
    The result carries no autograd graph: the caller's ``autograd.Function`` routes
    the gradient to :func:`embedding.kernels.triton_optimizers.fused_backward_`.
    ``validate=False`` skips the checks that read tensor values (a CUDA sync); the
    launch itself never synchronises (sizes come from tensor shapes).
    """
    mean = check_mode("pooled_lookup", mode)
    check_lookup_args("pooled_lookup", weight, ids, offsets, per_sample_weights, validate=validate)
    num_bags = offsets.numel() - 1
    dim = weight.shape[1]
    narrow = weight.dtype in (torch.float16, torch.bfloat16)
    out_dtype = torch.float32 if narrow else weight.dtype
    out = torch.empty((num_bags, dim), dtype=out_dtype, device=weight.device)  # [B, D]
    if num_bags == 0 or dim == 0:
        return out
    bd = block_d(dim, MAX_BLOCK_D)
    pooling = pool_bucket(ids.numel(), num_bags)
    ids_c = ids.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else ids_c
    # Every address fits 32 bits unless the weight, the ids or the output are that large.
    wide = max(weight.numel(), ids.numel() + 1, out.numel()) >= 2**31 - 1
    args = (weight, weight.stride(0), ids_c, offsets.contiguous(), psw, out, num_bags, dim, pooling)
    flags = {"HAS_WEIGHTS": per_sample_weights is not None, "MEAN": mean, "WIDE_INDEX": wide}
    if autotune_enabled(weight):
        key = (dim, pooling, wide, mean, weight.dtype, ids.dtype, offsets.dtype, psw.dtype,
               per_sample_weights is not None, weight.device)  # fmt: skip
        cfg = _TUNED.get(key)
        if cfg is None:  # first call for this key: tune (trial runs only write `out`)
            grid = lambda meta: (cdiv(num_bags, meta["BAGS"]), cdiv(dim, bd))  # noqa: E731
            _pool_kernel_tuned[grid](*args, **flags, BLOCK_D=bd)
            best = getattr(_pool_kernel_tuned, "best_config", None)
            if best is not None:
                cfg = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
                _TUNED[key] = cfg
            return out
    else:
        cfg = default_config(dim, pooling)
    _pool_kernel[(cdiv(num_bags, cfg["BAGS"]), cdiv(dim, bd))](*args, **flags, BLOCK_D=bd, **cfg)
    return out


#: The autotuner's pick per launch key, so that later calls launch the kernel directly
#: (the autotuner's own per-call bookkeeping is host time a pooling-1 lookup cannot spare).
_TUNED: dict[tuple[object, ...], dict[str, int]] = {}


def tuned_configs() -> dict[str, dict[str, int]]:
    """The configs picked so far, by key (for benchmarks to report)."""
    return {repr(k): dict(v) for k, v in _TUNED.items()}
