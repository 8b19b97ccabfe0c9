"""fp16 rows beside fp32 ones on the MPI store, for ``benchmarks/_ps_bench_mpi.py``.

A narrow table (``TableSpec.dtype`` "fp16") sends its rows and gradients in 16 bits on
the MPI wire (``docs/ps_protocol.md``): half the bytes of a pull reply and of a push.
This part measures what that buys end to end, fp16 against fp32 tables of the same
rows, optimizer and initial values, pulled and pushed with the same batches, one
request in flight, in the same interleaved rounds as the part's other figures; each
speedup is fp16 rows/s over fp32 rows/s, the median over rounds of each round's fp32 /
fp16 seconds (the two blocks of a round ran under the same load):

* ``fp16_mpi_pull_speedup`` / ``fp16_mpi_push_speedup`` (target at least 1.5 each):
  the jobs' path, row-wise Adagrad tables (the jobs' default) pulled and pushed in
  batched messages (``pull_many`` / ``push_many``), which the server serves in its C
  message pass (narrow rows copied as stored; a push widened, stepped in float32 and
  rounded stochastically);
* ``fp16_mpi_single_sgd_pull_speedup`` / ``..._push_speedup`` beside them: the MPI
  part's own single-table ``pull`` / ``push`` of an SGD table against an fp16 twin,
  which the server serves in Python (the C pass steps row-wise Adagrad only).

The fp16 side includes what narrow rows cost besides the wire: the worker rounds
gradients to fp16 and widens pulled rows to float32, and the server rounds updated rows
stochastically (``ps.rounding``), where an fp32 table writes them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from _bench_util import paired_ratio

import ps

SGD_TWIN = "bench_fp16"
ROWWISE = {"fp32": "bench_rw_fp32", "fp16": "bench_rw_fp16"}
TARGET = 1.5
#: Figure -> (the fp32 op, the fp16 op) of :func:`ops`, timed in the same rounds.
PAIRS = {
    "fp16_mpi_pull_speedup": ("rw_pull", "rw_fp16_pull"),
    "fp16_mpi_push_speedup": ("rw_push", "rw_fp16_push"),
    "fp16_mpi_single_sgd_pull_speedup": ("pull", "fp16_pull"),
    "fp16_mpi_single_sgd_push_speedup": ("push", "fp16_push"),
}
#: The figures with a target.
TARGETED = ("fp16_mpi_pull_speedup", "fp16_mpi_push_speedup")


def create_tables(store: ps.Store, fp32: ps.TableSpec) -> None:
    """The fp16 twin of table ``fp32`` (same rows, optimizer and initial values), and a
    row-wise Adagrad pair (fp32, fp16) of its rows and initial values."""
    store.create_table(replace(fp32, name=SGD_TWIN, dtype="fp16"))
    for dtype, name in ROWWISE.items():
        rw = replace(fp32, name=name, optimizer=ps.RowWiseAdagrad(lr=0.01), dtype=dtype)
        store.create_table(replace(rw, init=fp32.init))


def ops(
    store: ps.Store, batches: Sequence[torch.Tensor], grads: torch.Tensor
) -> dict[str, Callable[[int], None]]:
    """``{op: op(i)}`` on batch ``i % len(batches)``, each request waited before the
    next: the fp16 SGD twin's single ``pull`` / ``push`` (beside the MPI part's own on
    the fp32 table) and both row-wise Adagrad tables' batched ones."""
    n = len(batches)

    def single(op: str) -> Callable[[int], None]:
        if op == "pull":
            return lambda i: store.pull(SGD_TWIN, batches[i % n])
        return lambda i: store.push(SGD_TWIN, batches[i % n], grads)

    def batched(table: str, op: str) -> Callable[[int], None]:
        if op == "pull":
            return lambda i: store.pull_many([ps.PullRequest(table, batches[i % n])])
        return lambda i: store.push_many([ps.PushRequest(table, batches[i % n], grads)])

    out = {"fp16_pull": single("pull"), "fp16_push": single("push")}
    for op in ("pull", "push"):
        out[f"rw_{op}"] = batched(ROWWISE["fp32"], op)
        out[f"rw_fp16_{op}"] = batched(ROWWISE["fp16"], op)
    return out


def speedups(times: dict[str, list[float]]) -> dict[str, float]:
    """fp16 rows/s / fp32 rows/s per figure of :data:`PAIRS`: the median over rounds of
    each round's fp32 seconds / fp16 seconds (same rows per block)."""
    return {name: paired_ratio(times[a], times[b]) for name, (a, b) in PAIRS.items()}


def targets(figures: dict[str, float]) -> dict[str, dict[str, object]]:
    """Each targeted speedup against :data:`TARGET`."""
    return {
        name: {
            "value": figures[name],
            "target": TARGET,
            "met": figures[name] >= TARGET,
            "note": "fp16 / fp32 rows/s of one MPI table's batched messages, dim 64, "
            "row-wise Adagrad, 1 request in flight",
        }
        for name in TARGETED
    }
