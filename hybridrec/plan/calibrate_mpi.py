"""The MPI part of the calibration: ``mpirun`` of :mod:`hybridrec.plan.mpi_probe`, and the
costs fitted to its result: an MPI server's own work, the wire cost beyond it, the
collectives, a sharded collection's work at 2 ranks and the wait for a descheduled rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.plan.costs import EmbeddingCosts, Linear, StoreCosts, WireCosts
from hybridrec.plan.timing import DIM, fit, fit_linear


def mpirun_path() -> str:
    """The ``mpirun`` beside this interpreter (the mpich wheel), else one on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if found is None:
        raise RuntimeError(
            "mpirun not found beside the interpreter or on PATH; install MPI (the test "
            "extra's mpich wheel) or calibrate with --no-mpi"
        )
    return found


def run_mpi_probe(quick: bool, ranks: int = 2, timeout_s: float = 600.0) -> dict[str, Any]:
    """``mpirun -n ranks`` of :mod:`hybridrec.plan.mpi_probe`; its JSON result."""
    root = Path(__file__).resolve().parents[2]
    cmd = [mpirun_path(), "-n", str(ranks), sys.executable, "-m", "hybridrec.plan.mpi_probe"]
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(root), env.get("PYTHONPATH", "")] if p)
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"MPI calibration failed (exit {out.returncode}): {' '.join(cmd)}\n"
            f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def mpi_server_costs(probe: dict[str, Any]) -> StoreCosts:
    """What an MPI server itself spends on one worker's batched request (its busy time
    per message, measured by the probe): per table request and per row of its share.
    A server serves a batch of fixed tables whole in C (``ps.mpi.batched_pass``), so
    this is not the in-process shard's cost; pushes are row-wise Adagrad, the only
    optimizer that pass applies."""
    servers = int(probe.get("servers", 1))
    points: dict[str, list[tuple[float, float, float]]] = {}
    for p in probe["store"]:
        k, rows = float(p["tables"]), float(p["tables"] * p["rows"]) / servers
        for kind in ("pull", "pull_check", "push"):
            points.setdefault(kind, []).append((k, rows, float(p[f"server_{kind}_s"])))
    return StoreCosts(
        pull=fit_linear(points["pull"]),
        pull_check=fit_linear(points["pull_check"]),
        push={"rowwise_adagrad": fit_linear(points["push"])},
    )


def wire_costs(probe: dict[str, Any], slowdown: float = 1.0) -> WireCosts:
    """The MPI store's cost beyond the servers' own work (their busy time, measured):
    per message, per table request and per row. (With one message per table the first
    two cannot be told apart; the model then uses their sum, as the calibration saw
    it.) With S servers the messages are counted over all of them. ``slowdown``: the
    factor by which processes sharing too few cores ran slower (the model's P / C),
    taken out of the times first."""
    fits: dict[str, list[float]] = {}
    for kind in ("pull", "pull_check", "push"):
        design, times = [], []
        for p in probe["store"]:
            k, rows, messages = p["tables"], p["tables"] * p["rows"], p[f"{kind}_messages"]
            design.append([float(messages), float(k), float(rows)])
            times.append(max((p[kind] - p[f"server_{kind}_s"]) / slowdown, 0.0))
        fits[kind] = fit(design, times)
    return WireCosts(
        pull=Linear(alpha_s=fits["pull"][0], beta_s=fits["pull"][2]),
        pull_check=Linear(alpha_s=fits["pull_check"][0], beta_s=fits["pull_check"][2]),
        push=Linear(alpha_s=fits["push"][0], beta_s=fits["push"][2]),
        per_table_s={kind: f[1] for kind, f in fits.items()},
        messages_per_batch=float(probe["messages_per_batch"]),
    )


def sharded_costs(probe: dict[str, Any], collectives: dict[str, Linear]) -> EmbeddingCosts:
    """A sharded collection's own work at 2 ranks, its 4 exchanges' modeled time
    (half of each rank's distinct ids go to the other rank) subtracted."""
    a2a = collectives["alltoallv"]
    design, times = [], []
    for p in probe["sharded"]:
        sent = 0.5 * p["unique"] * (8 + 2 * 4 * DIM) + 8 * p["tables"]
        design.append([1.0, p["lookups"], p["unique"]])
        times.append(max(p["seconds"] - 4 * a2a.alpha_s - a2a.beta_s * sent, 0.0))
    alpha, per_lookup, per_unique = fit(design, times)
    return EmbeddingCosts(alpha_s=alpha, per_lookup_s=per_lookup, per_unique_s=per_unique)


def sync_delay_of(probe3: dict[str, Any], collectives: dict[str, Linear]) -> float:
    """Seconds each round of a collective waits for a descheduled rank, from the smallest
    allreduce and alltoallv at 3 ranks: their time beyond the 2-rank costs scaled to 3
    ranks (2 rounds each) and slowed by the model's P / C, per round. 0 with 3 cores."""
    cores = os.cpu_count() or 1
    if cores >= 3:
        return 0.0
    slow = 3 / cores
    delays = []
    for name in ("allreduce", "alltoallv"):
        nbytes, seconds = min(probe3["collectives"][name], key=lambda p: p[0])
        c = collectives[name]
        expected = slow * (2 * c.alpha_s + c.beta_s * nbytes)
        delays.append(max(0.0, (seconds - expected) / 2))
    return float(np.mean(delays))


def collective_costs(probe: dict[str, Any] | None) -> dict[str, Linear]:
    if probe is None:
        zero = Linear(alpha_s=0.0, beta_s=0.0)
        return {"allreduce": zero, "alltoallv": zero, "allgatherv": zero}
    return {
        name: fit_linear([(1.0, float(b), s) for b, s in points])
        for name, points in probe["collectives"].items()
    }
