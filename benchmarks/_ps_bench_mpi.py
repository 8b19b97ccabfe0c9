"""MPI store pull / push rows/s: 1 server rank, 1 worker rank (a part of ps_bench.py).

Run alone (prints human lines, then one JSON line, see benchmarks/README.md)::

    mpirun -n 2 python benchmarks/_ps_bench_mpi.py [--quick]

or call :func:`run` from a script that already runs under ``mpirun -n 2``.

What is measured, on one table of ``rows`` x 64 float32 (SGD), with requests of
``batch`` (10 000) unique ids drawn from a Zipf distribution over the rows:

* ``pull``: ``store.pull(table, ids)`` (rows and clocks back), one request in
  flight (each waited before the next is sent);
* ``pull_pipelined``: ``pull_async`` with ``depth`` requests in flight (a
  prefetching cache works like this: the next batches' rows are requested while
  the current one is used);
* ``push`` / ``push_pipelined``: ``push(table, ids, grads [batch, 64])`` the same
  two ways (the server applies SGD and bumps the clocks);
* ``inprocess_pull`` / ``inprocess_push``: the same requests on an
  :class:`ps.InProcessStore` in the worker process: what one server's table work
  costs without any messaging (a server does this work plus its side of the
  transfers, on one thread; pipelining lets the worker's side overlap it);
* ``steps``: training steps over ``step_tables`` tables of ``step_ids`` ids each
  (the Redis part's shape: 8 x 1 000 ids, dim 64, SGD): every table's pull then every
  table's push, one request per table (all issued, then waited) vs one batched
  ``pull_many`` / ``push_many`` (one message per server); steps/s of each and the
  messages per server and step (``requests_per_server_step``);
* ``server``: what one batched message of a DLRM step costs the server (26 tables x
  ~1 100 distinct Zipf ids, dim 16, row-wise Adagrad): its busy time per pull and per
  push message (``MPIStore.server_busy``: decoding, checks, the tables' work, the
  reply; not the transfers) beside the rows' own kernel time (the same gathers of rows
  and clocks, and the same row-wise Adagrad updates through ``ps.kernels``, on plain
  tensors in this process); ``server_overhead_us_per_message`` is the difference,
  averaged over the pull and the push message. Each table's ids are pushed sorted, as
  the cache and the hybrid tables push them (their rows are deduplicated by a sort);
  ``batched_pass_messages`` counts the messages the server served whole in C;
* ``counted_*``: plain and counted pushes at ``k = 1``, and the wire's bytes per
  pushed row of each (``_ps_bench_counted``);
* ``fp16_pull`` / ``fp16_push``: ``pull`` and ``push`` on an fp16 table of the same
  rows (rows and gradients travel in 16 bits), ``rw_*`` the batched pulls and pushes
  of a row-wise Adagrad pair (fp32, fp16), and ``fp16_mpi_*_speedup``, fp16 over fp32
  rows/s paired by round (``_ps_bench_narrow``);
* ``raw_sendrecv``: the ceiling of the transport: the server gathers the rows
  (``index_select``) and sends them with a plain ``Send`` to a ``Recv`` posted by
  the worker (the same bytes as a pull reply, no protocol, no checks); measured
  before the rest.

The six store figures are measured in turns (block of op A, block of B, ...,
``repeats`` rounds after a warm-up round); each figure is the median block;
rows/s counts requested rows (ids per request x requests / seconds). The server
runs with one torch thread (``ServerConfig.torch_threads``); ``main`` sets one
on the worker too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import comm
import ps
from ps.mpi.server import check_mpi_topology, serve_mpi
from ps.mpi.store import MPIStore

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
import _ps_bench_counted as counted  # noqa: E402
import _ps_bench_narrow as narrow  # noqa: E402
from _bench_util import interleaved, medians, reported, zipf_unique_batches  # noqa: E402

DIM = 64
BATCH = 10_000
TARGETS = {"mpi_pull_rows_s": 5e6, "mpi_push_rows_s": 2e6}
OVERHEAD_TARGET_US = 20.0  # server_overhead_us_per_message: at most


def _block(
    step: Callable[[int], None], iters: int, drain: Callable[[], None]
) -> Callable[[], None]:
    """One timed block: ``iters`` steps (step ``i`` picks its batch) plus the drain of what
    is still in flight."""

    def run() -> None:
        for i in range(iters):
            step(i)
        drain()

    return run


def _block_times(
    ops: dict[str, Callable[[int], None]], iters: int, repeats: int, drain: Callable[[], None]
) -> dict[str, list[float]]:
    """Block seconds per op, the ops taking turns (A B C, C B A, ...), after a warm-up block
    of each."""
    blocks = {name: _block(op, iters, drain) for name, op in ops.items()}
    return interleaved(blocks, repeats, warmup=1, order="alternate")


def run(
    group: comm.ProcessGroup,
    *,
    rows: int = 1_000_000,
    batch: int = BATCH,
    iters: int = 20,
    repeats: int = 5,
    depth: int = 4,
) -> dict[str, Any] | None:
    """Measure on a 2-rank MPI group (rank 0 worker, rank 1 server); rank 0 returns the
    result dict (``figures`` rows/s per op, ``config``), rank 1 returns None."""
    if group.size != 2:
        raise ValueError(f"the MPI store benchmark needs exactly 2 ranks, got {group.size}")
    topology = comm.Topology(world_size=2, num_servers=1)
    raw = check_mpi_topology(group, topology, "ps MPI benchmark").Dup()
    if topology.role(group.rank) is comm.Role.SERVER:
        _raw_server(raw, rows, batch, iters * (repeats + 1))
        serve_mpi(group, topology)
        raw.Free()
        return None
    figures: dict[str, float] = {"raw_sendrecv": _raw_worker(raw, batch, iters, repeats)}
    spec = ps.TableSpec(name="bench", num_rows=rows, dim=DIM, optimizer=ps.SGD(lr=0.01))
    batches = [torch.from_numpy(b) for b in zipf_unique_batches(rows, batch, 8)]
    grads = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(1)) * 1e-3
    local = ps.InProcessStore()  # the same work without MPI: the ceiling of one server
    local.create_table(spec)
    with MPIStore(group, topology) as store:
        store.create_table(spec)
        counted.create_tables(store, rows, DIM)
        narrow.create_tables(store, spec)
        inflight: deque[comm.Handle] = deque()

        def drain() -> None:
            while inflight:
                inflight.popleft().wait()

        def pipelined(issue: Callable[[int], comm.Handle]) -> Callable[[int], None]:
            def step(i: int) -> None:
                if len(inflight) >= depth:
                    inflight.popleft().wait()
                inflight.append(issue(i))

            return step

        def pull(on: ps.Store) -> Callable[[int], None]:
            def step(i: int) -> None:
                on.pull("bench", batches[i % 8])

            return step

        def push(on: ps.Store) -> Callable[[int], None]:
            return lambda i: on.push("bench", batches[i % 8], grads)

        fp16 = narrow.ops(store, batches, grads)
        ops: dict[str, Callable[[int], None]] = {
            "pull": pull(store),
            "fp16_pull": fp16["fp16_pull"],  # beside its fp32 twin, for the paired ratio
            "pull_pipelined": pipelined(lambda i: store.pull_async("bench", batches[i % 8])),
            "inprocess_pull": pull(local),
            "push": push(store),
            "fp16_push": fp16["fp16_push"],
            **{k: v for k, v in fp16.items() if k.startswith("rw_")},
            "push_pipelined": pipelined(lambda i: store.push_async("bench", batches[i % 8], grads)),
            "inprocess_push": push(local),
            **counted.push_ops(store, batches, grads),
        }
        times = _block_times(ops, iters, repeats, drain)
        for name, t in medians(times).items():
            figures[name] = batch * iters / t
        steps = _steps(store, rows, iters, repeats)
        server = _server_cost(store, rows, iters, repeats)
    raw.Free()
    return {
        "figures": {
            "rows_per_s": figures,
            "steps": steps,
            "server": server,
            "counted_k1_vs_plain": counted.ratios(times),
            "fp16_mpi": narrow.speedups(times),
            "wire_bytes_per_pushed_row": counted.wire_bytes_per_row(DIM, batch),
        },
        "config": {
            "rows": rows,
            "dim": DIM,
            "batch": batch,
            "zipf_a": 1.05,
            "iters": iters,
            "repeats": repeats,
            "depth": depth,
            "servers": 1,
            "workers": 1,
            "torch_threads": torch.get_num_threads(),
        },
    }


def _steps(
    store: MPIStore, rows: int, iters: int, repeats: int, tables: int = 8, ids: int = 1_000
) -> dict[str, Any]:
    """Multi-table steps, per table vs batched (see the module docstring)."""
    names = [f"step{k}" for k in range(tables)]
    for name in names:
        store.create_table(
            ps.TableSpec(name=name, num_rows=rows, dim=DIM, optimizer=ps.SGD(lr=0.01))
        )
    per = [zipf_unique_batches(rows, ids, 8, seed=k) for k in range(tables)]
    steps = [[torch.from_numpy(per[k][s]) for k in range(tables)] for s in range(8)]
    grads = torch.randn(ids, DIM, generator=torch.Generator().manual_seed(2)) * 1e-3

    def per_table(i: int) -> None:
        pairs = list(zip(names, steps[i % 8], strict=True))
        for h in [store.pull_async(n, t) for n, t in pairs]:
            h.wait()
        for h in [store.push_async(n, t, grads) for n, t in pairs]:
            h.wait()

    def batched(i: int) -> None:
        pairs = list(zip(names, steps[i % 8], strict=True))
        store.pull_many([ps.PullRequest(n, t) for n, t in pairs])
        store.push_many([ps.PushRequest(n, t, grads) for n, t in pairs])

    kinds: dict[str, Callable[[int], None]] = {"per_table": per_table, "batched": batched}
    messages = {}
    for kind, fn in kinds.items():  # warm-up, and the messages of one pass
        before = store.request_counts()
        for i in range(8):
            fn(i)
        after = store.request_counts()
        sent = sum(after[k] - before[k] for k in ("pull_messages", "push_messages"))
        messages[kind] = sent / after["servers"] / 8
    times = _block_times(kinds, iters, repeats, lambda: None)
    per_s = {kind: iters / t for kind, t in medians(times).items()}
    return {
        "config": {"tables": tables, "ids": ids, "dim": DIM, "optimizer": "sgd"},
        "steps_per_s": per_s,
        "requests_per_server_step": messages,
        "batched_vs_per_table": per_s["batched"] / per_s["per_table"],
    }


def _server_cost(
    store: MPIStore, rows: int, iters: int, repeats: int, tables: int = 26, ids: int = 1_100
) -> dict[str, Any]:
    """The server's busy time per batched message against the rows' kernel time (see the
    module docstring)."""
    from ps.kernels.rowwise_adagrad import rowwise_adagrad_
    from ps.local.table import table_array

    dim, lr, eps = 16, 0.05, 1e-8
    names = [f"cost{k}" for k in range(tables)]
    for name in names:
        store.create_table(
            ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=ps.RowWiseAdagrad(lr=lr))
        )
    per = [zipf_unique_batches(rows, ids, 8, seed=10 + k) for k in range(tables)]
    steps = [[torch.from_numpy(per[k][s]) for k in range(tables)] for s in range(8)]
    # [tables, ids, dim]: one block per table, as a message carries them
    grads = torch.randn(tables, ids, dim, generator=torch.Generator().manual_seed(3)) * 1e-3
    # the kernels' own tables, in the storage a server's tables have (ps.local.table)
    weights = [table_array((rows, dim), torch.float32) for _ in range(tables)]  # [R, D]
    for w in weights:
        w.copy_(torch.randn(rows, dim))
    accs = [table_array((rows, 1), torch.float32) for _ in range(tables)]  # [R, 1]
    ticks = [table_array((rows,), torch.int64) for _ in range(tables)]  # [R] clocks

    def pull(i: int) -> None:
        store.pull_many([ps.PullRequest(n, t) for n, t in zip(names, steps[i % 8], strict=True)])

    ordered = [[t.sort().values for t in step] for step in steps]  # as a cache pushes them

    def push(i: int) -> None:
        pairs = zip(names, ordered[i % 8], grads, strict=True)
        store.push_many([ps.PushRequest(n, t, g[: t.numel()]) for n, t, g in pairs])

    def kernel_pull(i: int) -> None:
        for w, c, t in zip(weights, ticks, steps[i % 8], strict=True):
            w.index_select(0, t), c.index_select(0, t)

    def kernel_push(i: int) -> None:
        for w, a, c, t, g in zip(weights, accs, ticks, ordered[i % 8], grads, strict=True):
            if not rowwise_adagrad_(w, a, c, t, g[: t.numel()], lr=lr, eps=eps):
                raise RuntimeError("the row-wise Adagrad C kernel is not available here")

    def busy_per_message(kind: str, fn: Callable[[int], None]) -> Callable[[], float]:
        """A block of ``iters`` messages; the server's busy seconds per message in it."""

        def run() -> float:
            before = store.server_busy()[0]
            for i in range(iters):
                fn(i)
            after = store.server_busy()[0]
            n = after[f"{kind}_messages"] - before[f"{kind}_messages"]
            return (after[f"{kind}_s"] - before[f"{kind}_s"]) / n

        return run

    for i in range(8):  # rows created, kernels built
        pull(i), push(i), kernel_pull(i), kernel_push(i)
    ops = {"pull": pull, "push": push}
    first = store.server_busy()[0]
    busy = interleaved(
        {kind: busy_per_message(kind, fn) for kind, fn in ops.items()},
        repeats,
        timer=reported,  # the server's clock, read from its counters
        warmup=0,
        order="fixed",
    )
    kernel = {
        kind: t / iters
        for kind, t in medians(
            _block_times({"pull": kernel_pull, "push": kernel_push}, iters, repeats, lambda: None)
        ).items()
    }
    last = store.server_busy()[0]
    sent = sum(last[f"{k}_messages"] - first[f"{k}_messages"] for k in ops)
    whole = last.get("batched_pass_messages", 0.0) - first.get("batched_pass_messages", 0.0)
    busy_us = {k: 1e6 * v for k, v in medians(busy).items()}
    kernel_us = {k: 1e6 * v for k, v in kernel.items()}
    overhead = {k: busy_us[k] - kernel_us[k] for k in busy_us}
    return {
        "config": {"tables": tables, "ids": ids, "dim": dim, "optimizer": "rowwise_adagrad"},
        "busy_us_per_message": busy_us,
        "kernel_us_per_message": kernel_us,
        "overhead_us_per_message": overhead,
        "batched_pass_messages": {"served_whole": whole, "sent": sent},
        "server_overhead_us_per_message": (overhead["pull"] + overhead["push"]) / 2,
    }


