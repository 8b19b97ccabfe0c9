"""Triton fused embedding kernels vs torch (and FBGEMM's TBE) on one GPU.

The embedding part of a DLRM batch, all tables fused into one flat weight
``[T * rows, D]`` (ids offset by table base), at pooling 1 and 20:

* forward: :func:`embedding.kernels.triton_pool.pooled_lookup` (autotuned tile)
  vs ``F.embedding_bag`` (and TBE's forward when ``fbgemm_gpu`` imports);
* one training step per ps optimizer (row-wise Adagrad, SGD, SGD with momentum,
  Adagrad, Adam, FTRL): the Triton forward + fused backward/update
  (:func:`embedding.kernels.triton_optimizers.fused_backward_`) vs torch:
  ``F.embedding_bag(sparse=True)`` + autograd, the sparse gradient coalesced, the
  ps optimizer's ``apply`` on the gathered rows and state, scattered back (the path
  hybridrec takes on a GPU without triton; row-wise Adagrad in place with index
  ops, as before). Each step is checked against torch's once before timing;
* ``fwd_bandwidth_fraction``: at pooling 20, bytes of rows read by the Triton
  forward (ids x D x element size) per second, over the device-to-device copy
  bandwidth measured in the same run (``dst.copy_(src)`` of a large buffer,
  counting its read and its write).

Every figure is the median of ``repeats`` windows of ``iters`` calls, the
implementations interleaved (A B A B ...), after warm-up; ``host_ms`` is the time
to enqueue one call (when it is close to ``ms``, the call is launch-bound).

:func:`run_kernels` is the entry point for other benchmarks; ``main`` prints the
JSON line (benchmarks/README.md). Without a GPU the script prints
``"skipped": "no GPU"``, unless ``--quick --interpret`` asks for a tiny functional
smoke run in Triton's CPU interpreter (its times mean nothing).

    python benchmarks/triton_bench.py [--quick] [--interpret]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ps.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
from _bench_util import interleaved, seconds_per_call  # noqa: E402

LR, EPS = 0.01, 1e-8

#: The optimizers timed, one step each (the headline is row-wise Adagrad).
OPTIMIZERS: dict[str, Optimizer] = {
    "rowwise_adagrad": RowWiseAdagrad(lr=LR, eps=EPS),
    "sgd": SGD(lr=LR),
    "sgd_momentum": SGD(lr=LR, momentum=0.9),
    "adagrad": Adagrad(lr=LR),
    "adam": Adam(lr=LR),
    "ftrl": FTRL(alpha=0.05, l1=1e-4, l2=1e-4),
}

#: Targets the issue names (benchmarks/README.md ``targets``).
TARGETS = {"triton_fwd_vs_torch_min": 1.0, "triton_step_vs_torch_min": 2.0}
TARGETS["fwd_bandwidth_fraction"] = 0.6


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
    """Bags of 0..2*pooling ids (mean ``pooling``), Zipf(1.05) ids per table, popularity
    scattered over the rows by a seeded permutation."""
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


def initial_state(opt: Optimizer, rows: int, dim: int, device: torch.device) -> torch.Tensor:
    """``[rows, S]`` float32: every row starts at ``opt.initial_state(dim)``."""
    return opt.initial_state(dim).to(device).expand(rows, -1).contiguous()


# --- implementations: (weight, state) -> callable -------------------------------------


def triton_fwd(p: Problem, weight: torch.Tensor) -> Callable[[], object]:
    from embedding.kernels.triton_pool import pooled_lookup

    return lambda: pooled_lookup(weight, p.ids, p.offsets, mode="sum", validate=False)


def triton_step(
    p: Problem, weight: torch.Tensor, state: torch.Tensor, opt: Optimizer
) -> Callable[[], None]:
    from embedding.kernels.triton_optimizers import fused_backward_
    from embedding.kernels.triton_pool import pooled_lookup

    def step() -> None:
        pooled_lookup(weight, p.ids, p.offsets, mode="sum", validate=False)
        fused_backward_(
            weight, state, p.ids, p.offsets, p.grad, opt,
            mode="sum", per_sample_weights=None, validate=False,
        )  # fmt: skip

    return step


def torch_fwd(p: Problem, weight: torch.Tensor) -> Callable[[], object]:
    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return F.embedding_bag(p.ids, weight, p.offsets, mode="sum", include_last_offset=True)

    return fwd


def torch_step(
    p: Problem, weight: torch.Tensor, state: torch.Tensor, opt: Optimizer
) -> Callable[[], None]:
    """Sparse autograd gradient, coalesced; the optimizer on the touched rows."""
    w = weight.requires_grad_(True)

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
            if isinstance(opt, RowWiseAdagrad):  # in place, no [U, D] gather/scatter
                acc = state[rows, 0] + vals.square().mean(dim=1)
                state[rows, 0] = acc
                w[rows] -= opt.lr * (vals / (acc.sqrt() + opt.eps)[:, None])
                return
            wr, sr = w.index_select(0, rows), state.index_select(0, rows)
            opt.apply(wr, sr, vals)
            w.index_copy_(0, rows, wr)
            if sr.shape[1]:
                state.index_copy_(0, rows, sr)

    return step


def fbgemm_impls(p: Problem, weight: torch.Tensor) -> dict[str, Callable[[], object]]:
    """TBE forward and forward+backward (fused row-wise Adagrad), when fbgemm_gpu imports."""
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

    return {"fwd": fwd, "step": step}


# --- timing ----------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    """``{name: {"ms", "host_ms"}}``: median ms per call (device done) and to enqueue one,
    over ``repeats`` windows of ``iters`` calls, the functions interleaved (A B C, C B A, ...)
    after a warm-up block of ``warmup`` calls each."""

    def device_and_host_ms(fn: Callable[[], object], calls: int) -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        return (t2 - t0) * 1e3 / calls, (t1 - t0) * 1e3 / calls

    times = interleaved(
        fns, repeats, calls=iters, warmup=warmup, order="alternate", timer=device_and_host_ms
    )
    return {
        n: {
            "ms": round(statistics.median(t[0] for t in ts), 5),
            "host_ms": round(statistics.median(t[1] for t in ts), 5),
        }
        for n, ts in times.items()
    }


def copy_bandwidth_gbps(device: torch.device, nbytes: int, *, repeats: int) -> float:
    """Device-to-device copy bandwidth, GB/s, counting the read and the write: the median
    of ``repeats`` timed ``dst.copy_(src)`` of ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = interleaved(
        {"copy": lambda: dst.copy_(src)},
        repeats,
        calls=5,
        warmup=3,
        timer=lambda fn, calls: seconds_per_call(fn, calls, sync=lambda: sync(device)),
    )
    return 2 * src.numel() * 4 / statistics.median(times["copy"]) / 1e9


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


