"""comm vs raw mpi4py on the same buffers: allreduce and alltoallv bandwidth.

Run under MPI (any even number of ranks; the figures in benchmarks/README.md use 2)::

    mpirun -n 2 python benchmarks/comm_bench.py [--quick]

What is measured, per figure, side by side in one run:

* ``ours``: ``comm.init("mpi")`` with its defaults (``validate=True``), called the
  way a user would: ``group.allreduce(buf)``; ``group.alltoallv(rows, splits)``
  (receive counts learned).
* ``raw``: mpi4py's buffer calls on the very same memory:
  ``COMM_WORLD.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)`` and
  ``Alltoallv`` with counts and displacements in elements, into a preallocated
  output.
* ``novalidate`` (an extra figure, not a target): ``comm.init("mpi",
  validate=False)``, and for alltoallv the receive counts passed in, so no
  count exchange happens: the floor of what ``comm`` adds.

Each implementation runs a warm-up, then ``repeats`` timed blocks of ``iters``
calls, interleaved (ours, raw, novalidate, then the next block in another order);
every block starts after a barrier and its time is the max over ranks. A
figure is the median block. GB/s is the algorithm bandwidth: bytes per rank per
operation (the buffer for allreduce; the rows each rank sends, its own share
included, for alltoallv) over seconds per operation. ``ratio`` is ours vs raw
speed, raw_time / ours_time, taken per repeat (the two blocks ran back to back,
under the same load) and then the median over repeats; higher is better, 1.0
means no overhead.

Only rank 0 prints: human-readable lines, then one JSON line last
(see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import comm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
from _bench_util import interleaved, medians, paired_ratio, seconds_per_call  # noqa: E402

ROW_DIM = 64  # float32 per alltoallv row
MB = 1 << 20
TARGET_RATIO = 0.8


@dataclass(kw_only=True, slots=True)
class Figure:
    """One measured operation: a name, its bytes per rank per call, and iterations per block."""

    name: str
    kind: str  # "allreduce" | "alltoallv"
    size: int  # float32 elements (allreduce) or rows (alltoallv) per rank
    iters: int

    def __post_init__(self) -> None:
        if self.kind not in ("allreduce", "alltoallv"):
            raise ValueError(f"figure {self.name}: unknown kind {self.kind!r}")
        if self.size <= 0 or self.iters <= 0:
            raise ValueError(
                f"figure {self.name}: size {self.size} and iters {self.iters} must be > 0"
            )

    @property
    def bytes(self) -> int:
        per = 4 if self.kind == "allreduce" else 4 * ROW_DIM
        return self.size * per


def figures(quick: bool) -> list[Figure]:
    # iters chosen so a block takes roughly 0.1-0.3 s on 2 cores
    full = [
        Figure(name="allreduce_1MB", kind="allreduce", size=1 * MB // 4, iters=200),
        Figure(name="allreduce_16MB", kind="allreduce", size=16 * MB // 4, iters=24),
        Figure(name="allreduce_64MB", kind="allreduce", size=64 * MB // 4, iters=5),
        Figure(name="alltoallv_10k_rows", kind="alltoallv", size=10_000, iters=200),
        Figure(name="alltoallv_100k_rows", kind="alltoallv", size=100_000, iters=20),
    ]
    if quick:
        for f in full:
            f.iters = max(1, f.iters // 4)
    return full


# ------------------------------------------------------------------ timing


def block_time(world: MPI.Comm, fn: Callable[[], object], iters: int) -> float:
    """Seconds per call over ``iters`` calls of ``fn`` after a barrier, max over ranks
    (no pickle: a typed buffer)."""
    world.Barrier()
    dt = np.array([seconds_per_call(fn, iters)])
    world.Allreduce(MPI.IN_PLACE, [dt, MPI.DOUBLE], MPI.MAX)
    return float(dt[0])


def measure(
    world: MPI.Comm, impls: dict[str, Callable[[], object]], iters: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per call of each implementation, one entry per repeat, blocks interleaved
    (the order rotated so that no one always goes first), after a warm-up block of each
    (buffers touched, protocols set up, caches filled)."""
    timer = functools.partial(block_time, world)
    return interleaved(impls, repeats, calls=iters, warmup=max(1, iters // 2), timer=timer)


# -------------------------------------------------------------- operations


def allreduce_impls(
    world: MPI.Comm, ours: comm.ProcessGroup, fast: comm.ProcessGroup, n: int
) -> dict[str, Callable[[], object]]:
    # Zeros stay zeros under repeated sums: no overflow, no denormals, same work.
    buf = torch.zeros(n, dtype=torch.float32)  # [n]
    view = buf.numpy()  # the same memory, for mpi4py

    return {
        "ours": lambda: ours.allreduce(buf),
        "raw": lambda: world.Allreduce(MPI.IN_PLACE, [view, MPI.FLOAT], MPI.SUM),
        "novalidate": lambda: fast.allreduce(buf),
    }


def alltoallv_impls(
    world: MPI.Comm, ours: comm.ProcessGroup, fast: comm.ProcessGroup, rows: int
) -> dict[str, Callable[[], object]]:
    size = world.Get_size()
    if rows % size:
        raise ValueError(f"alltoallv: {rows} rows do not split evenly over {size} ranks")
    splits = [rows // size] * size  # even splits: rows // size to every peer
    x = torch.randn(rows, ROW_DIM)  # [rows, 64]
    out = torch.empty_like(x)  # [rows, 64]: even splits receive as many as they send
    counts = [s * ROW_DIM for s in splits]  # in float32 elements
    displs = [i * counts[0] for i in range(size)]
    send_spec = [x.numpy(), (counts, displs), MPI.FLOAT]
    recv_spec = [out.numpy(), (counts, displs), MPI.FLOAT]

    return {
        "ours": lambda: ours.alltoallv(x, splits),
        "raw": lambda: world.Alltoallv(send_spec, recv_spec),
        "novalidate": lambda: fast.alltoallv(x, splits, splits),
    }


def check_same_results(world: MPI.Comm, ours: comm.ProcessGroup) -> None:
    """The two paths compute the same thing (a benchmark of a wrong answer is worthless)."""
    rank, size = world.Get_rank(), world.Get_size()
    a = torch.arange(1000, dtype=torch.float32) + rank
    b = a.clone()
    ours.allreduce(a)
    world.Allreduce(MPI.IN_PLACE, [b.numpy(), MPI.FLOAT], MPI.SUM)
    assert torch.equal(a, b), "allreduce: comm and mpi4py disagree"
    rows = 8 * size
    x = torch.arange(rows * ROW_DIM, dtype=torch.float32).reshape(rows, ROW_DIM) + 1000 * rank
    got = ours.alltoallv(x, [8] * size)
    want = torch.empty_like(x)
    c = [8 * ROW_DIM] * size
    d = [i * c[0] for i in range(size)]
    world.Alltoallv([x.numpy(), (c, d), MPI.FLOAT], [want.numpy(), (c, d), MPI.FLOAT])
    assert torch.equal(got, want), "alltoallv: comm and mpi4py disagree"


# --------------------------------------------------------------------- main


def mpi_version() -> str:
    name, version = MPI.get_vendor()
    return f"{name} {'.'.join(str(v) for v in version)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per figure")
    args = parser.parse_args()
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    ours = comm.init("mpi")  # the defaults a user gets: validate=True
    fast = comm.init("mpi", validate=False)
    assert ours.validate and not fast.validate
    check_same_results(world, ours)

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    say(
        f"comm vs mpi4py on {size} ranks ({mpi_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus), median of {repeats} blocks"
    )
    results: dict[str, dict[str, float]] = {}
    plan = figures(args.quick)
    for fig in plan:
        if fig.kind == "allreduce":
            impls = allreduce_impls(world, ours, fast, fig.size)
        else:
            impls = alltoallv_impls(world, ours, fast, fig.size)
        times = measure(world, impls, fig.iters, repeats)
        sec = medians(times)
        gbps = {k: fig.bytes / s / 1e9 for k, s in sec.items()}
        results[fig.name] = {
            "ours_GBps": round(gbps["ours"], 3),
            "raw_GBps": round(gbps["raw"], 3),
            "ratio": round(paired_ratio(times["raw"], times["ours"]), 3),
            "novalidate_GBps": round(gbps["novalidate"], 3),
            "novalidate_ratio": round(paired_ratio(times["raw"], times["novalidate"]), 3),
            "ours_ms": round(sec["ours"] * 1e3, 4),
            "raw_ms": round(sec["raw"] * 1e3, 4),
            "novalidate_ms": round(sec["novalidate"] * 1e3, 4),
        }
        r = results[fig.name]
        say(
            f"{fig.name:20s} {fig.bytes / MB:7.2f} MB/rank  ours {r['ours_GBps']:6.2f} GB/s "
            f"({r['ours_ms']:.3f} ms)  raw {r['raw_GBps']:6.2f} GB/s ({r['raw_ms']:.3f} ms)  "
            f"ratio {r['ratio']:.2f}  | validate=False {r['novalidate_GBps']:6.2f} GB/s "
            f"ratio {r['novalidate_ratio']:.2f}"
        )

    def worst(kind: str) -> dict[str, object]:
        value = min(v["ratio"] for k, v in results.items() if k.startswith(kind))
        return {"value": value, "target": TARGET_RATIO, "met": bool(value >= TARGET_RATIO)}

    report = {
        "bench": "comm",
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "backend": "mpi",
            "mpi": mpi_version(),
        },
        "config": {
            "ranks": size,
            "repeats": repeats,
            "iters": {f.name: f.iters for f in plan},
            "quick": bool(args.quick),
            "row_dim": ROW_DIM,
            "dtype": "float32",
            "GBps": "bytes per rank per op / median s per op",
            "ratio": "median over repeats of raw_s / ours_s, measured back to back",
        },
        "figures": results,
        "targets": {
            "allreduce_ratio_min": worst("allreduce"),
            "alltoallv_ratio_min": worst("alltoallv"),
        },
    }
    fast.close()
    ours.close()
    if rank == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
