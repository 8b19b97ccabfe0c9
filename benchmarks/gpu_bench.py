"""hybridrec on one GPU, side by side with plain PyTorch: kernels, a DLRM step, a GPT step.

One prepared script for one GPU (an H200 here), needing only torch, triton and numpy
plus this repository; ``benchmarks/gpu_check.sh`` runs it after the GPU tests. Parts,
each measured in this run (warm-up first, then medians of timed windows taken with
CUDA events; batches are built on the device beforehand, so loading is not timed):

* ``kernels``: the Triton fused embedding forward and step vs torch's
  ``embedding_bag`` (26 x 100 k x 64, batch 2048, pooling 1 and 20, row-wise
  Adagrad) through ``triton_bench.run_kernels``. The forward's
  bandwidth is the bytes of the rows it reads over the device-to-device copy
  bandwidth measured in the same run (a copy of S bytes moves 2S: read + write).
* ``dlrm``: one training step at MLPerf-like shapes (26 tables x 1 M rows x 128,
  batch 65,536, one Zipf(1.05) id per table and sample, bottom MLP 512-256-128, top
  MLP 1024-1024-512-256-1, dot interaction): hybridrec (local tables on the device,
  row-wise Adagrad fused into backward; ``dense.DLRMDense`` with Adam) vs a plain
  PyTorch DLRM written here (one ``nn.EmbeddingBag(sparse=True)`` per table and
  ``torch.optim.Adagrad`` on their sparse gradients, the same dense layers and
  interaction, Adam), in fp32 and under bf16 autocast; the two run in alternate
  windows. fp32 matmuls stay fp32 (TF32 off) for both.
* ``gpt``: the language model of ``hybridrec.lm`` (``dense.GPT`` 12 x 768, T 1024,
  its token table local on the device with lazy Adam, AdamW on the dense part) under
  bf16 autocast with TF32 on: tokens/s and MFU = (6 N + 12 L d T) FLOPs per token x
  tokens/s over the bf16 dense peak, N the dense parameters (the token table is a
  gather, no matmul, so it is not counted). Then the same with the dense GPT under
  ``torch.compile``, in a child process bounded by what is left of ``--budget-s``.
* ``gpu_cache``: the embedding cache on the GPU. The same DLRM (fp32, TF32 off, one
  ``train_step`` of the DLRM job per step, the next batch's ids prefetched) with 26 x 2 M
  x 128 tables, batch 65,536, fresh Zipf(1.05) ids every step, row-wise Adagrad, in four
  placements timed in alternate windows: ``local`` (tables wholly in device memory),
  ``uncached`` (hybrid over an ``InProcessStore`` in host memory, every unique row over
  PCIe each step) and ``cached_r0_w0`` / ``cached_r4_w4`` (hybrid behind
  ``cache.CachedStore(..., device=GPU)`` holding 10 % of the rows, TinyLFU, tables
  sharing one cache, bounds (0, 0) and (4, 4)). Store rows are hashed on the GPU
  (``InProcessStore(init_device=)``). Each cache warms until its hit rate is steady;
  reported: samples/s, hit rate and rows moved to/from the store per timed step, memory
  per variant. ``gpu_cache_vs_local`` and ``gpu_cache_vs_uncached`` read the faster
  cached variant. The part keeps to its own deadline (what ``--budget-s`` leaves, at
  most 90 s) and reports what it measured before running out.

Every part runs in its own ``try``: a failure is recorded with its message and the
other parts still report. With ``--out DIR`` (default ``$OUT`` when set), each part's
result is appended to ``DIR/gpu_bench_parts.jsonl`` as it finishes and the final
object is written to ``DIR/gpu_bench.json``. The last line of output is one JSON
object (see benchmarks/README.md) with every target, its value and whether it is met.

A run in two halves, so that a short GPU loan still yields the headline figures:
``--headline`` measures only what the kernel, DLRM and GPT targets read (the kernels'
forward and row-wise Adagrad step, both DLRM precisions and the eager GPT, fewer timed
windows; ~1 minute on an H200 with a cold Triton cache) and writes
``DIR/gpu_bench_headline.json`` (parts in ``DIR/gpu_bench_headline_parts.jsonl``);
``--after-headline`` then measures the rest (the kernels with every optimizer, the
cache part, the compiled GPT) and takes the DLRM and GPT figures from that file, so
its ``gpu_bench.json`` reports every target. ``benchmarks/gpu_check.sh`` runs it so.

    python benchmarks/gpu_bench.py                      # the full run, ~3 minutes on an H200
    python benchmarks/gpu_bench.py --headline --out D   # the headline figures first, ...
    python benchmarks/gpu_bench.py --after-headline --out D   # ... then the rest
    python benchmarks/gpu_bench.py --quick              # smaller shapes, no compile
    python benchmarks/gpu_bench.py --device cpu --tiny  # seconds on a CPU: keeps it runnable
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # triton_bench is a sibling script, not a package module
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from _bench_util import interleaved, medians, seconds_per_call  # noqa: E402

from cache.stats import COUNTERS  # noqa: E402
from comm import resolve_device  # noqa: E402
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig  # noqa: E402
from hybridrec.dlrm.model import DLRM  # noqa: E402
from hybridrec.train.precision import autocast  # noqa: E402
from ps import Store  # noqa: E402

PEAK_NAME = "H200 SXM bf16 dense 989 TFLOP/s"
PEAK_FLOPS = 989e12

#: Seconds the cache part needs at least (build, warm-up, two timed windows at full
#: shape take ~40-70 s on an H200); with less left it is skipped, saying so.
CACHE_MIN_S = 30

#: name -> the issue's target (every ratio is "at least").
TARGETS = {
    "triton_fwd_vs_torch_min": 1.0,
    "triton_step_vs_torch_min": 2.0,
    "fwd_bandwidth_fraction": 0.6,
    "dlrm_gpu_vs_torch": 2.0,
    "gpt_mfu": 0.35,
    "gpu_cache_vs_local": 0.5,
    "gpu_cache_vs_uncached": 2.0,
}


# ---------------------------------------------------------------- shapes


@dataclass(kw_only=True, slots=True)
class DLRMShape:
    tables: int = 26
    rows: int = 1_000_000
    dim: int = 128
    batch: int = 65_536
    num_dense: int = 13
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 128])
    top_mlp: list[int] = field(default_factory=lambda: [1024, 1024, 512, 256, 1])
    zipf_a: float = 1.05
    n_batches: int = 4  # pre-built on the device, cycled
    warmup: int = 5
    windows: int = 5  # per variant, alternating hybridrec / torch
    steps: int = 4  # per window
    emb_lr: float = 0.01
    dense_lr: float = 1e-3


@dataclass(kw_only=True, slots=True)
class GPTShape:
    vocab: int = 50_304  # GPT-2's 50,257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    block: int = 1024
    batch: int = 16
    n_batches: int = 2
    warmup: int = 5
    windows: int = 3
    steps: int = 5
    lr: float = 6e-4


def shapes(mode: str) -> tuple[DLRMShape, GPTShape]:
    """The shapes of ``mode``: full (the issue's), quick (under a minute) or tiny (CPU)."""
    if mode == "full":
        return DLRMShape(), GPTShape()
    if mode == "quick":
        return (
            DLRMShape(rows=100_000, batch=16_384, warmup=3, windows=3, steps=3),
            GPTShape(batch=4, warmup=3, windows=2, steps=3),
        )
    return (
        DLRMShape(
            tables=4,
            rows=1000,
            dim=16,
            batch=256,
            bottom_mlp=[32, 16],
            top_mlp=[64, 32, 1],
            n_batches=2,
            warmup=1,
            windows=2,
            steps=1,
        ),
        GPTShape(
            vocab=256,
            n_layer=2,
            n_head=2,
            d_model=32,
            block=32,
            batch=2,
            warmup=1,
            windows=2,
            steps=1,
        ),
    )


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls from CUDA events: the device's time
    from the first launch to the end of the last."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def windows_timed(
    variants: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    windows: int,
    steps: int,
) -> dict[str, float]:
    """Median seconds per step of each variant: a warm-up block of ``warmup`` steps each,
    then ``windows`` windows of ``steps`` steps, the variants taking turns (order reversed
    every other window); CUDA events on a GPU, else the host clock."""
    timer = cuda_seconds_per_call if device.type == "cuda" else seconds_per_call
    times = interleaved(
        variants, windows, calls=steps, warmup=warmup, order="alternate", timer=timer
    )
    return medians(times)