# --- the run ---------------------------------------------------------------------------


def sizes(quick: bool, interpret: bool) -> dict[str, Any]:
    """Shapes and repetition counts of a run."""
    if interpret:
        # Two optimizers (a per-row and an element-wise state) keep the smoke run short.
        shape = {"tables": 2, "rows": 64, "dim": 8, "batch": 4}
        return {"shape": shape, "poolings": [1, 4], "warmup": 0, "iters": 1, "repeats": 1,
                "optimizers": ["rowwise_adagrad", "adam"]}  # fmt: skip
    if quick:
        shape = {"tables": 8, "rows": 20_000, "dim": 64, "batch": 1024}
        return {"shape": shape, "poolings": [1, 20], "warmup": 3, "iters": 10, "repeats": 3,
                "optimizers": list(OPTIMIZERS)}  # fmt: skip
    shape = {"tables": 26, "rows": 100_000, "dim": 64, "batch": 2048}
    return {"shape": shape, "poolings": [1, 20], "warmup": 10, "iters": 50, "repeats": 5,
            "optimizers": list(OPTIMIZERS)}  # fmt: skip


def run_kernels(
    device: torch.device | str = "cuda", quick: bool = False, *, interpret: bool = False
) -> dict[str, Any]:
    """Measure the Triton kernels against torch on ``device``; a JSON-ready dict:

    - ``triton_fwd_vs_torch_min``: torch forward ms / Triton forward ms, the worse of
      the two poolings (> 1: Triton faster);
    - ``triton_step_vs_torch_min``: the same for one row-wise Adagrad training step;
    - ``fwd_bandwidth_fraction``: Triton forward rows-read bandwidth at the larger
      pooling over ``copy_gbps`` (device-to-device copy, read + write);
    - ``copy_gbps``, ``fwd_rows_gbps``;
    - ``step_vs_torch``: ``{optimizer: {"L1": ratio, "L20": ratio}}`` for every
      optimizer of :data:`OPTIMIZERS` (row-wise Adagrad and Adam only when interpreted);
    - ``cases``: per pooling ``"L<p>"``: ids, forward/step ms and host ms of each
      implementation, correctness diffs;
    - ``config`` (shapes, repetitions, device, notes) and ``tuned`` (forward configs
      the autotuner picked).

    ``interpret=True`` (CPU, tiny shapes) runs the kernels in Triton's interpreter: a
    functional smoke run whose times mean nothing. It must be asked for before this
    process imports triton (Triton reads ``TRITON_INTERPRET`` when it defines kernels).
    """
    device = torch.device(device)
    if interpret:
        if device.type != "cpu":
            raise ValueError(f"run_kernels: interpret=True runs on cpu, got device {device}")
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "run_kernels: interpret=True after triton was imported without "
                "TRITON_INTERPRET=1; set it before the first import of triton"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    elif device.type != "cuda":
        raise ValueError(f"run_kernels: needs a CUDA device (or interpret=True), got {device}")
    import triton

    from embedding.kernels.triton_pool import tuned_configs

    plan = sizes(quick, interpret)
    shape, poolings = plan["shape"], plan["poolings"]
    reps = {k: plan[k] for k in ("warmup", "iters", "repeats")}
    notes: list[str] = []
    fbgemm_ok = False
    if device.type == "cuda":
        try:
            import fbgemm_gpu  # noqa: F401

            fbgemm_ok = True
        except Exception as e:  # absent, or built for another torch
            notes.append(f"fbgemm_gpu does not import: {type(e).__name__}: {e}"[:200])

    copy_gbps = copy_bandwidth_gbps(
        device, (1 << 20) if interpret else (256 << 20 if quick else 1 << 30), repeats=5
    )
    cases: dict[str, dict[str, Any]] = {}
    step_ratio: dict[str, dict[str, float]] = {name: {} for name in plan["optimizers"]}
    fwd_ratio: dict[str, float] = {}
    rows_gbps = 0.0
    for pooling in poolings:
        tag = f"L{pooling}"
        p = make_problem(**shape, pooling=pooling, device=device, seed=pooling)
        weight = torch.randn(p.tables * p.rows, p.dim, device=device) * 0.01
        ref = F.embedding_bag(p.ids, weight, p.offsets, mode="sum", include_last_offset=True)
        fwd_fns = {"triton": triton_fwd(p, weight), "torch": torch_fwd(p, weight)}
        fwd_diff = max_diff(fwd_fns["triton"](), ref)  # type: ignore[arg-type]
        if fwd_diff > 1e-4:
            raise RuntimeError(f"run_kernels: triton forward differs from torch by {fwd_diff}")
        if fbgemm_ok:
            try:
                fb = fbgemm_impls(p, weight)
                fwd_fns["fbgemm"] = fb["fwd"]
            except Exception as e:
                fbgemm_ok = False
                notes.append(f"fbgemm TBE failed to build: {type(e).__name__}: {e}"[:200])
        fwd = measure(fwd_fns, device, **reps)
        fwd_ratio[tag] = fwd["torch"]["ms"] / fwd["triton"]["ms"]
        row_bytes = p.ids.numel() * p.dim * weight.element_size()
        rows_gbps = row_bytes / (fwd["triton"]["ms"] * 1e-3) / 1e9
        case: dict[str, Any] = {
            "ids": p.ids.numel(),
            "forward_max_abs_diff": fwd_diff,
            "fwd": fwd,
            "triton_vs_torch_fwd": round(fwd_ratio[tag], 3),
            "fwd_rows_gbps": round(rows_gbps, 1),
            "step": {},
        }
        for name in plan["optimizers"]:
            opt = OPTIMIZERS[name]
            w_t, w_ref = weight.clone(), weight.clone()
            s_t = initial_state(opt, w_t.shape[0], p.dim, device)
            s_ref = s_t.clone()
            steps: dict[str, Callable[[], object]] = {
                "triton": triton_step(p, w_t, s_t, opt),
                "torch": torch_step(p, w_ref, s_ref, opt),
            }
            for fn in steps.values():  # one checked step from the same start
                fn()
            diff = max(max_diff(w_t, w_ref), max_diff(s_t, s_ref))
            if diff > 1e-4:
                raise RuntimeError(f"run_kernels: {name} step differs from torch by {diff}")
            if name == "rowwise_adagrad" and fbgemm_ok:
                steps["fbgemm"] = fb["step"]
            ms = measure(steps, device, **reps)
            step_ratio[name][tag] = ms["torch"]["ms"] / ms["triton"]["ms"]
            case["step"][name] = ms | {
                "max_abs_diff_first_step": diff,
                "triton_vs_torch": round(step_ratio[name][tag], 3),
            }
            del steps, w_t, w_ref, s_t, s_ref
        cases[tag] = case
        print(f"pooling {pooling}: {json.dumps(case)}", file=sys.stderr, flush=True)
        del p, weight, ref, fwd_fns
    return {
        "triton_fwd_vs_torch_min": round(min(fwd_ratio.values()), 3),
        "triton_step_vs_torch_min": round(min(step_ratio["rowwise_adagrad"].values()), 3),
        "fwd_bandwidth_fraction": round(rows_gbps / copy_gbps, 3),
        "copy_gbps": round(copy_gbps, 1),
        "fwd_rows_gbps": round(rows_gbps, 1),
        "step_vs_torch": {n: {k: round(v, 3) for k, v in r.items()} for n, r in step_ratio.items()},
        "cases": cases,
        "config": {
            **shape,
            "poolings": poolings,
            "optimizers": plan["optimizers"],
            **reps,
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "interpret": interpret,
            "triton": triton.__version__,
            "bandwidth_pooling": poolings[-1],
            "notes": notes,
        },
        "tuned": tuned_configs(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run (interpreter)")
    args = parser.parse_args(argv)
    machine: dict[str, object] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    if args.interpret and not args.quick:
        parser.error("--interpret needs --quick (the interpreter is slow)")
    if not args.interpret and not torch.cuda.is_available():
        plan = sizes(args.quick, False)
        out = {"bench": "triton", "skipped": "no GPU", "machine": machine}
        print(json.dumps(out | {"config": plan, "figures": {}, "targets": {}}))
        return
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"triton_bench: triton does not import ({e}); pip install triton") from e
    device = torch.device("cpu" if args.interpret else "cuda")
    res = run_kernels(device, args.quick, interpret=args.interpret)
    config = res.pop("config")
    targets = {}
    if not args.interpret:  # interpreter times mean nothing
        for name, target in TARGETS.items():
            value = res[name]
            targets[name] = {"value": value, "target": target, "met": value >= target}
    print(json.dumps({"bench": "triton", "machine": machine, "config": config,
                      "figures": res, "targets": targets}))  # fmt: skip


if __name__ == "__main__":
    main()
