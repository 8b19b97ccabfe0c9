"""cache_bench's DLRM part: what a write bound costs row-wise Adagrad, with and without
counted pushes.

The DLRM job (``python -m hybridrec train-dlrm``) on synthetic data whose ids are hot
(Zipf 1.2 over 26 tables of 100 k rows: a cache of 10 % holds ~80 % of the lookups), the
tables hybrid in the in-process store behind that cache, row-wise Adagrad (the job's
default), a fixed number of steps, in three variants per seed, run one after the other:

* ``b0``: bounds (0, 0), every update pushed at once (what the store would see uncached);
* ``b4``: bounds (4, 4), each row pushed with the count of the updates it sums
  (counted pushes, docs/cache.md);
* ``b4_sum``: bounds (4, 4) with ``--no-counted-pushes``: one Adagrad step per pushed sum;
* ``b4_sgd``: bounds (4, 4) with ``--local-step sgd``: the cached copies take HET's plain
  SGD step instead of the table optimizer's (docs/cache.md).

Figure: the training loss of the run (the job's epoch loss, the mean over its steps) and
the test log loss, medians over the seeds; target ``dlrm_bounds_loss_gap`` =
|loss(b4) - loss(b0)| / loss(b0) <= 0.002, with ``b4_sum``'s and ``b4_sgd``'s gaps beside
it (without counted pushes, without the optimizer's local step).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.002
VARIANTS = {
    "b0": ["--read-bound", "0", "--write-bound", "0"],
    "b4": ["--read-bound", "4", "--write-bound", "4"],
    "b4_sum": ["--read-bound", "4", "--write-bound", "4", "--no-counted-pushes"],
    "b4_sgd": ["--read-bound", "4", "--write-bound", "4", "--local-step", "sgd"],
}


def _run(args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "hybridrec", "train-dlrm", *args, "--metrics-out", str(out)]
        done = subprocess.run(
            cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=1800, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        final: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
        return final


def dlrm_bounds(seeds: int, steps: int, say: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, target) of the part described in the module docstring."""
    common = [
        "--data", "synthetic", "--synthetic-zipf", "1.2", "--synthetic-rows", "100000",
        "--synthetic-samples", "400000", "--placement", "hybrid", "--cache-fraction", "0.1",
        "--max-steps", str(steps), "--batch-size", "512", "--threads", "1", "--no-progress",
        "--no-verbose",
    ]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for seed in range(seeds):
        for name, extra in VARIANTS.items():
            final = _run([*common, *extra, "--seed", str(seed)])
            got = {
                "train_loss": float(final["epochs"][-1]["train_loss"]),
                "test_logloss": float(final["test_logloss"]),
            }
            runs[name].append(got)
            say(f"dlrm bounds {name} seed {seed}: train loss {got['train_loss']:.5f}, "
                f"test logloss {got['test_logloss']:.5f}")  # fmt: skip
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("train_loss", "test_logloss")}
        for name, rs in runs.items()
    }
    base = med["b0"]["train_loss"]
    gap = abs(med["b4"]["train_loss"] - base) / base
    before = abs(med["b4_sum"]["train_loss"] - base) / base
    by_sgd = abs(med["b4_sgd"]["train_loss"] - base) / base
    figures = {"runs": runs, "medians": med, "gap": gap, "gap_without_counts": before,
               "gap_sgd_local_step": by_sgd,
               "config": {"common": common, "variants": VARIANTS, "seeds": seeds}}  # fmt: skip
    target = {
        "value": gap,
        "target": TARGET,
        "met": gap <= TARGET,
        "note": f"DLRM, synthetic Zipf 1.2, row-wise Adagrad, {steps} steps, medians of "
        f"{seeds} seeds: training loss at bounds (4, 4) vs (0, 0), relative; one step per "
        f"pushed sum (--no-counted-pushes) {before:.4f}, copies stepped by SGD "
        f"(--local-step sgd) {by_sgd:.4f}",
    }
    return figures, target