def _raw_server(raw: Any, rows: int, batch: int, count: int) -> None:
    from mpi4py import MPI

    table = torch.randn(rows, DIM)
    ids = [torch.from_numpy(b) for b in zipf_unique_batches(rows, batch, 8)]
    for i in range(count):
        out = table.index_select(0, ids[i % 8])
        raw.Send([out.numpy(), MPI.FLOAT], dest=0, tag=7)


def _raw_worker(raw: Any, batch: int, iters: int, repeats: int) -> float:
    from mpi4py import MPI

    buf = np.empty((batch, DIM), dtype=np.float32)

    def step(i: int) -> None:
        raw.Recv([buf, MPI.FLOAT], source=1, tag=7)

    # the warm-up block and the timed ones receive the iters * (repeats + 1) sends
    times = interleaved({"raw": _block(step, iters, lambda: None)}, repeats, warmup=1)
    return batch * iters / statistics.median(times["raw"])


def targets(
    figures: dict[str, float], server: dict[str, Any], fp16: dict[str, float]
) -> dict[str, dict[str, Any]]:
    """The benchmark's targets: rows/s met by the better of 1-in-flight and pipelined;
    the server's overhead per message; fp16 over fp32 rows/s (``fp16``)."""
    best = {
        "mpi_pull_rows_s": max(figures["pull"], figures["pull_pipelined"]),
        "mpi_push_rows_s": max(figures["push"], figures["push_pipelined"]),
    }
    out: dict[str, dict[str, Any]] = {
        name: {"value": value, "target": TARGETS[name], "met": value >= TARGETS[name]}
        for name, value in best.items()
    }
    over = server["server_overhead_us_per_message"]
    out["server_overhead_us_per_message"] = {
        "value": over,
        "target": OVERHEAD_TARGET_US,
        "met": over <= OVERHEAD_TARGET_US,
        "note": "us per 26-table message, busy "
        + str({k: round(v) for k, v in server["busy_us_per_message"].items()})
        + " less the rows' kernels "
        + str({k: round(v) for k, v in server["kernel_us_per_message"].items()}),
    }
    out.update(narrow.targets(fp16))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small table, few iterations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = comm.init("mpi")
    kw = {"rows": 100_000, "iters": 5, "repeats": 3} if args.quick else {}
    result = run(group, **kw)
    if result is None:
        return
    figures = result["figures"]["rows_per_s"]
    for name, value in figures.items():
        print(f"mpi {name:>16}: {value / 1e6:6.2f} M rows/s", file=sys.stderr)
    for name, value in result["figures"]["fp16_mpi"].items():
        print(f"mpi {name}: {value:.2f}", file=sys.stderr)
    out = {
        "bench": "ps_mpi",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "mpi"},
        "config": result["config"],
        "figures": result["figures"],
        "targets": targets(figures, result["figures"]["server"], result["figures"]["fp16_mpi"]),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
