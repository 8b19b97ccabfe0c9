"""Serving latency and throughput: :class:`hybridrec.serving.Predictor` on fp32, fp16 and
int8 tables beside the training model's forward of the same model, in one run.

A DLRM is trained briefly on ``--data synthetic`` (26 tables, ``--rows`` rows each,
dim 64, one id per feature and sample, 13 dense features), saved, exported three times
(``hybridrec export --tables fp32|fp16|int8``) and loaded back as the model
``hybridrec evaluate`` would score. At batch 1, 64 and 1024 the four variants
(``train_forward``: the training model, ``eval()`` under no_grad; ``predict_fp32``,
``predict_fp16``, ``predict_int8``) each score one batch per round, in turns
(``_bench_util.interleaved``, rotated order), over the same pre-built batches of
test-split samples. Figures per batch size: p50 and p99 latency (ms) over the rounds
and samples/s at the median. Key figures: ``predict_vs_train_forward`` (predictor
samples/s at batch 1024 / the training forward's), ``p99_ms_batch64`` and the table
bytes ratios int8/fp32 and fp16/fp32. One torch thread (``--threads``). The last line is
JSON (``benchmarks/README.md``); ``--quick`` is a smaller model and fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import comm
from hybridrec.cli.evaluate import saved_options, saved_run
from hybridrec.cli.export import main as export_main
from hybridrec.cli.options import parse_config
from hybridrec.datasets.ctr import Batch, gather_batch
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import DLRMJob, train
from hybridrec.serving import Predictor
from ps import InProcessStore

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
from _bench_util import interleaved  # noqa: E402

BATCHES = (1, 64, 1024)
TABLES = ("fp32", "fp16", "int8")
BYTES_TARGETS = {"int8": 0.3, "fp16": 0.5}  # table bytes / fp32's at most (D = 64)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def training_job(ckpt: Path) -> DLRMJob:
    """The job ``hybridrec evaluate`` builds for ``ckpt`` with its saved model loaded."""
    run = saved_run(str(ckpt), None, [])  # type: ignore[arg-type]  # a checkpoint is given
    cfg = parse_config(DLRMJobConfig, [], "", base=saved_options(run.meta["config"], DLRMJobConfig))
    job = DLRMJob(cfg, comm.LocalGroup(), InProcessStore(), saved_config=run.meta["config"])
    job.load_saved(run.model)
    job.model.eval()
    return job


def batches(job: DLRMJob, size: int, count: int, seed: int) -> list[Batch]:
    """``count`` batches of ``size`` test-split samples drawn with replacement."""
    data = job.source.data  # type: ignore[union-attr]
    test = data.test_idx
    gen = torch.Generator().manual_seed(seed)
    return [
        gather_batch(data, test[torch.randint(len(test), (size,), generator=gen)])
        for _ in range(count)
    ]


def time_variants(
    model: Any, preds: dict[str, Predictor], pool: list[Batch], rounds: int
) -> dict[str, list[float]]:
    """Seconds of one call per round of each variant, all scoring round ``r``'s batch."""
    state = {"i": 0}

    def current() -> Batch:
        return pool[state["i"] % len(pool)]

    def forward() -> None:
        with torch.no_grad():
            torch.sigmoid(model(current()))

    variants = {"train_forward": forward}
    for t in TABLES:
        variants[f"predict_{t}"] = lambda t=t: preds[t].predict(current())
    return interleaved(variants, rounds, warmup=3, before_round=lambda r: state.__setitem__("i", r))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds, < 1 minute")
    p.add_argument("--rows", type=int, default=None, help="rows per table (default 100k; quick 5k)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rounds", type=int, default=None, help="rounds at batch 1 (fewer at larger)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = args.rows or (5_000 if args.quick else 100_000)
    rounds = args.rounds or (60 if args.quick else 400)
    train_cfg = dict(
        data="synthetic", synthetic_rows=rows, synthetic_samples=20_000 if args.quick else 100_000,
        batch_size=256, epochs=1, dim=64, bottom_mlp=[64, 64], top_mlp=[128, 64, 1],
        verbose=False, progress=False, keep_best=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        _say(f"training {train_cfg}")
        run = train(DLRMJobConfig(**train_cfg, checkpoint_dir=str(tmp / "ckpt")), comm.LocalGroup())
        preds: dict[str, Predictor] = {}
        for t in TABLES:
            export_main(["--checkpoint", str(tmp / "ckpt"), "--out", str(tmp / t), "--tables", t,
                         "--no-verbose", "--no-progress"])  # fmt: skip
            preds[t] = Predictor(tmp / t)
        job = training_job(tmp / "ckpt")
        model = job.model
        table_bytes = {t: preds[t].table_bytes() for t in TABLES}
        figures: dict[str, Any] = {
            "table_bytes": table_bytes,
            "table_bytes_vs_fp32": {t: table_bytes[t] / table_bytes["fp32"] for t in TABLES},
            "test_auc_trained": run["test_auc"],
            "by_batch": {},
        }
        for size in BATCHES:
            n_rounds = max(10, rounds // max(1, size // 32)) if size > 64 else rounds
            pool = batches(job, size, min(n_rounds, 64), seed=size)
            times = time_variants(model, preds, pool, n_rounds)
            figures["by_batch"][str(size)] = {
                name: {
                    "p50_ms": float(np.percentile(ts, 50) * 1e3),
                    "p99_ms": float(np.percentile(ts, 99) * 1e3),
                    "samples_per_s": float(size / np.median(ts)),
                }
                for name, ts in times.items()
            }
            _say(f"batch {size}: " + ", ".join(
                f"{k} p50 {v['p50_ms']:.3f} ms" for k, v in figures["by_batch"][str(size)].items()
            ))  # fmt: skip
        big = figures["by_batch"]["1024"]
        figures["predict_vs_train_forward"] = {
            t: big[f"predict_{t}"]["samples_per_s"] / big["train_forward"]["samples_per_s"]
            for t in TABLES
        }
        figures["p99_ms_batch64"] = {
            name: v["p99_ms"] for name, v in figures["by_batch"]["64"].items()
        }
        # Scores of one batch: how far the compact tables move the probabilities.
        check = batches(job, 1024, 1, seed=7)[0]
        ref = preds["fp32"].predict(check)
        figures["max_prob_diff_vs_fp32"] = {
            t: float((preds[t].predict(check) - ref).abs().max()) for t in TABLES[1:]
        }
        job.trainer.close()
    targets: dict[str, Any] = {}
    for t, limit in BYTES_TARGETS.items():
        value = figures["table_bytes_vs_fp32"][t]
        targets[f"table_bytes_{t}_vs_fp32"] = {
            "value": value, "target": limit, "met": value <= limit,
            "note": f"{t} row files over fp32's, dim 64 (at most)",
        }  # fmt: skip
    value = figures["predict_vs_train_forward"]["fp32"]
    targets["predict_vs_train_forward"] = {
        "value": value, "target": 1.0, "met": value >= 1.0,
        "note": "fp32 predictor samples/s at batch 1024 over the training model's forward "
        f"(fp16 {figures['predict_vs_train_forward']['fp16']:.2f}, "
        f"int8 {figures['predict_vs_train_forward']['int8']:.2f})",
    }  # fmt: skip
    result = {
        "bench": "serving",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads},
        "config": {
            "quick": args.quick,
            "rows": rows,
            "tables": 26,
            "dim": 64,
            "rounds_batch1": rounds,
            "batches": list(BATCHES),
        },  # fmt: skip
        "figures": figures,
        "targets": targets,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
