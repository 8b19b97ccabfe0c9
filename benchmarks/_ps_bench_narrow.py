"""fp16 rows beside fp32 ones on the MPI store, for ``benchmarks/_ps_bench_mpi.py``.

A narrow table (``TableSpec.dtype`` "fp16") sends its rows and gradients in 16 bits on
the MPI wire (``docs/ps_protocol.md``): half the bytes of a pull reply and of a push.
This part measures what that buys end to end: the MPI part's fp32 table (64 columns,
SGD) and an fp16 table of the same rows, optimizer and initial values, pulled and
pushed with the same batches, one request in flight, in the same interleaved rounds
as the part's other figures. ``fp16_mpi_pull_speedup`` / ``fp16_mpi_push_speedup``:
fp16 rows/s over fp32 rows/s, the median over rounds of each round's fp32 / fp16
seconds (the two blocks of a round ran under the same load). Target: at least 1.5
each. The fp16 side includes what narrow rows cost besides the wire: the worker
rounds gradients to fp16 and widens pulled rows to float32, the server narrows rows
for the reply, widens gradients, and rounds updated rows stochastically
(``ps.rounding``), where an fp32 table writes them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from _bench_util import paired_ratio

import ps

TABLE = "bench_fp16"
TARGET = 1.5
#: Figure -> (the fp32 op, the fp16 op) of :func:`ops`, timed in the same rounds.
PAIRS = {
    "fp16_mpi_pull_speedup": ("pull", "fp16_pull"),
    "fp16_mpi_push_speedup": ("push", "fp16_push"),
}


def create_table(store: ps.Store, fp32: ps.TableSpec) -> None:
    """The fp16 twin of table ``fp32`` (same rows, optimizer and initial values)."""
    store.create_table(replace(fp32, name=TABLE, dtype="fp16"))


def ops(
    store: ps.Store, batches: Sequence[torch.Tensor], grads: torch.Tensor
) -> dict[str, Callable[[int], None]]:
    """``{figure: op(i)}``: pull, and push ``grads``, batch ``i % len(batches)`` of the fp16
    table, each request waited before the next (the MPI part's ``pull`` / ``push`` on
    the fp32 table)."""

    def pull(i: int) -> None:
        store.pull(TABLE, batches[i % len(batches)])

    def push(i: int) -> None:
        store.push(TABLE, batches[i % len(batches)], grads)

    return {"fp16_pull": pull, "fp16_push": push}


def speedups(times: dict[str, list[float]]) -> dict[str, float]:
    """fp16 rows/s / fp32 rows/s per figure of :data:`PAIRS`: the median over rounds of
    each round's fp32 seconds / fp16 seconds (same rows per block)."""
    return {name: paired_ratio(times[a], times[b]) for name, (a, b) in PAIRS.items()}


def targets(figures: dict[str, float]) -> dict[str, dict[str, object]]:
    """Each speedup against :data:`TARGET`."""
    return {
        name: {
            "value": figures[name],
            "target": TARGET,
            "met": figures[name] >= TARGET,
            "note": "fp16 / fp32 rows/s of one MPI table, dim 64, SGD, 1 request in flight",
        }
        for name in PAIRS
    }
