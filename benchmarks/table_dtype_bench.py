"""Tables of fp16 and bf16 rows against fp32: memory and model quality, side by side.

    python benchmarks/table_dtype_bench.py            # full: 26 x 1 M x 64, 5 seeds
    python benchmarks/table_dtype_bench.py --quick    # 26 x 100 k x 64, 2 seeds, short runs

Parts (``--parts memory,dlrm,lm`` picks some):

* ``memory``: 26 tables of ``rows x 64`` with row-wise Adagrad, created in the
  in-process store and as local tables of an embedding collection, in fp32, fp16 and
  bf16: the bytes of their weights (what the tables allocate) and, beside them, of the
  optimizer state (float32 whatever the rows). The rows are allocated but not
  initialised (a constant init: calloc's pages), so the figure is the tables'
  allocation, measured from the tensors, in seconds.
  Target ``fp16_table_bytes_ratio``: fp16 weights / fp32 weights <= 0.52, the larger of
  the two placements.
* ``dlrm``: the demo's job (``make demo``: DLRM on MovieLens-100k, its defaults) with
  ``--emb-dtype fp32``, ``fp16`` and ``bf16``, seeds ``0 .. n-1``, one dtype after the
  other per seed: the test AUC of each run. Targets ``fp16_auc_gap`` and
  ``bf16_auc_gap``: |mean AUC - mean fp32 AUC| <= 0.002.
* ``lm``: the GPT job (Shakespeare, byte tokens, 2-gram tables, its defaults: token and
  n-gram tables hybrid in the in-process store, Adam) for a fixed number of steps, per
  dtype (``--lm-steps``, default 300): the final validation loss. Target
  ``fp16_lm_loss_gap``: |loss(fp16) - loss(fp32)| / loss(fp32) <= 0.01, medians over
  the seeds.

The last line of output is one JSON object (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import embedding  # noqa: E402
import ps  # noqa: E402

DTYPES = ("fp32", "fp16", "bf16")
TABLES, DIM = 26, 64


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _zero_init() -> ps.UniformInit:
    return ps.UniformInit(low=0.0, high=0.0)


def memory(rows: int) -> dict[str, Any]:
    """Weight and state bytes of 26 x ``rows`` x 64 tables per dtype and placement."""
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        store = ps.InProcessStore()
        for t in range(TABLES):
            store.create_table(
                ps.TableSpec(
                    name=f"t{t}",
                    num_rows=rows,
                    dim=DIM,
                    init=_zero_init(),
                    optimizer=ps.RowWiseAdagrad(lr=0.01),
                    dtype=dtype,
                )  # fmt: skip
            )
        stats = store.stats()
        weights = sum(int(stats[f"t{t}"]["weight_bytes"]) for t in range(TABLES))
        total = sum(int(stats[f"t{t}"]["bytes"]) for t in range(TABLES))
        out[f"inprocess_{dtype}"] = {"weight_bytes": weights, "other_bytes": total - weights}
        del store
        configs = [
            embedding.TableConfig(
                name=f"t{t}",
                num_rows=rows,
                dim=DIM,
                feature_names=[f"f{t}"],
                init=_zero_init(),
                dtype=dtype,
            )  # fmt: skip
            for t in range(TABLES)
        ]
        coll = embedding.EmbeddingCollection(configs)
        w_bytes = s_bytes = 0
        for name, tensor in coll.state_dict().items():
            size = tensor.element_size() * tensor.numel()
            if tensor.is_floating_point() and tensor.dim() == 2 and tensor.shape[1] == DIM:
                w_bytes += size  # [rows, D] weights
            else:
                s_bytes += size  # optimizer state, clocks
            del name
        out[f"local_{dtype}"] = {"weight_bytes": w_bytes, "other_bytes": s_bytes}
        del coll
        say(f"memory {dtype}: in-process weights {weights / 2**20:.0f} MiB, local weights "
            f"{w_bytes / 2**20:.0f} MiB")  # fmt: skip
    return out


def _job(kind: str, args: list[str]) -> dict[str, Any]:
    """One job run in a subprocess; its metrics file's final record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "hybridrec", kind, *args, "--metrics-out", str(out)]
        cmd += ["--no-progress"] if "--no-progress" not in args else []
        done = subprocess.run(
            cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=3600, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
        final: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
        return final


def dlrm(seeds: int, extra: list[str]) -> dict[str, list[float]]:
    auc: dict[str, list[float]] = {d: [] for d in DTYPES}
    for seed in range(seeds):
        for dtype in DTYPES:
            final = _job("train-dlrm", [*extra, "--emb-dtype", dtype, "--seed", str(seed)])
            auc[dtype].append(float(final["test_auc"]))
            say(f"dlrm {dtype} seed {seed}: test AUC {auc[dtype][-1]:.4f}")
    return auc


def lm(seeds: int, steps: int) -> dict[str, list[float]]:
    loss: dict[str, list[float]] = {d: [] for d in DTYPES}
    for seed in range(seeds):
        for dtype in DTYPES:
            args = ["--ngram", "2", "--max-steps", str(steps), "--eval-every", str(steps)]
            final = _job("train-lm", [*args, "--emb-dtype", dtype, "--seed", str(seed)])
            loss[dtype].append(float(final["val_loss"]))
            say(f"lm {dtype} seed {seed}: val loss {loss[dtype][-1]:.4f}")
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="memory,dlrm,lm")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--lm-seeds", type=int, default=None, help="default: --seeds")
    p.add_argument("--lm-steps", type=int, default=None, help="default 300 (--quick 60)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    rows = 100_000 if args.quick else 1_000_000
    seeds = args.seeds or (2 if args.quick else 5)
    lm_steps = args.lm_steps or (60 if args.quick else 300)
    lm_seeds = args.lm_seeds or seeds
    dlrm_extra = ["--epochs", "1"] if args.quick else []
    figures: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    if "memory" in parts:
        mem = memory(rows)
        figures["memory"] = mem
        ratios = {
            where: mem[f"{where}_fp16"]["weight_bytes"] / mem[f"{where}_fp32"]["weight_bytes"]
            for where in ("inprocess", "local")
        }
        figures["fp16_weight_bytes_ratio"] = ratios
        worst = max(ratios.values())
        targets["fp16_table_bytes_ratio"] = {"value": worst, "target": 0.52, "met": worst <= 0.52}
    if "dlrm" in parts:
        auc = dlrm(seeds, dlrm_extra)
        figures["dlrm_test_auc"] = auc
        base = statistics.mean(auc["fp32"])
        for dtype in ("fp16", "bf16"):
            gap = abs(statistics.mean(auc[dtype]) - base)
            targets[f"{dtype}_auc_gap"] = {"value": gap, "target": 0.002, "met": gap <= 0.002}
    if "lm" in parts:
        loss = lm(lm_seeds, lm_steps)
        figures["lm_val_loss"] = loss
        base = statistics.median(loss["fp32"])
        gap = abs(statistics.median(loss["fp16"]) - base) / base
        targets["fp16_lm_loss_gap"] = {"value": gap, "target": 0.01, "met": gap <= 0.01}
        figures["bf16_lm_loss_gap"] = abs(statistics.median(loss["bf16"]) - base) / base
    print(json.dumps({
        "bench": "table_dtype",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "local"},
        "config": {"quick": args.quick, "tables": TABLES, "rows": rows, "dim": DIM,
                   "seeds": seeds, "lm_seeds": lm_seeds, "lm_steps": lm_steps,
                   "dlrm_args": dlrm_extra},
        "figures": figures,
        "targets": targets,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
