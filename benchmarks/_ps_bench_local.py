"""In-process store pull/push rows/s beside a raw numpy gather, for ``benchmarks/ps_bench.py``.

What one call of :func:`bench_local` measures, in one process, side by side:

* ``numpy_gather``: ``weights_np[ids]`` on a float32 ``[rows, dim]`` array (the
  ceiling the store is measured against), and ``numpy_take``: ``np.take(weights_np, ids, axis=0)``
  (numpy's faster gather of the same rows), and ``torch_index_select`` (torch's
  gather, OpenMP-parallel: the store gathers with ``np.take`` instead, which does
  not stall when the machine's cores are oversubscribed);
* ``local_pull``: ``store.pull(table, ids)`` of a fixed table of the same shape
  (validation, lock, rows and clocks, a completed handle);
* ``local_push``: ``store.push(table, ids, grads)`` with SGD, and with
  row-wise Adagrad (``local_push_adagrad``);
* ``dynamic_pull`` / ``dynamic_push``: the same on a dynamic table
  (``num_rows=None``) that already holds every id of the batches (hash index
  lookups instead of direct indexing; SGD);
* ``counted_*``: plain and counted pushes at ``k = 1`` (``_ps_bench_counted``).

Ids: batches of ``batch`` distinct ids, drawn Zipf(``zipf_a``) over the rows
(popularity ranks scattered over the table by a fixed permutation), the first
``batch`` distinct draws in order of appearance. Each repeat runs every
figure once over all batches, in a rotating order (A B C, B C A, ...); a
figure's rows/s is total rows over the median repeat time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import ps

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
import _ps_bench_counted as counted  # noqa: E402
from _bench_util import interleaved, medians, repeated, zipf_unique_batches  # noqa: E402


def bench_local(
    rows: int = 1_000_000,
    dim: int = 64,
    batch: int = 10_000,
    repeats: int = 7,
    n_batches: int = 10,
    zipf_a: float = 1.05,
    seed: int = 0,
    threads: int | None = None,
) -> dict[str, object]:
    """Measure; returns ``{"config": ..., "figures": {name: rows_per_s}, "ratios": ...}``.

    ``threads``: ``torch.set_num_threads`` for the run (restored afterwards); None
    keeps the process's setting. It only matters for torch's parallel ops (the
    optimizer math of pushes, ``torch_index_select``); the store's gathers and
    scatters are single-threaded numpy.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(rows, dim, batch, repeats, n_batches, zipf_a, seed)
    finally:
        torch.set_num_threads(before)


def _bench(
    rows: int, dim: int, batch: int, repeats: int, n_batches: int, zipf_a: float, seed: int
) -> dict[str, object]:
    batches_np = zipf_unique_batches(rows, batch, n_batches, zipf_a, seed)
    batches = [torch.from_numpy(b) for b in batches_np]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(batch, dim, generator=gen) * 1e-3 for _ in batches]

    store = ps.InProcessStore()
    init = ps.UniformInit(low=-0.01, high=0.01, seed=seed)
    for name, opt in (("sgd", ps.SGD(lr=0.01)), ("adagrad", ps.RowWiseAdagrad(lr=0.01))):
        spec = ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=opt, init=init)
        store.create_table(spec)
    store.create_table(
        ps.TableSpec(name="dyn", num_rows=None, dim=dim, optimizer=ps.SGD(lr=0.01), init=init)
    )
    counted.create_tables(store, rows, dim)
    for ids, g in zip(batches, grads, strict=True):  # create every row the batches touch
        store.push("dyn", ids, g)
    weights_np = store.pull("sgd", torch.arange(rows)).rows.numpy()  # [rows, dim] float32
    weights_t = torch.from_numpy(weights_np)

    def over_batches(op: Callable[[int], object]) -> Callable[[], None]:
        return repeated(op, len(batches))

    figures: dict[str, Callable[[], None]] = {
        "numpy_gather": over_batches(lambda i: weights_np[batches_np[i]]),
        "numpy_take": over_batches(lambda i: np.take(weights_np, batches_np[i], axis=0)),
        "torch_index_select": over_batches(lambda i: weights_t.index_select(0, batches[i])),
        "local_pull": over_batches(lambda i: store.pull("sgd", batches[i])),
        "local_push": over_batches(lambda i: store.push("sgd", batches[i], grads[i])),
        "local_push_adagrad": over_batches(lambda i: store.push("adagrad", batches[i], grads[i])),
        "dynamic_pull": over_batches(lambda i: store.pull("dyn", batches[i])),
        "dynamic_push": over_batches(lambda i: store.push("dyn", batches[i], grads[i])),
    }
    for name, op in counted.push_ops(store, batches, grads[0]).items():
        figures[name] = over_batches(op)
    times = interleaved(figures, repeats, warmup=1, order="rotate")
    total = batch * len(batches)
    rows_s = {n: total / t for n, t in medians(times).items()}
    ceiling = max(rows_s["numpy_gather"], rows_s["numpy_take"])
    return {
        "config": {
            "rows": rows,
            "dim": dim,
            "batch": batch,
            "batches": n_batches,
            "repeats": repeats,
            "zipf_a": zipf_a,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        },
        "figures": rows_s,
        "ratios": {
            "pull_vs_numpy_gather": rows_s["local_pull"] / rows_s["numpy_gather"],
            "pull_vs_best_numpy": rows_s["local_pull"] / ceiling,
        },
        "counted_k1_vs_plain": counted.ratios(times),
    }


if __name__ == "__main__":
    import json
    import sys

    quick = "--quick" in sys.argv
    threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else None
    out = bench_local(
        rows=200_000 if quick else 1_000_000, repeats=3 if quick else 7, threads=threads
    )
    for name, v in out["figures"].items():  # type: ignore[union-attr]
        print(f"{name:20s} {v / 1e6:8.2f} M rows/s", file=sys.stderr)
    print(json.dumps(out))
