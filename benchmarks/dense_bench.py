"""DataParallel step time vs torch DDP, ZeRO state per rank, bytes on the wire per codec.

    python benchmarks/dense_bench.py [--quick]

The script launches itself twice, 2 ranks each:

* 2 processes with torch.distributed env (gloo): torch's DistributedDataParallel,
  our ``dense.DataParallel`` on a ``comm`` TorchGroup over the same world, and our
  plain ``allreduce_gradients`` after backward (no overlap), timed side by side
  (blocks rotated A B C, B C A, ...); then ZeRO stage 2 optimizer-state bytes per
  rank vs unsharded AdamW, and each ``comm.compression`` codec's bytes on the wire;
* ``mpirun -n 2``: our DataParallel and ``allreduce_gradients`` on the MPI backend.

Models: the DLRM dense part (13 dense features, 26 pooled 64-wide embeddings as
random inputs, bottom 512-256-64, top 512-256-1, global batch 2048) and a small
GPT decoder (``dense.gpt``; the token embedding lives outside, so it is a random
input here). One torch thread per rank, SGD step, the same ``bucket_mb`` (25) for
DDP and ours, groups built with ``validate=False`` (as a training loop would).
Step = forward + backward + gradient sync + optimizer step; a block's time is the
max over ranks. The last line is one JSON object (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # this folder's helper modules
from _bench_util import interleaved, medians, paired_ratio, seconds_per_call  # noqa: E402

RESULT = "DENSE_BENCH_RESULT "
BUCKET_MB = 25.0
TARGETS = {"dp_vs_ddp_gloo": 0.9, "zero2_state_bytes_fraction": 0.55}


# ------------------------------------------------------------------ models


def dlrm_case(quick: bool, local_batch: int) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from dense import DLRMConfig, DLRMDense

    cfg = DLRMConfig(
        num_dense=13, num_sparse=26, embedding_dim=64, bottom_mlp=[512, 256, 64],
        top_mlp=[512, 256, 1],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(local_batch, 13, generator=gen)
    sparse = torch.randn(local_batch, 26, 64, generator=gen)
    labels = torch.randint(0, 2, (local_batch,), generator=gen).float()

    def loss(m: nn.Module) -> Any:
        return nn.functional.binary_cross_entropy_with_logits(m(dense, sparse), labels)

    torch.manual_seed(0)
    return DLRMDense(cfg), loss


def gpt_case(quick: bool, local_batch: int) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from dense.gpt import GPT, GPTConfig

    cfg = (
        GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
        if quick
        else GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=256)
    )
    gen = torch.Generator().manual_seed(2)
    tok = torch.randn(local_batch, cfg.block_size, cfg.d_model, generator=gen) * 0.02
    targets = torch.randint(0, cfg.vocab_size, (local_batch, cfg.block_size), generator=gen)

    def loss(m: nn.Module) -> Any:
        logits = m(tok)  # [B, T, V]
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    return GPT(cfg), loss


def cases(quick: bool, size: int) -> dict[str, tuple[nn.Module, Callable[[nn.Module], Any]]]:
    dlrm_batch = (512 if quick else 2048) // size
    gpt_batch = (4 if quick else 16) // size
    return {"dlrm": dlrm_case(quick, dlrm_batch), "gpt": gpt_case(quick, gpt_batch)}


# ------------------------------------------------------------------ timing


def block_time(group: Any, fn: Callable[[], None], iters: int) -> float:
    """Seconds per call over ``iters`` calls of ``fn`` after a barrier, max over ranks."""
    group.barrier()
    dt = torch.tensor([seconds_per_call(fn, iters)], dtype=torch.float64)
    group.allreduce(dt, op="max")
    return float(dt[0])


def measure(
    group: Any, impls: dict[str, Callable[[], None]], iters: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per step of each implementation, one entry per repeat, blocks rotated
    (A B C, B C A, ...), after a warm-up block of each."""
    timer = functools.partial(block_time, group)
    return interleaved(impls, repeats, calls=iters, warmup=max(1, iters // 2), timer=timer)


def step_fn(
    model: nn.Module, loss_fn: Callable[[nn.Module], Any], after: Callable[[], None]
) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss_fn(model).backward()
        after()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


# ------------------------------------------------------------------ workers


def worker(kind: str, quick: bool) -> None:
    torch.set_num_threads(1)
    import comm
    from dense import DataParallel, ZeroOptimizer, allreduce_gradients

    group = comm.init(kind, timeout_s=600.0, validate=False)
    iters, repeats = (2, 3) if quick else (5, 7)
    out: dict[str, Any] = {"step_ms": {}, "ratio": {}}
    for name, (model, loss_fn) in cases(quick, group.size).items():
        impls: dict[str, Callable[[], None]] = {}
        ours_model = copy.deepcopy(model)
        dp = DataParallel(ours_model, group, bucket_mb=BUCKET_MB)
        impls["ours"] = step_fn(dp, loss_fn, dp.finish)
        flat_model = copy.deepcopy(model)

        def sync_flat(fm: nn.Module = flat_model) -> None:
            allreduce_gradients(fm, group)

        impls["flat"] = step_fn(flat_model, loss_fn, sync_flat)
        if kind == "gloo":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(copy.deepcopy(model), bucket_cap_mb=BUCKET_MB)
            impls["ddp"] = step_fn(ddp, loss_fn, lambda: None)
        times = measure(group, impls, iters, repeats)
        out["step_ms"][name] = {k: 1e3 * v for k, v in medians(times).items()}
        out["ratio"][name] = {"flat_vs_ours": paired_ratio(times["flat"], times["ours"])}
        if kind == "gloo":
            out["ratio"][name]["ddp_vs_ours"] = paired_ratio(times["ddp"], times["ours"])
        out.setdefault("buckets", {})[name] = len(dp.buckets)
        out.setdefault("params", {})[name] = sum(p.numel() for p in model.parameters())
        if group.rank == 0:
            print(f"[{kind}] {name}: {out['step_ms'][name]}", file=sys.stderr, flush=True)
    if kind == "gloo":
        out["zero"] = zero_bytes(group, quick, ZeroOptimizer)
        out["codecs"] = codec_bytes(group, quick, DataParallel)
    group.close()
    if group.rank == 0:
        print(RESULT + json.dumps(out), flush=True)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def zero_bytes(group: Any, quick: bool, zero_cls: Any) -> dict[str, Any]:
    """Per-rank AdamW state under ZeRO stage 2 vs unsharded, per model (max over ranks)."""
    res = {}
    for name, (model, loss_fn) in cases(quick, group.size).items():
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        loss_fn(ref).backward()
        ref_opt.step()
        zmodel = copy.deepcopy(model)
        zopt = zero_cls(torch.optim.AdamW, zmodel.parameters(), group, stage=2, lr=1e-3)
        loss_fn(zmodel).backward()
        zopt.step()
        mine = torch.tensor([zopt.state_bytes()], dtype=torch.float64)
        group.allreduce(mine, op="max")
        full = state_bytes(ref_opt)
        res[name] = {
            "unsharded_bytes": full,
            "zero2_bytes_per_rank_max": int(mine[0]),
            "fraction": float(mine[0]) / full,
        }
    return res


def codec_bytes(group: Any, quick: bool, dp_cls: Any) -> dict[str, Any]:
    """Bytes one rank sends per step for the DLRM gradients through each codec."""
    try:
        from comm.compression import CODECS
    except ImportError:
        return {"note": "comm.compression not present"}
    model, loss_fn = cases(quick, group.size)["dlrm"]
    steps = 2 if quick else 5
    res = {}
    for codec in CODECS:
        dp = dp_cls(copy.deepcopy(model), group, bucket_mb=BUCKET_MB, compression=codec)
        step = step_fn(dp, loss_fn, dp.finish)
        step()  # warm-up (and error-feedback state)
        before = dict(dp.codec.stats)
        t = block_time(group, step, steps)
        after = dp.codec.stats
        wire = (after["bytes_on_wire"] - before["bytes_on_wire"]) / steps
        raw = (after["bytes_in"] - before["bytes_in"]) / steps
        res[codec] = {"bytes_on_wire_per_step": wire, "ratio_vs_fp32": wire / raw,
                      "step_ms": 1e3 * t}  # fmt: skip
    return res


# ------------------------------------------------------------------ launcher


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _result(text: str, what: str) -> dict[str, Any]:
    for line in text.splitlines():
        if line.startswith(RESULT):
            found: dict[str, Any] = json.loads(line[len(RESULT) :])
            return found
    raise RuntimeError(f"{what}: no result line in its output:\n{text}")


def run_gloo(quick: bool, timeout: float) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "gloo"] + (["--quick"] if quick else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo workers failed: {[p.returncode for p in procs]}\n{outs}")
    return _result(outs[0], "gloo rank 0")


def run_mpi(quick: bool, timeout: float) -> dict[str, Any]:
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", "2", sys.executable, __file__]
    cmd += ["--worker", "mpi"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, text=True, timeout=timeout,
                         check=False)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"mpirun workers failed ({out.returncode}):\n{out.stdout}")
    return _result(out.stdout, "mpi rank 0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    ap.add_argument("--worker", choices=["gloo", "mpi"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.quick)
        return
    timeout = 300.0 if args.quick else 1800.0
    gloo = run_gloo(args.quick, timeout)
    mpi = run_mpi(args.quick, timeout)
    dp_vs_ddp = min(r["ddp_vs_ours"] for r in gloo["ratio"].values())
    zero_frac = max(z["fraction"] for z in gloo["zero"].values())
    mpi_vs_ddp = {m: gloo["step_ms"][m]["ddp"] / mpi["step_ms"][m]["ours"] for m in mpi["step_ms"]}
    for m in gloo["step_ms"]:
        print(f"{m}: gloo {gloo['step_ms'][m]}  mpi {mpi['step_ms'][m]}", file=sys.stderr)
    report = {
        "bench": "dense",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "gloo+mpi"},
        "config": {
            "ranks": 2,
            "quick": args.quick,
            "bucket_mb": BUCKET_MB,
            "torch_threads": 1,
            "iters_x_repeats": [2, 3] if args.quick else [5, 7],
            "dlrm": "13 dense, 26x64 sparse inputs, bottom 512-256-64, top 512-256-1, "
            + ("global batch 512" if args.quick else "global batch 2048"),
            "gpt": "n_layer 2, d 128, T 64, global batch 4"
            if args.quick
            else "n_layer 4, d 256, T 128, global batch 16",
            "optimizer": "SGD (step time), AdamW (ZeRO state)",
            "ratios": "median over repeats of the pair's time ratio, measured back to back",
            "mpi_vs_ddp_gloo": "DDP (gloo run) / ours (mpi run): separate runs",
        },  # fmt: skip
        "figures": {
            "gloo": gloo,
            "mpi": {k: v for k, v in mpi.items()},
            "mpi_ours_vs_ddp_gloo": mpi_vs_ddp,
        },  # fmt: skip
        "targets": {
            "dp_vs_ddp_gloo": {
                "value": dp_vs_ddp,
                "target": TARGETS["dp_vs_ddp_gloo"],
                "met": bool(dp_vs_ddp >= TARGETS["dp_vs_ddp_gloo"]),
                "note": "min over the DLRM and GPT models",
            },
            "zero2_state_bytes_fraction": {
                "value": zero_frac,
                "target": TARGETS["zero2_state_bytes_fraction"],
                "met": bool(zero_frac <= TARGETS["zero2_state_bytes_fraction"]),
                "note": "AdamW, 2 ranks, max over ranks and models",
            },
        },  # fmt: skip
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
