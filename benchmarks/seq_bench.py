"""Next-item recommenders side by side: hybridrec's SASRec and HSTU against RecBole's SASRec.

    python benchmarks/seq_bench.py                     # full: 3 seeds, MovieLens + 1 M items
    python benchmarks/seq_bench.py --quick             # ~2 minutes smoke run
    python benchmarks/seq_bench.py --peer-python /path/to/venv/bin/python   # RecBole's env

Two parts, each in one run:

* **MovieLens-100k** (shipped with recbole), leave-one-out by time, full ranking of
  every item (seen items not excluded, as RecBole ranks them): hybridrec's SASRec and
  HSTU (``hybridrec.seq``, the job's defaults), RecBole 1.2.1's own SASRec with its
  defaults except its batch (``benchmarks/_recbole_sasrec.py``, run by ``--peer-python``,
  an interpreter with RecBole's runtime dependencies: ``pip install pandas scipy
  scikit-learn colorlog colorama tabulate texttable thop pyyaml psutil tensorboard tqdm``;
  missing: ``null`` with a note), and the popularity baseline: test HR@10 and NDCG@10,
  and training samples/s (a sample is one predicted next item: RecBole's samples are
  every prefix of a training sequence, ours every scored position of a training window),
  medians over the seeds.
  Both train for at most ``--epochs`` epochs with early stopping on their validation metric.
  RecBole trains at ``--peer-batch-size 256`` rather than its default 2048: on a CPU
  thread its SASRec runs 823 samples/s at 256 against 435 at 2048 (both compute all 50
  positions of every prefix), and 256 takes 8x the optimizer steps per epoch, so it
  converges in fewer of its ~2-minute epochs.
* **A synthetic catalogue of 1 M items** (``hybridrec.datasets.synthetic_sequences``):
  the training step of the sampled softmax (the batch's items + 256 uniform negatives,
  logQ-corrected) against the full softmax, both with a local item table, at a batch
  of 8 users (the full softmax's logits are [targets, 1 M]); and at 128 users, the
  sampled step with the item table hybrid (in-process store behind a 10 % cache at
  bounds (4, 4)) against the local table. Steps alternate A B A B; medians.

The last line is the JSON result (``benchmarks/README.md``, "Output").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import comm
from hybridrec.seq.config import SeqConfig
from hybridrec.seq.job import SeqJob, train
from ps import InProcessStore

HERE = Path(__file__).resolve().parent
PEER = HERE / "_recbole_sasrec.py"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def ours(model: str, seed: int, epochs: int, patience: int, threads: int) -> dict[str, Any]:
    """One hybridrec run on MovieLens-100k with the job's defaults."""
    torch.set_num_threads(threads)
    cfg = SeqConfig(
        model=model, seed=seed, epochs=epochs, patience=patience, verbose=False, progress=False
    )  # type: ignore[arg-type]
    r = train(cfg, comm.LocalGroup())
    return {
        "test_hr@10": r["test_hr@10"], "test_ndcg@10": r["test_ndcg@10"],
        "val_ndcg@10": r.get("val_ndcg@10"), "samples_per_s": r["samples_per_s"],
        "epochs_run": len(r["epochs"]), "best_epoch": r["best_epoch"],
        "parameters": r["parameters"], "popularity_hr@10": r["popularity_hr@10"],
        "popularity_ndcg@10": r["popularity_ndcg@10"],
    }  # fmt: skip