def free_memory(device: torch.device) -> None:
    """Return what the last part held, and start a new peak-memory count for the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on (``enabled``) or off inside the block."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ---------------------------------------------------------------- building on a device


def collection_on(
    tables: list[TableConfig], device: torch.device, notes: list[str], store: Store | None = None
) -> EmbeddingCollection:
    """An ``EmbeddingCollection`` with its local tables on ``device`` (its hybrid tables
    in ``store``), built as a user would: ``EmbeddingCollection(tables, device=device)``.
    Where the collection has no ``device`` keyword, it is built on the host and moved
    with ``.to(device)``; where its tables are not module state (``.to`` leaves them
    behind), they are moved here and a note says so."""
    try:
        coll = EmbeddingCollection(tables, store=store, device=device)  # type: ignore[call-arg]
    except TypeError as e:
        if "device" not in str(e):
            raise
        note = "EmbeddingCollection has no device= keyword: built on the host, then .to(device)"
        if note not in notes:
            notes.append(note)
        coll = EmbeddingCollection(tables, store=store)
        coll.to(device)
    for g in getattr(coll.local, "groups", None) or []:
        if g.weight.device != device:
            note = "local tables are not module state: .to(device) left them, moved by hand"
            if note not in notes:
                notes.append(note)
            g.weight, g.state, g.clocks = (
                g.weight.to(device),
                g.state.to(device),
                g.clocks.to(device),
            )
    return coll


def local_weights(coll: EmbeddingCollection) -> list[torch.Tensor]:
    """The ``[R, D]`` fused weights of the collection's local tables."""
    groups = getattr(coll.local, "groups", None)
    if groups:
        return [g.weight for g in groups]
    return [
        b
        for n, b in coll.named_buffers()
        if n.rsplit(".", 1)[-1].startswith("weight") and b.dim() == 2
    ]


# ---------------------------------------------------------------- kernels


def kernels_part(device: torch.device, quick: bool) -> dict[str, Any]:
    """Triton vs torch embedding kernels: ``triton_bench.run_kernels``."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {
            "skipped": "the Triton kernels need CUDA (or TRITON_INTERPRET=1 for a functional run)"
        }
    import triton_bench

    if device.type == "cuda":
        return dict(triton_bench.run_kernels(device, quick))
    return dict(triton_bench.run_kernels(device, True, interpret=True))


def headline_kernels_part(device: torch.device, quick: bool) -> dict[str, Any]:
    """The kernel targets alone: ``triton_bench``'s forward and row-wise Adagrad step,
    Triton vs torch, at its shapes and poolings, and the forward's bandwidth fraction;
    the same figures as :func:`kernels_part` without the other optimizers' steps (one
    update kernel compiled instead of six). Each is checked against torch once first."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {
            "skipped": "the Triton kernels need CUDA (or TRITON_INTERPRET=1 for a functional run)"
        }
    import triton_bench as tb

    from embedding.kernels.triton_pool import tuned_configs

    interpret = device.type != "cuda"
    plan = tb.sizes(quick or interpret, interpret)
    reps = {k: plan[k] for k in ("warmup", "iters", "repeats")}
    name = "rowwise_adagrad"
    opt = tb.OPTIMIZERS[name]
    copy_bytes = (1 << 20) if interpret else (256 << 20 if quick else 1 << 30)
    copy_gbps = tb.copy_bandwidth_gbps(device, copy_bytes, repeats=5)
    fwd_ratio: dict[str, float] = {}
    step_ratio: dict[str, float] = {}
    cases: dict[str, dict[str, Any]] = {}
    rows_gbps = 0.0
    for pooling in plan["poolings"]:
        tag = f"L{pooling}"
        p = tb.make_problem(**plan["shape"], pooling=pooling, device=device, seed=pooling)
        weight = torch.randn(p.tables * p.rows, p.dim, device=device) * 0.01  # [T * rows, D]
        ref = F.embedding_bag(p.ids, weight, p.offsets, mode="sum", include_last_offset=True)
        fwd_fns = {"triton": tb.triton_fwd(p, weight), "torch": tb.torch_fwd(p, weight)}
        fwd_diff = tb.max_diff(fwd_fns["triton"](), ref)  # type: ignore[arg-type]
        if fwd_diff > 1e-4:  # triton_bench's gate: a wrong pooling, not rounding
            raise RuntimeError(f"triton forward differs from torch by {fwd_diff}")
        fwd = tb.measure(fwd_fns, device, **reps)
        fwd_ratio[tag] = fwd["torch"]["ms"] / fwd["triton"]["ms"]
        rows_gbps = (
            p.ids.numel() * p.dim * weight.element_size() / (fwd["triton"]["ms"] * 1e-3) / 1e9
        )
        w_t, w_ref = weight.clone(), weight.clone()
        s_t = tb.initial_state(opt, w_t.shape[0], p.dim, device)
        s_ref = s_t.clone()
        steps = {"triton": tb.triton_step(p, w_t, s_t, opt),
                 "torch": tb.torch_step(p, w_ref, s_ref, opt)}  # fmt: skip
        for fn in steps.values():  # one checked step from the same start
            fn()
        diff = max(tb.max_diff(w_t, w_ref), tb.max_diff(s_t, s_ref))
        if diff > 1e-4:
            raise RuntimeError(f"{name} step differs from torch by {diff}")
        ms = tb.measure(steps, device, **reps)
        step_ratio[tag] = ms["torch"]["ms"] / ms["triton"]["ms"]
        cases[tag] = {
            "ids": p.ids.numel(),
            "forward_max_abs_diff": fwd_diff,
            "fwd": fwd,
            "triton_vs_torch_fwd": round(fwd_ratio[tag], 3),
            "fwd_rows_gbps": round(rows_gbps, 1),
            "step": {name: ms | {"max_abs_diff_first_step": diff,
                                 "triton_vs_torch": round(step_ratio[tag], 3)}},
        }  # fmt: skip
        del p, weight, ref, fwd_fns, steps, w_t, w_ref, s_t, s_ref
    return {
        "triton_fwd_vs_torch_min": round(min(fwd_ratio.values()), 3),
        "triton_step_vs_torch_min": round(min(step_ratio.values()), 3),
        "fwd_bandwidth_fraction": round(rows_gbps / copy_gbps, 3),
        "copy_gbps": round(copy_gbps, 1),
        "fwd_rows_gbps": round(rows_gbps, 1),
        "step_vs_torch": {name: {k: round(v, 3) for k, v in step_ratio.items()}},
        "cases": cases,
        "config": {
            **plan["shape"],
            "poolings": plan["poolings"],
            "optimizers": [name],
            **reps,
            "device": str(device),
            "interpret": interpret,
            "bandwidth_pooling": plan["poolings"][-1],
        },
        "tuned": tuned_configs(),
    }


