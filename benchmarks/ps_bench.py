"""Parameter-server pull/push rows/s for every store, beside raw ceilings in the same run.

    python benchmarks/ps_bench.py [--quick]

* in-process store vs a numpy gather of the same rows (``_ps_bench_local``);
* MPI store, 1 server + 1 worker, vs a raw mpi4py send of the same bytes
  (``_ps_bench_mpi``, launched here under ``mpirun -n 2``);
* Redis store on its own ``redis-server`` vs a raw pipelined MGET and a raw Lua
  update script on the same server (``_ps_bench_redis``), and multi-table training
  steps one request per table vs batched (``pull_many``/``push_many``), with the
  round trips per Redis node per step (``requests_per_server_step``);
* on every store, counted pushes at ``k = 1`` beside plain ones (row-wise Adagrad and
  Adam tables; ``_ps_bench_counted``): target ``counted_push_k1_vs_plain`` >= 0.95,
  and the MPI wire's bytes per pushed row of each;
* MPI store, fp16 tables beside fp32 ones (the same rows; rows and gradients travel in
  16 bits; ``_ps_bench_narrow``): targets ``fp16_mpi_pull_speedup`` and
  ``fp16_mpi_push_speedup`` >= 1.5 (fp16 / fp32 rows/s of batched row-wise Adagrad
  requests, the jobs' path, paired by round), single SGD requests beside them.

64-dim float32 rows, batches of 10 k unique Zipf ids. One torch thread per
process (the machine has 2 cores and the MPI job runs 2 ranks). The last line is
one JSON object (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _ps_bench_counted as counted  # noqa: E402
import _ps_bench_narrow as narrow  # noqa: E402
from _ps_bench_local import bench_local  # noqa: E402
from _ps_bench_redis import bench_redis  # noqa: E402

TARGETS = {
    "local_pull_rows_s": 20e6,
    "mpi_pull_rows_s": 5e6,
    "mpi_push_rows_s": 2e6,
    "redis_pull_vs_mget": 0.8,
    "redis_push_vs_lua": 1.0,
    **dict.fromkeys(narrow.TARGETED, narrow.TARGET),
}


def _mpi_part(quick: bool) -> dict[str, Any]:
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", "2", sys.executable]
    cmd += [str(HERE / "_ps_bench_mpi.py")] + (["--quick"] if quick else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"MPI part failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    sys.stderr.write(out.stderr)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _target(value: float | None, name: str) -> dict[str, Any]:
    return {
        "value": value,
        "target": TARGETS[name],
        "met": value is not None and value >= TARGETS[name],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    args = parser.parse_args()
    torch.set_num_threads(1)
    q = args.quick
    local = bench_local(
        rows=100_000 if q else 1_000_000, repeats=3 if q else 7, n_batches=3 if q else 10
    )
    for name, v in local["figures"].items():
        print(f"in-process {name:>20}: {v / 1e6:7.2f} M rows/s", file=sys.stderr)
    mpi = _mpi_part(q)
    redis = bench_redis(
        rows=100_000 if q else 1_000_000, repeats=3 if q else 7, n_batches=2 if q else 4
    )
    for name, v in sorted(redis["figures"].items()):
        print(f"redis {name:>25}: {v / 1e6:7.3f} M rows/s", file=sys.stderr)
    steps = redis["steps"]
    for kind, v in steps["steps_per_s"].items():
        trips = steps["requests_per_server_step"][kind]
        print(f"redis step {kind:>20}: {v:7.1f} steps/s, {trips:.2f} round trips/node/step",
              file=sys.stderr)  # fmt: skip

    mpi_steps = mpi["figures"]["steps"]
    for kind, v in mpi_steps["steps_per_s"].items():
        sent = mpi_steps["requests_per_server_step"][kind]
        print(f"mpi step {kind:>22}: {v:7.1f} steps/s, {sent:.2f} messages/server/step",
              file=sys.stderr)  # fmt: skip
    mpi_rows = mpi["figures"]["rows_per_s"]
    rows_per_s = {
        "local": {"pull": local["figures"]["local_pull"], "push": local["figures"]["local_push"]},
        "mpi": {"pull": max(mpi_rows["pull"], mpi_rows["pull_pipelined"]),
                "push": max(mpi_rows["push"], mpi_rows["push_pipelined"])},
        "redis": {"pull": redis["figures"]["redis_pull"], "push": redis["figures"]["redis_push"]},
    }  # fmt: skip
    # Counted pushes at k = 1 against plain ones, per store and optimizer (the worst is
    # the target: a cache's one-update rows must not make any store's push slower).
    counted_k1 = {
        "local": local["counted_k1_vs_plain"],
        "mpi": mpi["figures"]["counted_k1_vs_plain"],
        "redis": redis["counted_k1_vs_plain"],
    }
    for where, by_opt in counted_k1.items():
        for name, v in by_opt.items():
            print(f"{where} {name} counted k=1 / plain push: {v:.3f}", file=sys.stderr)
    worst_k1 = min(v for by_opt in counted_k1.values() for v in by_opt.values())
    fp16 = mpi["figures"]["fp16_mpi"]  # fp16 / fp32 rows/s of one MPI table
    for name, v in fp16.items():
        print(f"mpi {name}: {v:.3f}", file=sys.stderr)
    result = {
        "bench": "ps",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "mpi"},
        "config": {"quick": q, "local": local["config"], "mpi": mpi["config"],
                   "redis": redis["config"]},
        "figures": {
            "rows_per_s": rows_per_s,
            "local": local["figures"],
            "mpi": mpi_rows,
            "redis": redis["figures"],
            "redis_steps": steps,
            "mpi_steps": mpi_steps,
            "mpi_server": mpi["figures"]["server"],
            "ratios": {**local["ratios"], **redis["ratios"]},
            "counted_k1_vs_plain": counted_k1,
            "wire_bytes_per_pushed_row": mpi["figures"]["wire_bytes_per_pushed_row"],
            "fp16_mpi": fp16,
        },
        "requests_per_server_step": {
            "mpi": mpi_steps["requests_per_server_step"],
            "redis": steps["requests_per_server_step"],
        },
        "targets": {
            name: _target(value, name)
            for name, value in (
                ("local_pull_rows_s", rows_per_s["local"]["pull"]),
                ("mpi_pull_rows_s", rows_per_s["mpi"]["pull"]),
                ("mpi_push_rows_s", rows_per_s["mpi"]["push"]),
                ("redis_pull_vs_mget", redis["ratios"]["redis_pull_vs_mget"]),
                ("redis_push_vs_lua", redis["ratios"]["redis_push_vs_lua"]),
                *((name, fp16[name]) for name in narrow.TARGETED),
            )
        } | {
            "server_overhead_us_per_message": mpi["targets"]["server_overhead_us_per_message"],
            "counted_push_k1_vs_plain": {
                "value": worst_k1, "target": counted.TARGET, "met": worst_k1 >= counted.TARGET,
                "note": "the worst store and optimizer: counted push at k = 1 / plain push rows/s",
            },
        },
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