def recbole(
    peer_python: str, seed: int, epochs: int, batch_size: int, threads: int
) -> dict[str, Any]:
    """One RecBole SASRec run in the peer's interpreter (its last output line is JSON)."""
    cmd = [peer_python, str(PEER), "--epochs", str(epochs), "--seed", str(seed),
           "--batch-size", str(batch_size), "--threads", str(threads)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"test_hr@10": None, "note": f"RecBole run failed: {tail[0]}"}
    return dict(json.loads(lines[-1]))


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def catalogue_jobs(items: int, quick: bool, threads: int) -> dict[str, Any]:
    """Step times on a synthetic catalogue of ``items`` items (module docstring)."""
    torch.set_num_threads(threads)
    users = 400 if quick else 2_000
    base = dict(
        data="synthetic", synthetic_items=items, synthetic_users=users, synthetic_length=40,
        verbose=False, progress=False, epochs=1, dropout=0.0, batch_unit="users",
        train_context=0,  # a step's batch is whole users, every position predicted
    )  # fmt: skip

    def job(**over: Any) -> SeqJob:
        cfg = SeqConfig(**(base | over))  # type: ignore[arg-type]
        return SeqJob(cfg, comm.LocalGroup(), InProcessStore())

    def steps(jobs: dict[str, SeqJob], n: int) -> dict[str, float]:
        """Median step seconds per job, steps interleaved A B A B (after one warm-up)."""
        its = {
            k: (b for e in itertools.count() for b, _ in j.source.train_batches(e))
            for k, j in jobs.items()
        }
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for i in range(n + 1):
            for k, j in jobs.items():
                batch = next(its[k])
                t0 = time.perf_counter()
                j.step(batch)
                if i:
                    times[k].append(time.perf_counter() - t0)
        for j in jobs.values():
            j.settle()
            j.trainer.close()
        return {k: statistics.median(v) for k, v in times.items()}

    small = {"batch_size": 8}
    softmax = steps(
        {"sampled": job(loss="sampled", **small), "full": job(loss="full", **small)},
        2 if quick else 4,
    )
    cache = dict(placement="hybrid", cache_fraction=0.1, read_bound=4, write_bound=4)
    placement = steps(
        {"local": job(loss="sampled", batch_size=128),
         "hybrid_cache": job(loss="sampled", batch_size=128, **cache)},
        4 if quick else 12,
    )  # fmt: skip
    return {"items": items, "users": users, "softmax_step_s": softmax,
            "placement_step_s": placement}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 2 epochs, 100 k items")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=200, help="at most (early stopping ends them)")
    p.add_argument("--patience", type=int, default=20)
    p.add_argument("--peer-batch-size", type=int, default=256, help="RecBole's train_batch_size")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    p.add_argument("--items", type=int, default=None, help="catalogue size (default 1 M)")
    p.add_argument(
        "--peer-python", default=sys.executable, help="an interpreter with RecBole's dependencies"
    )
    args = p.parse_args()
    seeds = 1 if args.quick else args.seeds
    epochs = 2 if args.quick else args.epochs
    runs: dict[str, list[dict[str, Any]]] = {"sasrec": [], "hstu": [], "recbole_sasrec": []}
    for seed in range(seeds):
        for model in ("sasrec", "hstu"):
            runs[model].append(ours(model, seed, epochs, args.patience, args.threads))
            _say(f"seed {seed} {model}: {runs[model][-1]}")
        runs["recbole_sasrec"].append(
            recbole(args.peer_python, seed, epochs, args.peer_batch_size, args.threads)
        )
        _say(f"seed {seed} recbole sasrec: {runs['recbole_sasrec'][-1]}")
    med = {
        name: {k: median(rows, k) for k in ("test_hr@10", "test_ndcg@10", "train_samples_per_s",
                                             "samples_per_s", "parameters")}
        for name, rows in runs.items()
    }  # fmt: skip
    pop_hr = median(runs["sasrec"], "popularity_hr@10")
    pop_ndcg = median(runs["sasrec"], "popularity_ndcg@10")
    catalogue = catalogue_jobs(args.items or (100_000 if args.quick else 1_000_000),
                               args.quick, args.threads)  # fmt: skip
    ours_hr, hstu_hr = med["sasrec"]["test_hr@10"], med["hstu"]["test_hr@10"]
    peer_hr = med["recbole_sasrec"]["test_hr@10"]
    peer_speed = med["recbole_sasrec"]["train_samples_per_s"]
    peer_note = next((r.get("note") for r in runs["recbole_sasrec"] if r.get("note")), None)
    soft, place = catalogue["softmax_step_s"], catalogue["placement_step_s"]

    def target(value: float | None, limit: float, note: str, at_least: bool = True) -> dict:
        met = value is not None and (value >= limit if at_least else value <= limit)
        return {"value": value, "target": limit, "met": met, "note": note}

    targets = {
        "seq_hr10_vs_recbole": target(
            None if peer_hr is None else ours_hr / peer_hr, 1.0,
            peer_note or "our SASRec's test HR@10 / RecBole SASRec's (medians of the seeds)",
        ),
        "seq_hstu_vs_sasrec": target(hstu_hr / ours_hr, 1.0, "HSTU's test HR@10 / SASRec's"),
        "seq_sasrec_vs_popularity": target(ours_hr / pop_hr, 2.0, "test HR@10 / popularity's"),
        "seq_hstu_vs_popularity": target(hstu_hr / pop_hr, 2.0, "test HR@10 / popularity's"),
        "seq_train_speed_vs_recbole": target(
            None if peer_speed is None else med["sasrec"]["samples_per_s"] / peer_speed, 2.0,
            peer_note or "training samples/s (one sample = one predicted next item), CPU",
        ),
        "seq_sampled_vs_full_step": target(
            soft["sampled"] / soft["full"], 0.3, f"{catalogue['items']} items, batch 8 users",
            at_least=False,
        ),
        "seq_hybrid_cache_vs_local": target(
            place["local"] / place["hybrid_cache"], 0.8,
            "samples/s, hybrid behind a 10 % cache at bounds (4, 4) / local, batch 128 users",
        ),
    }  # fmt: skip
    result = {
        "bench": "seq",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads},
        "config": {
            "quick": args.quick,
            "seeds": seeds,
            "epochs": epochs,
            "patience": args.patience,
            "peer_batch_size": args.peer_batch_size,
            "items": catalogue["items"],
        },  # fmt: skip
        "figures": {
            "movielens": med,
            "runs": runs,
            "popularity_hr@10": pop_hr,
            "popularity_ndcg@10": pop_ndcg,
            "catalogue": catalogue,
        },  # fmt: skip
        "targets": targets,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