def headline_shapes(mode: str) -> tuple[DLRMShape, GPTShape]:
    """The DLRM and GPT shapes of ``--headline``: those of ``mode`` with fewer warm-up
    steps and timed windows (a minute, not three; the figures are medians either way)."""
    dshape, gshape = shapes(mode)
    if mode == "tiny":
        return dshape, gshape
    return (
        dataclasses.replace(dshape, warmup=3, windows=3, steps=3),
        dataclasses.replace(gshape, warmup=3, windows=2, steps=3),
    )


# ---------------------------------------------------------------- DLRM


@dataclass(slots=True)
class CTRBatch:
    dense: torch.Tensor  # [B, num_dense] float32
    ids: torch.Tensor  # [T, B] int64, one id per table and sample
    labels: torch.Tensor  # [B] float32 in {0, 1}


def zipf_batches(shape: DLRMShape, device: torch.device, seed: int = 0) -> list[CTRBatch]:
    """Batches drawn on ``device``: per table, Zipf(a) ranks truncated to ``rows`` ids
    (rank k has probability k^-a / H) scattered over the rows by a permutation of its own,
    drawn with repeats; log-normal dense features; 25 % positive labels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ranks = torch.arange(1, shape.rows + 1, dtype=torch.float64, device=device)
    cdf = torch.cumsum(ranks.pow_(-shape.zipf_a), 0)
    cdf /= cdf[-1].clone()  # [rows]
    scatter = [
        torch.randperm(shape.rows, generator=gen, device=device) for _ in range(shape.tables)
    ]
    out = []
    for _ in range(shape.n_batches):
        u = torch.rand(shape.tables, shape.batch, generator=gen, dtype=torch.float64, device=device)
        rank = torch.searchsorted(cdf, u).clamp_(max=shape.rows - 1)  # [T, B]
        ids = torch.stack([scatter[t][rank[t]] for t in range(shape.tables)])  # [T, B]
        dense = torch.randn(shape.batch, shape.num_dense, generator=gen, device=device).exp_()
        labels = (torch.rand(shape.batch, generator=gen, device=device) < 0.25).float()
        out.append(CTRBatch(torch.log1p(dense), ids, labels))
    return out


def reference_mlp(
    in_dim: int, widths: list[int], *, last_relu: bool, device: torch.device
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, w in enumerate(widths):
        layers.append(nn.Linear(in_dim, w, device=device))
        if i < len(widths) - 1 or last_relu:
            layers.append(nn.ReLU())
        in_dim = w
    return nn.Sequential(*layers)


class TorchDLRM(nn.Module):
    """Plain PyTorch DLRM: one ``nn.EmbeddingBag(sparse=True)`` per table, bottom MLP,
    pairwise dot products (strict lower triangle of ``T T^T``), top MLP."""

    def __init__(self, shape: DLRMShape, device: torch.device) -> None:
        super().__init__()
        bound = math.sqrt(1.0 / shape.rows)  # TorchRec's default init range
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(shape.rows, shape.dim, mode="sum", sparse=True, device=device)
            for _ in range(shape.tables)
        )
        with torch.no_grad():
            for table in self.tables:
                assert isinstance(table, nn.EmbeddingBag)
                table.weight.uniform_(-bound, bound)
        n = shape.tables + 1
        self.bottom = reference_mlp(
            shape.num_dense, shape.bottom_mlp, last_relu=True, device=device
        )
        top_in = shape.dim + n * (n - 1) // 2
        self.top = reference_mlp(top_in, shape.top_mlp, last_relu=False, device=device)
        rows, cols = torch.tril_indices(n, n, offset=-1, device=device)
        self.pairs: torch.Tensor
        self.register_buffer("pairs", rows * n + cols, persistent=False)  # [P] into [N*N]

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, D]
        pooled = [t(ids[i].unsqueeze(1)) for i, t in enumerate(self.tables)]  # T x [B, D]
        feats = torch.stack([x, *pooled], dim=1)  # [B, N, D]
        z = torch.bmm(feats, feats.transpose(1, 2)).flatten(1)  # [B, N*N]
        return self.top(torch.cat([x, z[:, self.pairs]], dim=1)).squeeze(1)  # [B]


def dlrm_table_configs(shape: DLRMShape, placement: str = "local") -> list[TableConfig]:
    """The DLRM's tables ``f0 .. f{T-1}`` (row-wise Adagrad), all of one ``placement``."""
    from hybridrec.dlrm.data import Feature
    from hybridrec.dlrm.model import dlrm_tables

    features = [Feature(f"f{t}", shape.rows) for t in range(shape.tables)]
    placements = {f.name: placement for f in features}
    return dlrm_tables(features, dim=shape.dim, emb_lr=shape.emb_lr, placements=placements)


def hybridrec_dlrm(
    shape: DLRMShape,
    device: torch.device,
    notes: list[str],
    placement: str = "local",
    store: Store | None = None,
) -> DLRM:
    """``hybridrec.dlrm.model.DLRM``: tables (row-wise Adagrad) of one ``placement`` +
    ``DLRMDense``; hybrid tables live in ``store``."""
    from dense import DLRMConfig, DLRMDense

    tables = dlrm_table_configs(shape, placement)
    # Local tables: the default init (TorchRec's U(-sqrt(1/rows), sqrt(1/rows)), a hash
    # of (seed, id, column)) runs on the device the tables are built on.
    embeddings = collection_on(tables, device, notes, store)
    if placement == "local" and not local_weights(embeddings):
        notes.append("the local tables' weights were not found")
    config = DLRMConfig(
        num_dense=shape.num_dense,
        num_sparse=shape.tables,
        embedding_dim=shape.dim,
        bottom_mlp=list(shape.bottom_mlp),
        top_mlp=list(shape.top_mlp),
    )
    return DLRM(embeddings, DLRMDense(config).to(device))


