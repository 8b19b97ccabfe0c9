"""Hashed n-gram input tables for the GPT job: validation loss gain, its growth with rows, cost.

    python benchmarks/ngram_lm_bench.py [--quick] [--no-mpi] [--seeds K] [--steps S]

The language-model job (``python -m hybridrec train-lm``) on the Shakespeare corpus with
the byte tokenizer, one process each run. Every run has the same corpus, tokenizer, dense
GPT (2 blocks x 64), steps (300), global batch (32 windows of 64 bytes), learning rates
and seed; only the input tables differ:

* ``baseline``: the token table alone (``--ngram 1``);
* ``rows_64k``, ``rows_256k``, ``rows_1m``: plus hashed 2- and 3-gram tables
  (``--ngram 3``) of 64 Ki, 256 Ki and 1 Mi rows each, hybrid placement in the
  in-process store;
* ``n5_rows_64k`` ... ``n5_rows_1m``: the same sizes with 2- to 5-gram tables
  (``--ngram 5``), in-process only: byte 3-grams are too few for the sizes to differ much;
* ``cache_b4``: 1 Mi rows behind the hot-row cache with 10 % of each table's rows,
  bounds (4, 4); ``cache_b0``: the same cache at bounds (0, 0);
* ``cache_b4_adam``, ``cache_b0_adam``: the same pair with Adam on the n-gram tables,
  ``--adam-steps`` steps (900) and ``--adam-seeds`` seeds (5). At 300 steps these runs
  are still leaving their first plateau, and when each does depends on the seed (seed 1
  is at 2.8 nats per byte by step 50, seed 0 near step 90), so their losses spread by 0.2
  between seeds; by 900 steps by 0.04. The cache pushes a row with its update count
  (counted pushes, docs/cache.md), so Adam applies the ``s_w + 1`` updates it sums.

Each configuration runs with ``--seeds`` seeds (the GPT init and the batch windows), in
the order seed by seed, configuration by configuration (A B C ... A B C ...), and the
figures are medians over the seeds. The loss is the validation loss in nats per byte
(the last 10 % of the corpus, 32 global batches); the step time is the job's training
time over its steps (evaluations excluded).

Under ``mpirun -n 3`` with ``--ps mpi:1`` (2 workers, one server rank; ``--no-mpi``
skips it) the same configurations run once (first seed), and rows moved per step (the
n-gram tables' rows pulled + pushed, as the server counts them: both workers) are
reported.

Step time: the configurations above run minutes apart, and this machine's load drifts
in minutes, so the overhead target comes from ``--timing-pairs`` extra back-to-back pairs
(baseline, then rows_1m, 150 steps each): the median of the per-pair ratios.

Targets: ``ngram_val_loss_gain`` = 1 - loss(rows_1m) / loss(baseline) >= 0.05;
``ngram_loss_monotonic``: loss(64k) > loss(256k) > loss(1m); ``ngram_step_overhead`` =
step(rows_1m) / step(baseline) <= 1.25 (median of the timing pairs);
``cache_bounds_gap`` = |loss(cache_b4) - loss(cache_b0)| <= 0.01 nats per byte;
``adam_bounds_gap`` the same of the Adam pair (medians over its seeds; the per-seed gaps
beside it) <= 0.01, in-process and (``mpi_adam_bounds_gap``, ``--mpi-adam-seeds``
seeds) under ``mpirun``. ``--bound-split`` adds the Adam pair's bounds one at a time,
(4, 0) and (0, 4), as figures (``adam_read_bound_gap``, ``adam_write_bound_gap``: their
loss against (0, 0)): with two workers each bound alone costs what both do. The last
line is one JSON object (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's helper modules
from _bench_util import interleaved, reported  # noqa: E402

KiB = 1024

# The runs compared: name -> options beyond the common ones.
CONFIGS: dict[str, list[str]] = {
    "baseline": ["--ngram", "1"],
    "rows_64k": ["--ngram", "3", "--ngram-rows", str(64 * KiB)],
    "rows_256k": ["--ngram", "3", "--ngram-rows", str(256 * KiB)],
    "rows_1m": ["--ngram", "3", "--ngram-rows", str(1024 * KiB)],
    "cache_b4": ["--ngram", "3", "--ngram-rows", str(1024 * KiB), "--cache-fraction", "0.1",
                 "--read-bound", "4", "--write-bound", "4"],
    "cache_b0": ["--ngram", "3", "--ngram-rows", str(1024 * KiB), "--cache-fraction", "0.1",
                 "--read-bound", "0", "--write-bound", "0"],
}  # fmt: skip
# The same cache pair with Adam on the tables: what the write bound costs an adaptive
# optimizer (the PS applies the s_w + 1 updates a counted push stands for).
ADAM = ["--emb-optimizer", "adam", "--emb-lr", "0.01"]
CONFIGS["cache_b4_adam"] = CONFIGS["cache_b4"] + ADAM
CONFIGS["cache_b0_adam"] = CONFIGS["cache_b0"] + ADAM
ADAM_PAIR = ["cache_b4_adam", "cache_b0_adam"]
# The Adam pair's two bounds one at a time (``--bound-split``): the read bound alone
# pushes every update at once (k = 1: nothing to count), the write bound alone refreshes
# every row another writer pushed since its read.
CONFIGS["cache_r4_adam"] = [*CONFIGS["cache_b4"][:-2], "--write-bound", "0", *ADAM]
CONFIGS["cache_w4_adam"] = [*CONFIGS["cache_b0"][:-2], "--write-bound", "4", *ADAM]
BOUND_SPLIT = ["cache_r4_adam", "cache_w4_adam"]
# N = 5 (2- to 5-gram tables): byte 3-grams are too few (19 k distinct in this corpus) for
# 64 Ki rows to collide much; 4- and 5-grams (95 k, 301 k) show what more rows buy.
for _name, _rows in (("64k", 64), ("256k", 256), ("1m", 1024)):
    CONFIGS[f"n5_rows_{_name}"] = ["--ngram", "5", "--ngram-rows", str(_rows * KiB)]
SIZES = ("rows_64k", "rows_256k", "rows_1m")
N5_SIZES = ("n5_rows_64k", "n5_rows_256k", "n5_rows_1m")
QUICK_MPI = ("baseline", "rows_1m")  # --quick: the mpirun part runs only these


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def common_args(quick: bool, steps: int) -> list[str]:
    """The options every run shares (the job's defaults for the model and batch)."""
    return [
        "--tokenizer", "byte", "--n-layer", "2", "--n-head", "4",
        "--d-model", "32" if quick else "128", "--block-size", "64", "--batch-size", "32",
        "--max-steps", str(steps), "--eval-every", str(steps),
        "--eval-batches", "2" if quick else "32",
        "--max-bytes", "200000" if quick else "0", "--emb-optimizer", "sgd", "--emb-lr", "64",
        "--threads", "1", "--no-progress", "--no-verbose",
    ]  # fmt: skip


def launch(cmd: list[str], what: str) -> dict[str, Any]:
    """Run the job; return its final metrics row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
        done = subprocess.run(
            [*cmd, "--metrics-out", str(out)],
            env=env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        final: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
        return final


def job_cmd(mpi: bool) -> list[str]:
    job = [sys.executable, "-m", "hybridrec", "train-lm"]
    if not mpi:
        return job
    mpirun = Path(sys.executable).parent / "mpirun"
    return [str(mpirun if mpirun.exists() else "mpirun"), "-n", "3", *job, "--ps", "mpi:1"]


def run_all(names: list[str], seeds: list[int], base: list[str], mpi: bool) -> dict[str, list]:
    """Every configuration for every seed, interleaved; ``{name: [final row per seed]}``."""
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for seed in seeds:
        for name in names:
            r = launch([*job_cmd(mpi), *base, *CONFIGS[name], "--seed", str(seed)], name)
            rows[name].append(r)
            moved = r.get("ngram_rows_moved_per_step")
            _say(
                f"{'mpi ' if mpi else ''}{name:10s} seed {seed}: val {r['val_nats_per_byte']:.4f} "
                f"nats/byte, step {r['step_seconds'] * 1e3:.1f} ms"
                + (f", n-gram rows moved/step {moved:.0f}" if moved is not None else "")
            )
    return rows


def figures_of(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in rows[name] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    names = list(rows)
    loss = {n: med(n, "val_nats_per_byte") for n in names}
    fig: dict[str, Any] = {
        "val_nats_per_byte": loss,
        "val_nats_per_byte_runs": {n: [r["val_nats_per_byte"] for r in rows[n]] for n in names},
        "step_ms": {n: 1e3 * (med(n, "step_seconds") or 0.0) for n in names},
        "ngram_rows_per_step": {n: med(n, "ngram_rows_per_step") for n in names[1:]},
        "ngram_rows_moved_per_step": {n: med(n, "ngram_rows_moved_per_step") for n in names[1:]},
        "cache_hit_rate": {n: med(n, "cache_hit_rate") for n in names if n.startswith("cache")},
    }
    for name, key in (("cache_r4_adam", "read_bound_gap"), ("cache_w4_adam", "write_bound_gap")):
        if name in rows and "cache_b0_adam" in rows:  # --bound-split
            alone, zero = loss[name], loss["cache_b0_adam"]
            assert alone is not None and zero is not None
            runs = zip(rows[name], rows["cache_b0_adam"], strict=True)
            fig[f"adam_{key}"] = {
                "median": abs(alone - zero),
                "per_seed": [abs(a["val_nats_per_byte"] - b["val_nats_per_byte"]) for a, b in runs],
            }
    if all(n in rows for n in SIZES):
        first, last = loss[SIZES[0]], loss[SIZES[-1]]
        assert first is not None and last is not None
        fig["loss_slope_per_doubling"] = (last - first) / math.log2(16)  # 64 Ki -> 1 Mi rows
        per_seed = zip(*(fig["val_nats_per_byte_runs"][n] for n in SIZES), strict=True)
        fig["monotonic_seeds"] = sum(a > b > c for a, b, c in per_seed)
    if all(n in rows for n in N5_SIZES):
        first, last = loss[N5_SIZES[0]], loss[N5_SIZES[-1]]
        assert first is not None and last is not None
        fig["n5_loss_slope_per_doubling"] = (last - first) / math.log2(16)
        per_seed = zip(*(fig["val_nats_per_byte_runs"][n] for n in N5_SIZES), strict=True)
        fig["n5_monotonic_seeds"] = sum(a > b > c for a, b, c in per_seed)
        middle = loss[N5_SIZES[1]]
        assert middle is not None
        fig["n5_monotonic"] = bool(first > middle > last)
    return fig


def timing_pairs(pairs: int, base: list[str], mpi: bool) -> list[float]:
    """``pairs`` back-to-back (baseline, rows_1m) runs of 150 steps: step-time ratios."""
    steps = ["--steps", "150", "--eval-every", "150", "--eval-batches", "1"]

    def job(name: str) -> Callable[[], float]:  # the job's own step time
        return lambda: launch([*job_cmd(mpi), *base, *CONFIGS[name], *steps], name)["step_seconds"]

    def logged(i: int, t: dict[str, list[float]]) -> None:
        before, after = t["baseline"][-1], t["rows_1m"][-1]
        _say(f"{'mpi ' if mpi else ''}timing pair {i}: {before * 1e3:.1f} -> {after * 1e3:.1f} ms")

    t = interleaved(
        {name: job(name) for name in ("baseline", "rows_1m")},
        pairs,
        timer=reported,
        warmup=0,
        order="fixed",
        after_round=logged,
    )
    return [r / b for b, r in zip(t["baseline"], t["rows_1m"], strict=True)]


def targets_of(fig: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    loss, step = fig["val_nats_per_byte"], fig["step_ms"]
    gain = 1 - loss["rows_1m"] / loss["baseline"]
    overhead = (
        statistics.median(fig["overhead_pairs"])
        if fig.get("overhead_pairs")
        else step["rows_1m"] / step["baseline"]
    )
    out = {
        f"{prefix}ngram_val_loss_gain": {"value": gain, "target": 0.05, "met": gain >= 0.05},
        f"{prefix}ngram_step_overhead": {
            "value": overhead, "target": 1.25, "met": overhead <= 1.25,
        },
    }  # fmt: skip
    if all(n in loss for n in SIZES):
        mono = bool(loss["rows_64k"] > loss["rows_256k"] > loss["rows_1m"])
        out[f"{prefix}ngram_loss_monotonic"] = {"value": mono, "target": True, "met": mono}
    if "cache_b4" in loss:
        gap = abs(loss["cache_b4"] - loss["cache_b0"])
        out[f"{prefix}cache_bounds_gap"] = {"value": gap, "target": 0.01, "met": gap <= 0.01}
    if "cache_b4_adam" in loss:
        gap = abs(loss["cache_b4_adam"] - loss["cache_b0_adam"])
        runs = fig["val_nats_per_byte_runs"]
        per_seed = [abs(a - b) for a, b in zip(runs["cache_b4_adam"], runs["cache_b0_adam"],
                                               strict=True)]  # fmt: skip
        out[f"{prefix}adam_bounds_gap"] = {
            "value": gap, "target": 0.01, "met": gap <= 0.01,
            "note": f"medians over {len(per_seed)} seeds; per-seed gaps "
            + ", ".join(f"{g:.4f}" for g in per_seed),
        }  # fmt: skip
    return out


def show(fig: dict[str, Any], label: str) -> None:
    base = fig["val_nats_per_byte"]["baseline"]
    for name, loss in fig["val_nats_per_byte"].items():
        _say(
            f"{label} {name:10s}: {loss:.4f} nats/byte ({1 - loss / base:+.1%} vs baseline), "
            f"step {fig['step_ms'][name]:.1f} ms"
        )
    if "loss_slope_per_doubling" in fig:
        _say(f"{label} loss slope per doubling of rows: {fig['loss_slope_per_doubling']:+.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small corpus and model, one seed")
    p.add_argument("--no-mpi", action="store_true", help="skip the mpirun part")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (full mode)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (full mode)")
    p.add_argument("--timing-pairs", type=int, default=3, help="baseline/rows_1m timing pairs")
    p.add_argument("--adam-seeds", type=int, default=5, help="seeds of the Adam cache pair")
    p.add_argument("--adam-steps", type=int, default=900, help="steps of the Adam cache pair")
    p.add_argument(
        "--mpi-adam-seeds", type=int, default=3, help="seeds of the Adam pair under mpirun"
    )
    p.add_argument(
        "--bound-split",
        action="store_true",
        help="also the Adam pair's bounds one at a time: (4, 0) and (0, 4)",
    )
    args = p.parse_args()
    steps = 10 if args.quick else args.steps
    seeds = list(range(1 if args.quick else args.seeds))
    adam_seeds = list(range(1 if args.quick else args.adam_seeds))
    base = common_args(args.quick, steps)
    adam_base = common_args(args.quick, steps if args.quick else args.adam_steps)
    names = [n for n in CONFIGS if n not in ADAM_PAIR + BOUND_SPLIT]
    adam_names = ADAM_PAIR + (BOUND_SPLIT if args.bound_split else [])
    fig = figures_of(
        {
            **run_all(names, seeds, base, mpi=False),
            **run_all(adam_names, adam_seeds, adam_base, mpi=False),
        }
    )
    pairs = 0 if args.quick else args.timing_pairs
    fig["overhead_pairs"] = timing_pairs(pairs, base, mpi=False)
    show(fig, "in-process")
    figures: dict[str, Any] = {"inprocess": fig}
    targets = targets_of(fig)
    if not args.no_mpi:
        mpi_names = list(QUICK_MPI) if args.quick else [n for n in names if not n.startswith("n5")]
        mpi_adam = [] if args.quick else list(range(args.mpi_adam_seeds))
        mpi_fig = figures_of(
            {
                **run_all(mpi_names, seeds[:1], base, mpi=True),
                **(run_all(adam_names, mpi_adam, adam_base, mpi=True) if mpi_adam else {}),
            }
        )
        mpi_fig["overhead_pairs"] = timing_pairs(min(pairs, 1), base, mpi=True)
        show(mpi_fig, "mpi")
        figures["mpi"] = mpi_fig
        targets.update(targets_of(mpi_fig, prefix="mpi_"))
    print(
        json.dumps(
            {
                "bench": "ngram_lm",
                "machine": {
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                },
                "config": {
                    "quick": args.quick,
                    "steps": steps,
                    "seeds": len(seeds),
                    "mpi_seeds": 0 if args.no_mpi else 1,
                    "adam_seeds": len(adam_seeds),
                    "adam_steps": steps if args.quick else args.adam_steps,
                    "mpi_adam_seeds": 0 if args.no_mpi or args.quick else args.mpi_adam_seeds,
                    "timing_pairs": pairs,
                    "common": base,
                    "runs": CONFIGS,
                },
                "figures": figures,
                "targets": targets,
            }  # fmt: skip
        )
    )


if __name__ == "__main__":
    main()
