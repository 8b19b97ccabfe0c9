"""The transformer parallel core side by side: DP, TP, PP (1F1B, bidirectional), ZeRO-3.

    python benchmarks/parallel_bench.py [--quick] [--ranks 4] [--steps 6]

Re-launches itself under ``mpirun -n 4`` (``--ranks``); every variant trains the same
``dense.GPT`` (4 layers x 256, 8 heads, vocab 256, T 64; ``--quick``: 4 x 64) from the
same init on the same global batch of 16 windows (random token vectors ``[16, 64, 256]``
standing in for an embedding's output), AdamW, one torch thread per rank:

* ``dp``: ``dense.DataParallel`` over the 4 ranks, 4 windows each;
* ``tp``: ``dense.apply_tensor_parallel`` over the 4 ranks, the whole batch on each;
* ``pp_1f1b`` / ``pp_bidirectional``: ``dense.Pipeline`` over 4 stages, 8 micro-batches;
* ``zero3``: ``dense.Zero3`` over the 4 ranks, 4 windows each.

Figures (medians over the measured steps after one warm-up step):

* ``step_ms`` per variant (no target on this 2-core machine: 4 ranks share 2 cores);
* ``zero3_param_bytes_fraction``: ZeRO-3's per-rank parameter + gradient + optimizer
  bytes over the unsharded ones (``Zero3.memory_bytes() / unsharded_bytes()``);
  target <= 1/N + 0.05;
* ``pp_bubble``: the mean over ranks of the pipeline's idle fraction (step time not in
  stage compute, ``Pipeline.last_stats``) for 1F1B and bidirectional, and
  ``pp_bubble_vs_theory`` = 1F1B's over (p - 1)/(m + p - 1); target within 0.8-1.25, and
  the bidirectional bubble below 1F1B's;
  The same bubbles on 2 stages (ranks 0 and 1, no more ranks than this machine's cores)
  are reported beside them (``pp2_bubble``).
* ``tp_comm_bytes_vs_theory``: the bytes handed to the tp group's allreduces in one step
  (counted at the group, not by the layers), over the analytic count: 2 allreduces of
  B*T*d per block per pass (4 * n_layer * B*T*d elements per step), plus the head's input
  gradient (B*T*d) and the vocabulary-parallel loss's max, sum-exp and target logit
  (3*B*T); target within 5 %. ``tp_block_bytes_vs_theory`` is the blocks' share (the
  layers' own counters) over the blocks' term alone.

The last line is one JSON object (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's helper modules
from _bench_util import interleaved, seconds_per_call  # noqa: E402

BATCH, SEQ, MICRO = 16, 64, 8


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def gpt_config(quick: bool) -> Any:
    from dense import GPTConfig

    d, layers = (64, 4) if quick else (256, 4)
    return GPTConfig(vocab_size=256, block_size=SEQ, n_layer=layers, n_head=8, d_model=d)


def fresh_gpt(quick: bool) -> Any:
    from dense import GPT

    torch.manual_seed(0)
    return GPT(gpt_config(quick))


def data(quick: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    d = gpt_config(quick).d_model
    x = torch.randn(BATCH, SEQ, d, generator=g)  # [B, T, D]: an embedding's output
    y = torch.randint(0, 256, (BATCH, SEQ), generator=g)  # [B, T]
    return x, y


def timed(group: Any, steps: int, one: Callable[[], None]) -> list[float]:
    """Seconds of each measured step (one warm-up first), every rank in step: a barrier
    before the step and one before its clock stops."""
    times = interleaved(
        {"step": one},
        steps,
        warmup=1,
        timer=lambda fn, calls: seconds_per_call(fn, calls, sync=group.barrier),
    )
    return times["step"]


class ByteCounter:
    """Counts the payload of every allreduce issued on ``group``: wraps the instance's
    ``allreduce_async``, which the synchronous ``allreduce`` goes through too."""

    def __init__(self, group: Any) -> None:
        self.bytes = 0
        issue = group.allreduce_async

        def allreduce_async(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
            self.bytes += t.numel() * t.element_size()
            return issue(t, *a, **kw)

        group.allreduce_async = allreduce_async


def pipeline_run(
    world: Any, schedule: str, quick: bool, steps: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """Median ms per step of a pipeline over the world, and its bubble (the mean over
    ranks of each rank's median idle fraction)."""
    from dense import Pipeline, stages_for_rank

    n, r = world.size, world.rank
    pipe = Pipeline(stages_for_rank(fresh_gpt(quick), world, schedule), world, MICRO, schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    first = r == 0 or (schedule == "bidirectional" and r == n - 1)
    last = r == n - 1 or (schedule == "bidirectional" and r == 0)
    stats: list[float] = []

    def step() -> None:
        opt.zero_grad()
        pipe.step(x if first else None, y if last else None)
        opt.step()
        stats.append(pipe.last_stats.bubble)

    ms = 1e3 * statistics.median(timed(world, steps, step))
    mean = torch.tensor([statistics.median(stats[1:])], dtype=torch.float64)
    bubble = float(world.allreduce(mean, op="avg")[0])
    pipe.close()
    return ms, bubble


def ranks_part(quick: bool, steps: int) -> None:
    """Under mpirun: every variant in turn; rank 0 prints the JSON line."""
    import comm
    from dense import DataParallel, Zero3, apply_tensor_parallel, gpt_loss, tp_gpt_loss

    torch.set_num_threads(1)
    world = comm.init("mpi", timeout_s=600.0)
    n, r = world.size, world.rank
    x, y = data(quick)
    b = BATCH // n
    mine = slice(r * b, (r + 1) * b)
    fig: dict[str, Any] = {"step_ms": {}}
    cfg = gpt_config(quick)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    # data parallel
    gpt = fresh_gpt(quick)
    dp = DataParallel(gpt, world)
    opt = adamw(gpt.parameters())

    def dp_step() -> None:
        opt.zero_grad()
        gpt_loss(dp(x[mine]), y[mine]).backward()
        dp.finish()
        opt.step()

    fig["step_ms"]["dp"] = 1e3 * statistics.median(timed(world, steps, dp_step))

    # tensor parallel: its own sub-group object so that only its allreduces are counted
    tp_group = world.split(0)
    tp_group.validate = False  # count the payload only, not the argument checks
    counter = ByteCounter(tp_group)
    gpt = apply_tensor_parallel(fresh_gpt(quick), tp_group)
    opt = adamw(gpt.parameters())

    def tp_step() -> None:
        opt.zero_grad()
        tp_gpt_loss(gpt(x), y, tp_group).backward()
        opt.step()

    fig["step_ms"]["tp"] = 1e3 * statistics.median(timed(world, steps, tp_step))
    counted = counter.bytes / (steps + 1)
    bt, d4 = BATCH * SEQ, 4  # tokens per step; float32 bytes
    blocks = 4 * cfg.n_layer * bt * cfg.d_model * d4  # 2 allreduces per block per pass
    analytic = blocks + bt * cfg.d_model * d4 + 3 * bt * d4  # + the head, + the loss
    from dense import tp_stats

    layer_blocks = tp_stats(gpt).bytes_of("attn", "mlp") / (steps + 1)
    fig["tp_bytes_per_step"] = {
        "counted_at_group": counted,
        "analytic": analytic,
        "blocks_by_layers": layer_blocks,
        "blocks_analytic": blocks,
    }

    # pipelines
    bubbles: dict[str, float] = {}
    for schedule in ("1f1b", "bidirectional"):
        ms, bubbles[schedule] = pipeline_run(world, schedule, quick, steps, x, y)
        fig["step_ms"][f"pp_{schedule}"] = ms
    fig["pp_bubble"] = bubbles
    fig["pp_bubble_theory_1f1b"] = (n - 1) / (MICRO + n - 1)
    # The same on 2 stages (ranks 0 and 1; the others wait): no more ranks than cores here.
    pair = world.split(0 if r < 2 else 1)
    if r < 2 and n >= 2:
        fig["pp2_bubble"] = {
            schedule: pipeline_run(pair, schedule, quick, steps, x, y)[1]
            for schedule in ("1f1b", "bidirectional")
        }
        fig["pp2_bubble_theory_1f1b"] = 1 / (MICRO + 1)
    world.barrier()

    # ZeRO-3
    gpt = fresh_gpt(quick)
    z3 = Zero3(gpt, world, torch.optim.AdamW, lr=1e-3)

    def z3_step() -> None:
        z3.zero_grad()
        gpt_loss(gpt(x[mine]), y[mine]).backward()
        z3.step()

    fig["step_ms"]["zero3"] = 1e3 * statistics.median(timed(world, steps, z3_step))
    fig["zero3_bytes"] = {
        "per_rank": z3.memory_bytes(),
        "unsharded": z3.unsharded_bytes(),
        "peak_per_rank": z3.peak_memory_bytes(),
    }
    world.barrier()
    if r == 0:
        print(json.dumps({"figures": fig, "ranks": n}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a GPT of 4 x 64, 2 measured steps")
    p.add_argument("--ranks", type=int, default=4, help="ranks under mpirun")
    p.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    p.add_argument("--ranks-part", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    steps = 2 if args.quick else args.steps
    if args.ranks_part:
        ranks_part(args.quick, steps)
        return
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [
        str(mpirun if mpirun.exists() else "mpirun"),
        "-n",
        str(args.ranks),
        sys.executable,
        __file__,
        "--ranks-part",
        "--steps",
        str(steps),
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ranks failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    fig, n = got["figures"], got["ranks"]
    tp = fig["tp_bytes_per_step"]
    fig["tp_comm_bytes_vs_theory"] = tp["counted_at_group"] / tp["analytic"]
    fig["tp_block_bytes_vs_theory"] = tp["blocks_by_layers"] / tp["blocks_analytic"]
    z = fig["zero3_bytes"]
    fig["zero3_param_bytes_fraction"] = z["per_rank"] / z["unsharded"]
    bub = fig["pp_bubble"]
    fig["pp_bubble_vs_theory"] = bub["1f1b"] / fig["pp_bubble_theory_1f1b"]
    for name, ms in fig["step_ms"].items():
        _say(f"{name:18s} {ms:8.1f} ms/step")
    _say(
        f"1F1B bubble {bub['1f1b']:.3f} (theory {fig['pp_bubble_theory_1f1b']:.3f}), "
        f"bidirectional {bub['bidirectional']:.3f}; on 2 stages 1F1B "
        f"{fig['pp2_bubble']['1f1b']:.3f} "
        f"(theory {fig['pp2_bubble_theory_1f1b']:.3f}), bidirectional "
        f"{fig['pp2_bubble']['bidirectional']:.3f}; ZeRO-3 bytes per rank "
        f"{fig['zero3_param_bytes_fraction']:.3f} of unsharded; TP bytes / analytic "
        f"{fig['tp_comm_bytes_vs_theory']:.4f} (blocks alone {fig['tp_block_bytes_vs_theory']:.4f})"
    )
    zf, ratio = fig["zero3_param_bytes_fraction"], fig["pp_bubble_vs_theory"]
    tpr = fig["tp_comm_bytes_vs_theory"]
    targets = {
        "zero3_param_bytes_fraction": {
            "value": zf,
            "target": 1 / n + 0.05,
            "met": zf <= 1 / n + 0.05,
        },
        "pp_bubble_vs_theory": {"value": ratio, "target": [0.8, 1.25], "met": 0.8 <= ratio <= 1.25},
        "pp_bidirectional_below_1f1b": {
            "value": bub["bidirectional"],
            "target": bub["1f1b"],
            "met": bub["bidirectional"] < bub["1f1b"],
        },
        "tp_comm_bytes_vs_theory": {
            "value": tpr,
            "target": [0.95, 1.05],
            "met": abs(tpr - 1) <= 0.05,
        },
    }
    cfg = gpt_config(args.quick)
    print(
        json.dumps(
            {
                "bench": "parallel",
                "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "mpi"},
                "config": {
                    "ranks": n,
                    "n_layer": cfg.n_layer,
                    "d_model": cfg.d_model,
                    "batch": BATCH,
                    "seq": SEQ,
                    "microbatches": MICRO,
                    "steps": steps,
                    "quick": args.quick,
                },
                "figures": fig,
                "targets": targets,
            }
        )
    )


if __name__ == "__main__":
    main()
