"""The MPI part of the planner's calibration, run as ``mpirun -n 2 python -m
hybridrec.plan.mpi_probe [--quick]`` by :func:`hybridrec.plan.calibrate_mpi.run_mpi_probe`.

Rank 1 serves a :class:`ps.mpi.store.MPIStore` shard; rank 0 times ``pull_many``,
conditional ``pull_many`` and ``push_many`` of several tables through it (counting the
messages the server got with ``request_counts``, and the server's own seconds per
message with ``server_busy``: what the queueing model charges a server), then both
ranks time allreduce, alltoallv and allgatherv of several sizes and a sharded
embedding collection. Rank 0
prints one JSON line. Under ``mpirun -n 3`` ranks 1 and 2 serve (each holding the rows
routed to it densely, as with any S >= 2) and the store and the collectives are timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from hybridrec.plan.calibrate_store import make_tables, store_grid, time_store
from hybridrec.plan.timing import DIM, ids_of, timed
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore

CROSS = 0.25  # quantile of cross-process timings (see hybridrec.plan.timing.timed)


def message_counts(store: MPIStore) -> dict[str, int]:
    """``request_counts()``; a store that does not count its messages sends one per
    table request, which its per-table ``stats()`` count."""
    try:
        return store.request_counts()
    except NotImplementedError:
        stats = store.stats()
        return {
            "pull_messages": int(sum(s["pull_requests"] for s in stats.values())),
            "push_messages": int(sum(s["push_requests"] for s in stats.values())),
        }


def probe_store(group: comm.ProcessGroup, topology: comm.Topology, quick: bool) -> dict[str, Any]:
    """On the worker: seconds and messages per batched request, per size of the grid."""
    rows = 20_000
    points = []
    per_batch = 1.0
    # more ranks than cores: waiting for a descheduled rank is part of what is measured
    # (the median), not other work's noise (the lower quartile)
    quantile = 0.5 if group.size > (os.cpu_count() or 1) else CROSS
    with MPIStore(group, topology, request_timeout_s=300.0) as store:
        for i, (k, n) in enumerate(store_grid(quick)):
            names = make_tables(store, f"g{i}_", k, rows, "rowwise_adagrad")
            by_opt = {"rowwise_adagrad": names}
            reps = 3 if quick else 9
            point: dict[str, Any] = {"tables": k, "rows": n}
            ids = torch.arange(n)
            clocks = [store.clocks(t, ids) for t in names]  # before counting messages
            requests = {
                "pull": [ps.PullRequest(table=t, ids=ids) for t in names],
                "pull_check": [ps.PullRequest(table=t, ids=ids, clocks=c, bound=0)
                               for t, c in zip(names, clocks, strict=True)],
            }  # fmt: skip
            pushes = [ps.PushRequest(table=t, ids=ids, grads=torch.zeros(n, 16)) for t in names]
            calls: dict[str, Callable[[], object]] = {
                "pull": functools.partial(store.pull_many, requests["pull"]),
                "pull_check": functools.partial(store.pull_many, requests["pull_check"]),
                "push": functools.partial(store.push_many, pushes),
            }
            for kind, call in calls.items():
                key = "push" if kind == "push" else "pull"
                before = message_counts(store)
                call()
                point[f"{kind}_messages"] = (
                    message_counts(store)[f"{key}_messages"] - (before[f"{key}_messages"])
                )
                point[f"server_{kind}_s"] = server_seconds(store, call, key, reps)
            if k > 1:  # messages one server got for one pull_many of k tables
                per_batch = float(point["pull_messages"]) / topology.num_servers
            point.update(time_store(store, by_opt, n, rows, reps, quantile))
            point["push"] = point.pop("push:rowwise_adagrad")
            points.append(point)
    return {"store": points, "messages_per_batch": per_batch}


def server_seconds(store: MPIStore, call: Callable[[], object], key: str, reps: int) -> float:
    """What one server spends on its message of ``call``'s request (``key``: "pull" or
    "push"), from ``MPIStore.server_busy`` around ``reps`` calls: busy seconds per
    message, averaged over the servers."""
    before = store.server_busy()
    for _ in range(reps):
        call()
    per = []
    for b, a in zip(before, store.server_busy(), strict=True):
        messages = a[f"{key}_messages"] - b[f"{key}_messages"]
        if messages > 0:
            per.append((a[f"{key}_s"] - b[f"{key}_s"]) / messages)
    return sum(per) / len(per) if per else 0.0


def probe_collectives(group: comm.ProcessGroup, quick: bool) -> dict[str, list[list[float]]]:
    """Seconds per call of each collective at several byte counts (per rank sent)."""
    sizes = [256, 16_384, 262_144] if quick else [256, 4096, 65_536, 262_144, 1_048_576]
    reps = 7 if quick else 21
    out: dict[str, list[list[float]]] = {"allreduce": [], "alltoallv": [], "allgatherv": []}
    w = group.size
    for floats in sizes:
        x = torch.ones(floats)
        out["allreduce"].append(
            [4.0 * floats, timed(functools.partial(group.allreduce, x), reps, 2, CROSS)]
        )
        part = floats // w
        y = torch.ones(part * w)
        out["alltoallv"].append(
            [
                4.0 * part * (w - 1),
                timed(
                    functools.partial(group.alltoallv, y, [part] * w, [part] * w), reps, 2, CROSS
                ),
            ]
        )
        z = torch.ones(part)
        out["allgatherv"].append(
            [4.0 * part, timed(functools.partial(group.allgatherv, z), reps, 2, CROSS)]
        )
    return out


def probe_sharded(group: comm.ProcessGroup, quick: bool) -> list[dict[str, float]]:
    """Forward + backward of 26 sharded tables (the DLRM job's count) on both ranks, at
    two batch sizes per rank and two id laws: seconds, lookups and distinct ids of
    this rank."""
    tables, rows = 26, 20_000
    cfgs = [
        TableConfig(name=f"s{i}", num_rows=rows, dim=DIM, feature_names=[f"s{i}"],
                    placement="sharded", optimizer=RowWiseAdagrad(lr=0.01))
        for i in range(tables)
    ]  # fmt: skip
    emb = EmbeddingCollection(cfgs, group=group)
    out = []
    for b in (128, 1024):
        for law in ("uniform", "zipf"):
            rng = np.random.default_rng(b * 10 + group.rank)
            per = [ids_of(rng, law, rows, b) for _ in range(tables)]
            kjt = KeyedJaggedIds(
                [f"s{i}" for i in range(tables)],
                torch.from_numpy(np.concatenate(per)),
                torch.ones(tables * b, dtype=torch.int64),
            )

            def step(kjt: Any = kjt) -> None:
                pooled = emb(kjt)
                sum(v.sum() for v in pooled.values()).backward()  # type: ignore[union-attr]

            seconds = timed(step, 7 if quick else 15, 2, CROSS)
            unique = float(sum(np.unique(p).size for p in per))
            out.append({"lookups": float(tables * b), "unique": unique, "seconds": seconds,
                        "tables": float(tables)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    group = comm.init("mpi")
    if group.size not in (2, 3):
        raise SystemExit(f"mpi_probe runs on 2 or 3 ranks (mpirun -n 2|3), got {group.size}")
    try:  # 3 ranks: one worker and two servers, the store alone
        topology = comm.Topology(world_size=group.size, num_servers=group.size - 1)
        result: dict[str, Any] = {}
        if topology.role(group.rank) is comm.Role.SERVER:
            serve_mpi(group, topology)
        else:
            result = probe_store(group, topology, args.quick)
        result["servers"] = group.size - 1
        group.barrier()
        result["collectives"] = probe_collectives(group, args.quick)
        if group.size == 2:
            result["sharded"] = probe_sharded(group, args.quick)
        if group.rank == 0:
            print(json.dumps(result), flush=True)
    finally:
        group.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
