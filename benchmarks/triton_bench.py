"""Triton fused embedding kernels vs torch's embedding_bag (and FBGEMM's TBE) on one GPU.

One training step of the embedding part of a DLRM batch, all tables fused into one
flat weight ``[T * rows, D]`` (ids offset by table base), row-wise Adagrad:

* ``triton``: :func:`embedding.kernels.triton_pool.pooled_lookup` forward, then
  :func:`embedding.kernels.triton_adagrad.fused_backward_rowwise_adagrad_`
  (``validate=False``, as a hot loop calls them).
* ``torch``: ``F.embedding_bag`` (``sparse=True``) forward + autograd backward,
  then the same row-wise Adagrad on the coalesced sparse gradient with index ops.
* ``fbgemm``: ``SplitTableBatchedEmbeddingBagsCodegen`` with
  ``EXACT_ROWWISE_ADAGRAD`` (forward + backward, which fuses the update), when
  ``fbgemm_gpu`` imports; otherwise null with a note.

Per config (pooling factor L: every bag draws 0..2L ids, mean L; Zipf(1.05) ids per
table, popularity scattered over the rows), each implementation runs warm-up steps,
then ``repeats`` windows of ``iters`` steps, interleaved (triton, torch, fbgemm,
then the next window); a figure is the median window in ms per step, forward-only
and full step. Before timing, the Triton forward is checked against torch's.

Needs CUDA. Without a GPU it prints a JSON line with ``"skipped": "no GPU"``,
unless ``--interpret`` (with ``--quick``) asks for a tiny functional smoke run on
CPU in Triton's interpreter (times then mean nothing). Last line: one JSON object
(see benchmarks/README.md); no target is set for this benchmark, so the
ratios are figures and ``targets`` is empty.

    python benchmarks/triton_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LR, EPS = 0.01, 1e-8


@dataclass(kw_only=True, slots=True)
class Problem:
    """One batch: ids [N] (flat, offset by table base), local_ids [N], offsets [T*B + 1]."""

    tables: int
    rows: int
    dim: int
    batch: int
    ids: torch.Tensor
    local_ids: torch.Tensor
    offsets: torch.Tensor
    grad: torch.Tensor  # [T*B, D]


def make_problem(
    *, tables: int, rows: int, dim: int, batch: int, pooling: int, device: torch.device, seed: int
) -> Problem:
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05  # Zipf(1.05) by rank
    lengths = torch.randint(0, 2 * pooling + 1, (tables * batch,), generator=g)  # [T*B]
    local = []
    for t in range(tables):
        scatter = torch.randperm(rows, generator=g)  # popularity rank -> row
        n = int(lengths[t * batch : (t + 1) * batch].sum())
        local.append(scatter[torch.multinomial(probs, n, replacement=True, generator=g)])
    local_ids = torch.cat(local)  # [N]
    base = torch.repeat_interleave(torch.arange(tables) * rows, lengths.view(tables, batch).sum(1))
    offsets = torch.zeros(tables * batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    grad = torch.randn(tables * batch, dim, generator=g) / batch
    return Problem(
        tables=tables,
        rows=rows,
        dim=dim,
        batch=batch,
        ids=(local_ids + base).to(device),
        local_ids=local_ids.to(device),
        offsets=offsets.to(device),
        grad=grad.to(device),
    )


def triton_impl(p: Problem, weight: torch.Tensor) -> tuple[Callable[[], object], ...]:
    from embedding.kernels.triton_adagrad import fused_backward_rowwise_adagrad_
    from embedding.kernels.triton_pool import pooled_lookup

    w = weight.clone()
    state = torch.zeros(w.shape[0], device=w.device)

    def fwd() -> torch.Tensor:
        return pooled_lookup(w, p.ids, p.offsets, mode="sum", validate=False)

    def step() -> None:
        fwd()
        fused_backward_rowwise_adagrad_(
            w, state, p.ids, p.offsets, p.grad,
            mode="sum", per_sample_weights=None, lr=LR, eps=EPS, validate=False,
        )  # fmt: skip

    return fwd, step


def torch_impl(p: Problem, weight: torch.Tensor) -> tuple[Callable[[], object], ...]:
    w = weight.clone().requires_grad_(True)
    state = torch.zeros(w.shape[0], device=w.device)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return F.embedding_bag(p.ids, w, p.offsets, mode="sum", include_last_offset=True)

    def step() -> None:
        out = F.embedding_bag(
            p.ids, w, p.offsets, mode="sum", include_last_offset=True, sparse=True
        )
        out.backward(p.grad)
        assert w.grad is not None
        g = w.grad.coalesce()
        w.grad = None
        rows, vals = g.indices()[0], g.values()  # [U], [U, D]
        with torch.no_grad():
            acc = state[rows] + vals.square().mean(dim=1)
            state[rows] = acc
            w[rows] -= LR * (vals / (acc.sqrt() + EPS)[:, None])

    return fwd, step


def fbgemm_impl(p: Problem, weight: torch.Tensor) -> tuple[Callable[[], object], ...]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    except ImportError:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import PoolingMode

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (p.rows, p.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for _ in range(p.tables)
        ],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
    ).to(weight.device)
    # TBE output is [B, T*D] with table-local ids; its gradient has that layout too.
    grad = p.grad.view(p.tables, p.batch, p.dim).permute(1, 0, 2).reshape(p.batch, -1)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return tbe(indices=p.local_ids, offsets=p.offsets)

    def step() -> None:
        tbe(indices=p.local_ids, offsets=p.offsets).backward(grad)

    return fwd, step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    impls: dict[str, tuple[Callable[[], object], ...]],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    """Median ms per call of each impl's ``fwd`` and ``step``, windows interleaved."""
    times: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "step": []} for n in impls}
    for fns in impls.values():
        for fn in fns:
            for _ in range(warmup):
                fn()
    sync(device)
    names = list(impls)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            for kind, fn in zip(("fwd", "step"), impls[name], strict=True):
                sync(device)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync(device)
                times[name][kind].append((time.perf_counter() - t0) * 1e3 / iters)
    return {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run (interpreter)")
    args = parser.parse_args(argv)
    machine: dict[str, object] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    if args.quick:
        shape = {"tables": 8, "rows": 20_000, "dim": 64, "batch": 1024}
        poolings, warmup, iters, repeats = [1, 20], 3, 10, 3
    else:
        shape = {"tables": 26, "rows": 100_000, "dim": 64, "batch": 2048}
        poolings, warmup, iters, repeats = [1, 20], 10, 50, 5
    if args.interpret:
        if not args.quick:
            parser.error("--interpret needs --quick (the interpreter is slow)")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        shape = {"tables": 2, "rows": 100, "dim": 8, "batch": 8}
        poolings, warmup, iters, repeats = [2], 1, 1, 1
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        machine["gpu"] = torch.cuda.get_device_name(device)
    else:
        config = {**shape, "poolings": poolings}
        print(
            json.dumps(
                {
                    "bench": "triton",
                    "skipped": "no GPU",
                    "machine": machine,
                    "config": config,
                    "figures": {},
                    "targets": {},
                }
            )
        )
        return
    try:
        import triton

        machine["triton"] = triton.__version__
    except ImportError as e:
        raise SystemExit(f"triton_bench: triton does not import ({e}); pip install triton") from e
    fbgemm_note = ""
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as e:  # absent, or built for another torch
        fbgemm_note = f"fbgemm_gpu does not import: {type(e).__name__}: {e}"[:200]
    if device.type != "cuda":
        fbgemm_note = fbgemm_note or "fbgemm TBE benchmarked on CUDA only"

    figures: dict[str, dict[str, object]] = {}
    for pooling in poolings:
        p = make_problem(**shape, pooling=pooling, device=device, seed=pooling)
        weight = torch.randn(p.tables * p.rows, p.dim, device=device) * 0.01
        impls = {"triton": triton_impl(p, weight), "torch": torch_impl(p, weight)}
        ref = F.embedding_bag(p.ids, weight, p.offsets, mode="sum", include_last_offset=True)
        diff = float((impls["triton"][0]() - ref).abs().max())  # type: ignore[operator]
        if diff > 1e-4:
            raise SystemExit(f"triton_bench: triton forward differs from torch by {diff}")
        if not fbgemm_note:
            try:
                impls["fbgemm"] = fbgemm_impl(p, weight)
            except Exception as e:
                fbgemm_note = f"fbgemm TBE failed to build: {type(e).__name__}: {e}"[:200]
        ms = measure(impls, device, warmup=warmup, iters=iters, repeats=repeats)
        fb = ms.get("fbgemm")
        fig: dict[str, object] = {
            "ids": p.ids.numel(),
            "forward_max_abs_diff": diff,
            "ms_fwd": {n: round(v["fwd"], 4) for n, v in ms.items()},
            "ms_step": {n: round(v["step"], 4) for n, v in ms.items()},
            "triton_vs_torch_step": round(ms["torch"]["step"] / ms["triton"]["step"], 3),
            "triton_vs_torch_fwd": round(ms["torch"]["fwd"] / ms["triton"]["fwd"], 3),
            "triton_vs_fbgemm_step": round(fb["step"] / ms["triton"]["step"], 3) if fb else None,
        }
        figures[f"L{pooling}"] = fig
        print(f"pooling {pooling}: {json.dumps(fig)}", flush=True)
        del impls
    config = {**shape, "poolings": poolings, "warmup": warmup, "iters": iters}
    config |= {"repeats": repeats, "device": device.type, "optimizer": "rowwise_adagrad"}
    if fbgemm_note:
        config["fbgemm_note"] = fbgemm_note
    out = {"bench": "triton", "machine": machine, "config": config}
    print(json.dumps(out | {"figures": figures, "targets": {}}))


if __name__ == "__main__":
    main()