def dense_adam(params: Any, lr: float, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.Adam(list(params), lr=lr, fused=device.type == "cuda")


def dlrm_steps(
    shape: DLRMShape, device: torch.device, batches: list[CTRBatch], notes: list[str]
) -> tuple[Callable[[str], Callable[[], None]], Callable[[str], Callable[[], None]]]:
    """``(hybridrec, torch)``: each maps a precision to a one-step function."""
    from hybridrec.datasets.ctr import Batch

    keys = [f"f{t}" for t in range(shape.tables)]
    lengths = torch.ones(shape.tables * shape.batch, dtype=torch.int64, device=device)
    hr_batches = [
        Batch(
            dense=b.dense, sparse=KeyedJaggedIds(keys, b.ids.reshape(-1), lengths), labels=b.labels
        )
        for b in batches
    ]
    hr = hybridrec_dlrm(shape, device, notes)
    hr_opt = dense_adam(hr.dense.parameters(), shape.dense_lr, device)
    th = TorchDLRM(shape, device)
    th_dense = [p for n, p in th.named_parameters() if not n.startswith("tables.")]
    th_dense_opt = dense_adam(th_dense, shape.dense_lr, device)
    th_table_opt = torch.optim.Adagrad(th.tables.parameters(), lr=shape.emb_lr, eps=1e-8)
    count = {"hybridrec": 0, "torch": 0}

    def hybridrec_step(precision: str) -> Callable[[], None]:
        def step() -> None:
            b = hr_batches[count["hybridrec"] % len(hr_batches)]
            count["hybridrec"] += 1
            hr_opt.zero_grad(set_to_none=True)
            with autocast(device, precision):
                logits = hr(b)
            F.binary_cross_entropy_with_logits(logits.float(), b.labels).backward()
            hr_opt.step()

        return step

    def torch_step(precision: str) -> Callable[[], None]:
        def step() -> None:
            b = batches[count["torch"] % len(batches)]
            count["torch"] += 1
            th_dense_opt.zero_grad(set_to_none=True)
            th_table_opt.zero_grad(set_to_none=True)
            with autocast(device, precision):
                logits = th(b.dense, b.ids)
            F.binary_cross_entropy_with_logits(logits.float(), b.labels).backward()
            th_dense_opt.step()
            th_table_opt.step()

        return step

    return hybridrec_step, torch_step


def dlrm_part(
    device: torch.device,
    shape: DLRMShape,
    notes: list[str],
    emit: Callable[[str, dict[str, Any]], None],
) -> dict[str, Any]:
    """Samples/s of both DLRMs per precision, each ``emit``-ted as it is measured; a
    precision that fails says why."""
    t0 = time.perf_counter()
    batches = zipf_batches(shape, device)
    hybridrec_step, torch_step = dlrm_steps(shape, device, batches, notes)
    out: dict[str, Any] = {
        "build_s": round(time.perf_counter() - t0, 1),
        # rows one step touches (and updates), all tables together
        "distinct_ids_per_batch": sum(int(torch.unique(t).numel()) for t in batches[0].ids),
    }
    with tf32(False):
        for precision in ("fp32", "bf16"):
            try:
                s = windows_timed(
                    {"hybridrec": hybridrec_step(precision), "torch": torch_step(precision)},
                    device,
                    warmup=shape.warmup,
                    windows=shape.windows,
                    steps=shape.steps,
                )
                out[precision] = {
                    "samples_s": {n: shape.batch / v for n, v in s.items()},
                    "ms_step": {n: round(v * 1e3, 3) for n, v in s.items()},
                    "hybridrec_vs_torch": s["torch"] / s["hybridrec"],
                }
            except Exception as e:
                out[precision] = {"error": error_text(e)}
            emit(f"dlrm.{precision}", out[precision])
    if device.type == "cuda":
        out["max_memory_GB"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
    out["shape"] = dataclasses.asdict(shape)
    return out


# ---------------------------------------------------------------- GPU cache


@dataclass(kw_only=True, slots=True)
class CacheShape:
    """The cache part: a DLRM (``model``; its ``n_batches`` is set by the part) whose
    tables are local in device memory, hybrid over a host store, or hybrid behind a
    device cache of ``capacity_fraction`` of each table, one cache per bounds pair."""

    model: DLRMShape = field(default_factory=lambda: DLRMShape(rows=2_000_000))
    capacity_fraction: float = 0.1
    policy: str = "tinylfu"
    bounds: tuple[tuple[int, int], ...] = ((0, 0), (4, 4))  # (read, write) per cached variant
    precision: str = "fp32"  # TF32 off, as the dlrm part
    warm_local: int = 4  # steps (local and uncached: nothing to warm but kernels)
    warm_block: int = 4  # cached: steps between two readings of the hit rate
    warm_min: int = 8  # cached: steps before the hit rate may count as steady
    warm_max: int = 40
    steady_tol: float = 0.01  # hit-rate change between two blocks that counts as steady
    windows: int = 3
    steps: int = 3
    budget_s: float = 90.0  # the whole part, build included; the run gives it less if short


def cache_shape(mode: str) -> CacheShape:
    """The cache part's shape for ``mode`` (see :func:`shapes`)."""
    if mode == "full":
        return CacheShape()
    if mode == "quick":
        return CacheShape(
            model=DLRMShape(tables=8, rows=200_000, batch=16_384), warm_max=24, budget_s=45.0
        )
    tiny, _ = shapes("tiny")
    return CacheShape(
        model=tiny,
        warm_local=2,
        warm_block=2,
        warm_min=2,
        warm_max=6,
        windows=2,
        steps=1,
        budget_s=60.0,
    )


# The cache's counters (every one cache.stats keeps), summed over its caches per step.
CACHE_TOTALS = COUNTERS


def cache_totals(cached: Any) -> dict[str, int]:
    """``cached.cache_stats()`` counters summed over its caches (one per table group)."""
    total = dict.fromkeys(CACHE_TOTALS, 0)
    for stats in cached.cache_stats().values():
        for key in CACHE_TOTALS:
            total[key] += int(stats.get(key, 0))
    return total


@dataclass(slots=True)
class CacheVariant:
    """One DLRM of the cache part and its place in the shared stream of batches."""

    name: str
    model: DLRM
    opt: torch.optim.Optimizer
    batches: list[Any]  # hybridrec Batch: fresh ids per step, the same stream for all
    precision: str
    cached: Any = None  # the cache.CachedStore with rows on the device, if any
    count: int = 0  # steps taken
    wrapped: bool = False  # ran past the drawn batches (ids then repeat)

    def step(self) -> None:
        """One step of the DLRM job (``train_step``): the next batch's ids go to the
        cache first (they ride on this step's pull), then forward, backward, Adam."""
        from hybridrec.dlrm.job import train_step

        n = len(self.batches)
        i = self.count
        self.count += 1
        self.wrapped |= i + 1 >= n
        train_step(
            self.model, self.opt, self.batches[i % n], self.batches[(i + 1) % n], self.precision
        )


def gib(n: float) -> float:
    """Bytes in GiB, to the MiB."""
    return round(n / 2**30, 3)


def gpu_cache_part(
    device: torch.device, shape: CacheShape, budget_s: float, notes: list[str]
) -> dict[str, Any]:
    """Samples/s of one DLRM step with its tables local in device memory, hybrid over a
    host store (every unique row over PCIe each step), and hybrid behind a device cache
    per bounds pair, interleaved; the cache's hit rate and rows moved per step over the
    timed steps; the memory each variant took. Bounded by ``budget_s`` (and
    ``shape.budget_s``): every phase checks the deadline, and what was measured before
    it ran out is in the result with the ``error`` saying where."""
    deadline = time.perf_counter() + min(budget_s, shape.budget_s)
    out: dict[str, Any] = {
        "model": "hybridrec.dlrm DLRM (the dlrm part's dense layers), one train_step of the "
        "DLRM job (next batch's ids prefetched), tables' placement switched per variant",
    }
    try:
        with tf32(False):
            _gpu_cache_run(device, shape, deadline, notes, out)
    except Exception as e:
        out["error"] = error_text(e)
        out["where"] = traceback.format_exc(limit=-3)[-800:]
    return out


def _time_left(deadline: float, what: str, need: float = 0.0) -> float:
    left = deadline - time.perf_counter()
    if left < need:
        raise TimeoutError(f"{what}: {left:.1f} s left of the part's budget, needs {need:.1f} s")
    return left


def _gpu_cache_run(
    device: torch.device,
    shape: CacheShape,
    deadline: float,
    notes: list[str],
    out: dict[str, Any],
) -> None:
    from cache import CacheConfig, CachedStore, cache_bytes
    from hybridrec.datasets.ctr import Batch
    from ps import InProcessStore

    t_start = time.perf_counter()
    cuda = device.type == "cuda"
    n_draws = shape.warm_max + shape.windows * shape.steps + 2
    dshape = dataclasses.replace(shape.model, n_batches=n_draws)
    out["batches_drawn"] = n_draws

    # ---- batches: fresh Zipf ids every step (a cache fed repeats would flatter itself),
    # the same stream for every variant. Local tables read device batches (as the dlrm
    # part); hybrid tables read host batches, pinned, as the DLRM job gives them.
    drawn = zipf_batches(dshape, device, seed=1)
    keys = [f"f{t}" for t in range(dshape.tables)]
    lengths_dev = torch.ones(dshape.tables * dshape.batch, dtype=torch.int64, device=device)
    lengths_host = torch.ones(dshape.tables * dshape.batch, dtype=torch.int64)
    dev_batches = [
        Batch(
            dense=b.dense,
            sparse=KeyedJaggedIds(keys, b.ids.reshape(-1), lengths_dev),
            labels=b.labels,
        )
        for b in drawn
    ]
    host_batches = [
        Batch(
            dense=b.dense,
            sparse=KeyedJaggedIds(keys, b.ids.reshape(-1).cpu(), lengths_host).pin_memory(),
            labels=b.labels,
        )
        for b in drawn
    ]
    distinct = [sum(int(torch.unique(t).numel()) for t in b.ids) for b in drawn[:4]]
    out["distinct_rows_per_batch"] = statistics.mean(distinct)
    out["batches_s"] = round(time.perf_counter() - t_start, 1)

    variants: dict[str, CacheVariant] = {}
    memory: dict[str, dict[str, Any]] = {}
    out["memory"] = memory

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    def dense_opt(m: DLRM) -> torch.optim.Optimizer:
        return dense_adam(m.dense.parameters(), dshape.dense_lr, device)

    # ---- (a) local: tables wholly in device memory
    t0 = time.perf_counter()
    before = allocated()
    local = hybridrec_dlrm(dshape, device, notes)
    variants["local"] = CacheVariant("local", local, dense_opt(local), dev_batches, shape.precision)
    groups = getattr(local.embeddings.local, "groups", None) or []
    table_bytes = sum(g.weight.nbytes + g.state.nbytes + g.clocks.nbytes for g in groups)
    memory["local"] = {"device_tables_GiB": gib(table_bytes), "host_GiB": 0.0}
    built = {"local": allocated() - before}  # device bytes each variant's build took
    out["build_s"] = {"local": round(time.perf_counter() - t0, 1)}
    _time_left(deadline, "after building the local tables")

    # ---- stores in host memory, initial rows hashed on the device. Two stores: the
    # uncached variant and the cached one with bounds (0, 0) share one (at bounds 0 a
    # cached row is refreshed whenever its PS clock moved, by whom does not matter);
    # a cache with a read bound > 0 gets its own, so no other variant's pushes push
    # its copies past the bound.
    specs = [cfg.to_spec() for cfg in dlrm_table_configs(dshape, "hybrid")]
    stores: dict[str, InProcessStore] = {}

    def new_store(name: str) -> InProcessStore:
        t = time.perf_counter()
        store = InProcessStore(init_device=device)
        for i, spec in enumerate(specs):
            store.create_table(spec)
            took = time.perf_counter() - t
            per_table = took / (i + 1)
            if i + 1 < len(specs):  # the rest would end past the deadline: stop now
                _time_left(
                    deadline,
                    f"store {name}: {i + 1} tables in {took:.1f} s",
                    per_table * (len(specs) - i - 1),
                )
        out.setdefault("store_init_s", {})[name] = round(time.perf_counter() - t, 1)
        stores[name] = store
        return store

    shared = new_store("uncached+bounds_0")
    host_store_bytes = sum(int(s["bytes"]) for s in shared.stats().values())
    out["store_GiB"] = gib(host_store_bytes)

    # ---- (b) hybrid without a cache: every unique row over PCIe each step
    t0 = time.perf_counter()
    before = allocated()
    unc = hybridrec_dlrm(dshape, device, notes, "hybrid", shared)
    variants["uncached"] = CacheVariant(
        "uncached", unc, dense_opt(unc), host_batches, shape.precision
    )
    memory["uncached"] = {"device_tables_GiB": 0.0, "host_GiB": gib(host_store_bytes)}
    built["uncached"] = allocated() - before
    out["build_s"]["uncached"] = round(time.perf_counter() - t0, 1)

    # ---- (c) hybrid behind a device cache, one per bounds pair
    for r, w in shape.bounds:
        name = f"cached_r{r}_w{w}"
        store = shared if (r, w) == (0, 0) else new_store(name)
        t0 = time.perf_counter()
        before = allocated()
        config = CacheConfig(
            capacity_fraction=shape.capacity_fraction,
            read_bound=r,
            write_bound=w,
            policy=shape.policy,  # type: ignore[arg-type]
            group_tables=True,
        )
        cached = CachedStore(store, config, device=device)
        m = hybridrec_dlrm(dshape, device, notes, "hybrid", cached)
        variants[name] = CacheVariant(name, m, dense_opt(m), host_batches, shape.precision, cached)
        need = cache_bytes(config, specs, on_device=True)
        memory[name] = {
            "device_cache_GiB": gib(need.device),
            "host_GiB": gib(need.host + (0 if store is shared else host_store_bytes)),
            "host_store": "shared with uncached" if store is shared else "its own",
        }
        built[name] = allocated() - before
        out["build_s"][name] = round(time.perf_counter() - t0, 1)
    _time_left(deadline, "after building every variant")

    # ---- warm-up, one variant after the other: kernels (Triton autotune) and pinned
    # buffers first; a cache until its hit rate is steady. The caches share what the
    # timed windows will not need (estimated with the uncached step time), at least a
    # quarter of the time left.
    warm: dict[str, dict[str, Any]] = {}
    out["warmup"] = warm
    step_s: dict[str, float] = {}
    caches_left = sum(v.cached is not None for v in variants.values())
    cache_warm_until = 0.0
    for name, v in variants.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        base = allocated()
        info: dict[str, Any] = {}
        rates: list[float] = []
        if v.cached is None:
            half = shape.warm_local // 2
            blocks = [max(1, half), max(1, shape.warm_local - half)]
            until = deadline
        else:
            if not cache_warm_until:  # the first cache: local and uncached steps are known
                left = _time_left(deadline, "warming the caches")
                guess = step_s["local"] + step_s["uncached"] * (1 + caches_left)
                timed_need = shape.windows * shape.steps * guess + 1.0
                cache_warm_until = time.perf_counter() + max(left - timed_need, 0.25 * left)
            blocks = [shape.warm_block] * -(-shape.warm_max // shape.warm_block)
            until = time.perf_counter() + (cache_warm_until - time.perf_counter()) / caches_left
            caches_left -= 1
            info["block_hit_rates"] = rates
            info["steady"] = False
        steps = 0
        for n in blocks:
            seen = cache_totals(v.cached) if v.cached is not None else None
            t = time.perf_counter()
            done = 0
            while done < n and (done == 0 or time.perf_counter() < until):
                v.step()
                done += 1
            sync(device)
            step_s[name] = (time.perf_counter() - t) / done  # the last block: the estimate
            steps += done
            if seen is not None:
                now = cache_totals(v.cached)
                rates.append(
                    (now["hits"] - seen["hits"]) / max(1, now["lookups"] - seen["lookups"])
                )
                if (
                    steps >= shape.warm_min
                    and len(rates) >= 2
                    and abs(rates[-1] - rates[-2]) <= shape.steady_tol
                ):
                    info["steady"] = True
                    break
            if time.perf_counter() + step_s[name] > until:
                break
        info["steps"] = steps
        info["s_per_step"] = round(step_s[name], 4)
        warm[name] = info
        if cuda:
            memory[name]["device_GiB"] = gib(built[name] + allocated() - base)
            memory[name]["step_peak_GiB"] = gib(torch.cuda.max_memory_allocated(device) - base)
        _time_left(deadline, f"after warming {name}")

    # ---- timed windows, sized to the time left by the warm-up's step times
    round_s = sum(step_s.values())  # one step of every variant
    left = _time_left(deadline, "timed windows", round_s) - 1.0
    steps_per = shape.steps
    windows = min(shape.windows, int(left / (steps_per * round_s)))
    if windows < 2:
        steps_per = 1
        windows = min(shape.windows, int(left / round_s))
    if windows < 1:
        raise TimeoutError(
            f"timed windows: {left:.1f} s left, one round of steps takes {round_s:.1f} s"
        )
    out["timed"] = {"windows": windows, "steps": steps_per}
    before_stats = {n: cache_totals(v.cached) for n, v in variants.items() if v.cached is not None}
    first = variants["uncached"].count
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    s = windows_timed(
        {n: v.step for n, v in variants.items()}, device, warmup=0, windows=windows, steps=steps_per
    )
    timed = windows * steps_per
    out["samples_s"] = {n: dshape.batch / v for n, v in s.items()}
    out["ms_step"] = {n: round(v * 1e3, 3) for n, v in s.items()}

    # ---- rows moved: the uncached step pulls and pushes every distinct row of its
    # batches; a cache what its counters say
    unc_distinct = [
        sum(int(torch.unique(t).numel()) for t in drawn[i % n_draws].ids)
        for i in range(first, first + timed)
    ]
    moved_uncached = 2 * statistics.mean(unc_distinct)
    out["rows_moved_per_step"] = {"uncached": moved_uncached}
    out["hit_rate"] = {}
    for name, v in variants.items():
        if v.cached is None:
            continue
        a, b = before_stats[name], cache_totals(v.cached)
        d = {k: b[k] - a[k] for k in CACHE_TOTALS}
        moved = (d["rows_pulled"] + d["rows_pushed"]) / timed
        out["hit_rate"][name] = d["hits"] / max(1, d["lookups"])
        out["rows_moved_per_step"][name] = moved
        out.setdefault("cache_counts_per_step", {})[name] = {k: d[k] / timed for k in CACHE_TOTALS}
        out.setdefault("rows_moved_reduction", {})[name] = 1.0 - moved / moved_uncached
    if any(v.wrapped for v in variants.values()):
        notes.append("gpu_cache: a variant ran past the drawn batches; their ids repeated")

    # ---- the ratios, per bounds pair; the targets read the faster cached variant
    cached_names = [n for n, v in variants.items() if v.cached is not None]
    sps = out["samples_s"]
    out["vs_local"] = {n: sps[n] / sps["local"] for n in cached_names}
    out["vs_uncached"] = {n: sps[n] / sps["uncached"] for n in cached_names}
    best = max(cached_names, key=lambda n: sps[n])
    out["targets_read"] = best
    out["gpu_cache_vs_local"] = out["vs_local"][best]
    out["gpu_cache_vs_uncached"] = out["vs_uncached"][best]
    out["cache_device"] = str(variants[best].cached.device)
    if cuda:  # every variant's tables, caches and batches, and the largest step's peak
        out["timed_peak_GiB"] = gib(torch.cuda.max_memory_allocated(device))


# ---------------------------------------------------------------- GPT


def attention_used() -> str:
    """How ``dense.gpt`` computes attention (read from its source, so this stays true)."""
    from dense.gpt import CausalSelfAttention

    src = inspect.getsource(CausalSelfAttention.forward)
    if "scaled_dot_product_attention" in src:
        return "F.scaled_dot_product_attention (torch picks flash / cuDNN / efficient)"
    return "hand-written (not F.scaled_dot_product_attention): no flash attention"


def gpt_part(
    device: torch.device, shape: GPTShape, compile_gpt: bool, notes: list[str]
) -> dict[str, Any]:
    """Tokens/s and MFU of one bf16 training step of ``hybridrec.lm``'s model."""
    from dense.gpt import GPT, GPTConfig, gpt_loss
    from hybridrec.lm.config import LMConfig
    from hybridrec.lm.model import TOKENS, LanguageModel, token_table

    t0 = time.perf_counter()
    lm_cfg = LMConfig(
        placement="local",
        emb_optimizer="adam",
        d_model=shape.d_model,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        block_size=shape.block,
        batch_size=shape.batch,
    )
    torch.manual_seed(0)
    gpt = GPT(
        GPTConfig(
            vocab_size=shape.vocab,
            block_size=shape.block,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            d_model=shape.d_model,
            dropout=0.0,
        )
    ).to(device)
    n_dense = gpt.num_parameters()
    embeddings = collection_on([token_table(lm_cfg, shape.vocab)], device, notes)
    dense: nn.Module = torch.compile(gpt) if compile_gpt else gpt  # type: ignore[assignment]
    model = LanguageModel(embeddings, dense)
    opt = torch.optim.AdamW(
        gpt.parameters(),
        lr=shape.lr,
        betas=(0.9, 0.95),
        weight_decay=0.01,
        fused=device.type == "cuda",
    )
    gen = torch.Generator(device=device).manual_seed(0)
    windows = torch.randint(
        shape.vocab, (shape.n_batches, shape.batch, shape.block + 1), generator=gen, device=device
    )
    data = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]  # [B, T] each
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    count = [0]

    def embed_on_device(idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        lengths = torch.full((b,), t, dtype=torch.int64, device=idx.device)  # [B]: T ids each
        return embeddings(KeyedJaggedIds([TOKENS], idx.reshape(-1), lengths))[TOKENS]

    def step() -> None:
        x, y = data[count[0] % len(data)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        with autocast(device, "bf16"):
            loss = gpt_loss(forward(x), y)
        loss.backward()
        opt.step()

    with tf32(True):
        try:
            step()
        except RuntimeError as e:
            if device.type != "cuda":
                raise
            notes.append(
                f"LanguageModel on {device}: {error_text(e)[:200]}; timed with the token "
                "ids' KeyedJaggedIds built on the device instead"
            )
            forward = lambda idx: dense(embed_on_device(idx))  # noqa: E731
            step()
        sync(device)
        first_s = time.perf_counter() - t0
        s = windows_timed(
            {"gpt": step}, device, warmup=shape.warmup, windows=shape.windows, steps=shape.steps
        )["gpt"]
    tokens_s = shape.batch * shape.block / s
    flops_per_token = 6 * n_dense + 12 * shape.n_layer * shape.d_model * shape.block
    out: dict[str, Any] = {
        "tokens_s": tokens_s,
        "ms_step": round(s * 1e3, 3),
        "mfu": flops_per_token * tokens_s / PEAK_FLOPS,
        "dense_params": n_dense,
        "token_table_params": shape.vocab * shape.d_model,
        "flops_per_token": flops_per_token,
        "build_and_first_step_s": round(first_s, 1),
        "compiled": compile_gpt,
    }
    if device.type == "cuda":
        out["max_memory_GB"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
    return out


def gpt_compiled_child(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """The compiled GPT in a child process, killed after ``timeout`` seconds (a compile
    cannot be interrupted in-process); its last output line is its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", "gpt-compiled"]
    cmd += ["--device", args.device] + (["--quick"] if args.quick else [])
    # A session of its own: on time-out the child and its compile workers go together.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"torch.compile run did not finish within {timeout:.0f} s (budget)"}
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {stderr.strip()[-400:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ---------------------------------------------------------------- report


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


class Report:
    """Results by part; each part's result goes to ``out/<name>_parts.jsonl`` at once
    (``name``: ``gpu_bench``, or ``gpu_bench_headline`` for ``--headline``)."""

    def __init__(self, out: Path | None, name: str = "gpu_bench") -> None:
        self.out = out
        self.name = name
        self.parts: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        self.result: dict[str, Any] = {}  # the final object, once made
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}_parts.jsonl").write_text("")

    def run(self, name: str, fn: Callable[[], dict[str, Any]], device: torch.device) -> None:
        """``fn()``'s result as part ``name``; an exception becomes its ``error``, and so
        does an ``error`` one level down (one precision of a part)."""
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:
            result = {"error": error_text(e), "where": traceback.format_exc(limit=-3)[-800:]}
        finally:
            free_memory(device)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        if "error" in result:
            self.errors[name] = result["error"]
        for key, sub in result.items():
            if isinstance(sub, dict) and "error" in sub:
                self.errors[f"{name}.{key}"] = sub["error"]
        self.parts[name] = result
        self.emit(name, result)

    def emit(self, name: str, result: dict[str, Any]) -> None:
        """One line ``{"part": name, ...}`` to stderr and to the parts file, now."""
        line = json.dumps({"part": name, **result}, default=str)
        print(line, file=sys.stderr, flush=True)
        if self.out is not None:
            with open(self.out / f"{self.name}_parts.jsonl", "a") as f:
                f.write(line + "\n")


def target(name: str, value: float | None, note: str = "", **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "value": None if value is None else round(float(value), 4),
        "target": TARGETS[name],
        "met": value is not None and float(value) >= TARGETS[name],
    }
    if note:
        entry["note"] = note
    return entry | extra


def targets_of(parts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One entry per target of the issue: measured value, target, met (null: why not)."""
    out: dict[str, dict[str, Any]] = {}
    k = parts.get("kernels", {})
    why = k.get("error") or k.get("skipped") or "not measured"
    for name in ("triton_fwd_vs_torch_min", "triton_step_vs_torch_min", "fwd_bandwidth_fraction"):
        v = k.get(name)
        out[name] = target(name, v, "" if v is not None else why)
    d = parts.get("dlrm", {})
    ratios = {p: d.get(p, {}).get("hybridrec_vs_torch") for p in ("fp32", "bf16")}
    if all(r is not None for r in ratios.values()):
        out["dlrm_gpu_vs_torch"] = target(
            "dlrm_gpu_vs_torch", min(ratios.values()), "the worse of fp32 and bf16", **ratios
        )
    else:
        missing = {
            p: d.get(p, {}).get("error", d.get("error", "not measured"))
            for p, r in ratios.items()
            if r is None
        }
        out["dlrm_gpu_vs_torch"] = target("dlrm_gpu_vs_torch", None, json.dumps(missing), **ratios)
    g, gc_ = parts.get("gpt", {}), parts.get("gpt_compiled", {})
    compiled = gc_.get("mfu")
    note = (
        f"eager (as the LM job runs); peak {PEAK_NAME}; N = dense parameters, "
        "token table not counted"
    )
    if compiled is not None:
        note += f"; with torch.compile: {compiled:.4f}"
    out["gpt_mfu"] = target("gpt_mfu", g.get("mfu"), g.get("error", note), compiled=compiled)
    c = parts.get("gpu_cache", {})
    best = c.get("targets_read")
    for name, per in (("gpu_cache_vs_local", "vs_local"), ("gpu_cache_vs_uncached", "vs_uncached")):
        v = c.get(name)
        why = c.get("error") or c.get("skipped") or "not measured"
        note = f"{best}: the faster cached variant" if v is not None else why
        out[name] = target(name, v, note, by_bounds=c.get(per))
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_GB"] = round(props.total_memory / 1e9, 1)
        info["sm"] = f"{props.major}.{props.minor}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"does not import: {error_text(e)[:100]}"
    return info


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, no compile (< 1 min)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run on a CPU")
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for the JSON files ($OUT)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=185.0,
        help="seconds for the whole run: the cache part and then the compiled GPT get what "
        "the other parts leave",
    )
    parser.add_argument(
        "--headline",
        action="store_true",
        help="only the headline figures (kernels' forward and row-wise Adagrad step, DLRM, "
        "eager GPT), to OUT/gpu_bench_headline.json",
    )
    parser.add_argument(
        "--after-headline",
        action="store_true",
        help="the rest (kernels with every optimizer, the cache part, the compiled GPT); the "
        "DLRM and GPT figures come from OUT/gpu_bench_headline.json when it has them",
    )
    parser.add_argument(
        "--part", choices=["all", "gpt-compiled"], default="all", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.quick and args.tiny:
        parser.error("--quick and --tiny: choose one")
    if args.headline and args.after_headline:
        parser.error("--headline and --after-headline: choose one (run one after the other)")
    if args.after_headline and not args.out:
        parser.error("--after-headline reads OUT/gpu_bench_headline.json: give --out (or $OUT)")
    return args


def headline_parts(out: Path, notes: list[str]) -> tuple[dict[str, dict[str, Any]], dict]:
    """The DLRM and GPT parts (and their config) of an earlier ``--headline`` run in
    ``out`` that measured them without an error; ``({}, {})`` without that file."""
    file = out / "gpu_bench_headline.json"
    if not file.is_file():
        notes.append(f"--after-headline: no {file}; the DLRM and GPT parts ran here")
        return {}, {}
    earlier = json.loads(file.read_text())
    parts = {}
    for name in ("dlrm", "gpt"):
        part = earlier["figures"].get(name, {})
        if part and "error" not in part and "skipped" not in part:
            parts[name] = part | {"measured_by": "--headline"}
    notes.extend(f"headline run: {n}" for n in earlier.get("notes", []))
    return parts, earlier.get("config", {})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    device = resolve_device(args.device)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.tiny and device.type == "cpu" and importlib.util.find_spec("triton") is not None:
        # A functional kernel run in Triton's interpreter, which triton reads when it is
        # imported and when a kernel is defined: set before either happens.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dshape, gshape = shapes(mode)
    cshape = cache_shape(mode)
    notes: list[str] = []
    machine = machine_info(device)  # before the parts: a broken CUDA context cannot say it

    if args.part == "gpt-compiled":  # the child of gpt_compiled_child
        result = gpt_part(device, gshape, True, notes)
        print(json.dumps(result | {"notes": notes}))
        return result

    out = Path(args.out) if args.out else None
    name = "gpu_bench_headline" if args.headline else "gpu_bench"
    report = Report(out, name)
    config_of: dict[str, Any] = {}
    if args.headline:
        dshape, gshape = headline_shapes(mode)
        report.run("kernels", lambda: headline_kernels_part(device, mode != "full"), device)
        report.run("dlrm", lambda: dlrm_part(device, dshape, notes, report.emit), device)
        report.run("gpt", lambda: gpt_part(device, gshape, False, notes), device)
        later = {"skipped": "--headline: measured by --after-headline"}
        report.parts["gpu_cache"] = dict(later)
        report.parts["gpt_compiled"] = dict(later)
    else:
        earlier, config_of = headline_parts(out, notes) if args.after_headline and out else ({}, {})
        report.run("kernels", lambda: kernels_part(device, mode != "full"), device)
        if "dlrm" in earlier:
            report.parts["dlrm"] = earlier["dlrm"]
        else:
            report.run("dlrm", lambda: dlrm_part(device, dshape, notes, report.emit), device)
        if "gpt" in earlier:
            report.parts["gpt"] = earlier["gpt"]
        else:
            report.run("gpt", lambda: gpt_part(device, gshape, False, notes), device)
        config_of = {k: v for k, v in config_of.items() if k in earlier}
        _cache_and_compiled_parts(args, mode, device, cshape, start, notes, report)
    _finish(args, mode, device, machine, dshape, gshape, cshape, start, notes, report, config_of)
    return report.result


def _cache_and_compiled_parts(
    args: argparse.Namespace,
    mode: str,
    device: torch.device,
    cshape: CacheShape,
    start: float,
    notes: list[str],
    report: Report,
) -> None:
    """The cache part and the compiled GPT, each in what ``--budget-s`` leaves."""
    left = args.budget_s - (time.perf_counter() - start) - 5
    if left < CACHE_MIN_S:
        report.parts["gpu_cache"] = {
            "skipped": f"{left:.0f} s left of --budget-s, < {CACHE_MIN_S} s"
        }
    else:
        report.run("gpu_cache", lambda: gpu_cache_part(device, cshape, left, notes), device)
    left = args.budget_s - (time.perf_counter() - start) - 5
    if mode != "full":
        report.parts["gpt_compiled"] = {"skipped": f"--{mode}: no torch.compile"}
    elif device.type != "cuda":
        report.parts["gpt_compiled"] = {"skipped": "torch.compile is measured on CUDA only"}
    elif left < 45:
        report.parts["gpt_compiled"] = {"skipped": f"{left:.0f} s left of --budget-s, < 45 s"}
    else:
        report.run("gpt_compiled", lambda: gpt_compiled_child(args, left), device)


def _finish(
    args: argparse.Namespace,
    mode: str,
    device: torch.device,
    machine: dict[str, Any],
    dshape: DLRMShape,
    gshape: GPTShape,
    cshape: CacheShape,
    start: float,
    notes: list[str],
    report: Report,
    config_of: dict[str, Any],
) -> None:
    """The final object (``report.result``): printed as the last line, written to
    ``<out>/<report.name>.json``. ``config_of``: the config of parts an earlier
    ``--headline`` run measured, by part."""
    parts = report.parts
    figures = {
        "kernels": parts["kernels"],
        "dlrm": parts["dlrm"],
        "dlrm_gpu_samples_s": {
            p: parts["dlrm"].get(p, {}).get("samples_s", {}).get("hybridrec")
            for p in ("fp32", "bf16")
        },
        "dlrm_torch_samples_s": {
            p: parts["dlrm"].get(p, {}).get("samples_s", {}).get("torch") for p in ("fp32", "bf16")
        },
        "gpt": parts["gpt"],
        "gpt_compiled": parts["gpt_compiled"],
        "gpt_tokens_s": parts["gpt"].get("tokens_s"),
        "gpt_mfu": parts["gpt"].get("mfu"),
        "gpu_cache": parts["gpu_cache"],
    }
    config = {
        "mode": mode,
        "timing": "CUDA events, median of windows after warm-up; variants alternate per window"
        if device.type == "cuda"
        else "host clock, median of windows after warm-up",
        "dlrm": dataclasses.asdict(dshape)
        | {
            "tables_optimizer": "hybridrec: row-wise Adagrad fused in backward; "
            "torch: Adagrad on sparse gradients",
            "dense_optimizer": "Adam (fused on CUDA)",
            "fp32_matmul": "fp32 (TF32 off)",
            "bf16": "torch.autocast(bfloat16); tables stay fp32",
            "table_init": "U(-sqrt(1/rows), sqrt(1/rows)): the tables' hashed init, on the device",
        },
        "gpt": dataclasses.asdict(gshape)
        | {
            "precision": "bf16 autocast, TF32 on",
            "attention": attention_used(),
            "token_table": "local on the device, lazy Adam",
            "dense_optimizer": "AdamW (fused on CUDA)",
            "mfu_flops_per_token": "6 N + 12 L d T, N = dense parameters (token table not counted)",
            "peak": PEAK_NAME,
        },
        "gpu_cache": dataclasses.asdict(cshape)
        | {
            "store": "ps.InProcessStore in host memory, initial rows hashed on the device",
            "variants": "local: tables in device memory (Triton, row-wise Adagrad fused); "
            "uncached: hybrid tables over the store, every unique row over PCIe each step; "
            "cached_rR_wW: hybrid behind cache.CachedStore(device=...) with read bound R, "
            "write bound W, group_tables",
            "training": "hybridrec DLRM, dense Adam, fp32 with TF32 off; one train_step of the "
            "DLRM job per step (the next batch's ids prefetched)",
            "targets": "the faster cached variant (named in figures.gpu_cache.targets_read)",
        },
        "budget_s": args.budget_s,
        "run": "headline" if args.headline else "after-headline" if args.after_headline else "all",
    }
    config |= config_of
    result = {
        "bench": "gpu",
        "machine": machine,
        "config": config,
        "figures": figures,
        "targets": targets_of(parts),
        "errors": report.errors,
        "notes": notes,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    line = json.dumps(result, default=str)
    if report.out is not None:
        (report.out / f"{report.name}.json").write_text(line + "\n")
    print(line, flush=True)
    report.result = result


if __name__ == "__main__":
    main()
