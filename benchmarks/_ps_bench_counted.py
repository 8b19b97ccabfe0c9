"""Counted pushes at ``k = 1`` beside plain pushes, for ``benchmarks/ps_bench.py``.

A cache under a write bound pushes each row with its update count and the statistic
its optimizer needs (docs/cache.md, counted pushes); most of its rows carry one update.
This part measures what that costs a store: the same rows pushed with ``push_many`` as
a plain push and as a counted one with every count 1 (the statistic of one gradient:
``mean(g ** 2)`` per row for row-wise Adagrad, ``g ** 2`` per element for Adam), on a
table of each optimizer, in the same interleaved rounds as the store's other figures.
Target ``counted_push_k1_vs_plain``: counted rows/s at least 0.95x plain, on every
store and optimizer. Bytes per pushed row on the MPI wire, from its format
(``ps.mpi.wire``): the id (8) and the gradient (4 D), plus, counted, one byte of count
(counts up to 255; 8 above) and the statistic's 4 Q bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from _bench_util import paired_ratio

import ps
from ps import PushRequest
from ps.mpi import wire

#: Optimizers measured: table name -> optimizer (both adaptive: SGD pushes no statistic).
OPTIMIZERS: dict[str, ps.Optimizer] = {
    "counted_rowwise": ps.RowWiseAdagrad(lr=0.01),
    "counted_adam": ps.Adam(lr=0.001),
}
TARGET = 0.95


def create_tables(store: ps.Store, rows: int, dim: int) -> None:
    for name, opt in OPTIMIZERS.items():
        store.create_table(ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=opt))


def statistic(opt: ps.Optimizer, grads: torch.Tensor) -> torch.Tensor:
    """The statistic of one gradient per row ``[N, Q]``: what a cache sends at ``k = 1``."""
    q = opt.stat_dim(grads.shape[1])
    squares = grads * grads  # [N, D]
    return squares.mean(dim=1, keepdim=True) if q == 1 else squares


def push_ops(
    store: ps.Store, batches: Sequence[torch.Tensor], grads: torch.Tensor
) -> dict[str, Callable[[int], None]]:
    """``{figure: op(i)}``: push batch ``i % len(batches)`` to each table, plain and
    counted at ``k = 1`` (one ``push_many`` each, waited). The ids go sorted, as a
    cache pushes them (its rows are deduplicated by a sort)."""
    batches = [b.sort().values for b in batches]
    ones = torch.ones(grads.shape[0], dtype=torch.int64)
    ops: dict[str, Callable[[int], None]] = {}
    for name, opt in OPTIMIZERS.items():
        stats = statistic(opt, grads)

        def plain(i: int, name: str = name) -> None:
            store.push_many([PushRequest(name, batches[i % len(batches)], grads)])

        def counted(i: int, name: str = name, stats: torch.Tensor = stats) -> None:
            ids = batches[i % len(batches)]
            store.push_many([PushRequest(name, ids, grads, ones, stats)])

        ops[f"{name}_plain"] = plain
        ops[f"{name}_k1"] = counted
    return ops


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Counted at ``k = 1`` / plain rows/s per optimizer: the median over rounds of each
    round's plain / counted seconds (:func:`push_ops`' figures, timed in the same rounds),
    so the machine's drift between rounds cancels."""
    return {name: paired_ratio(times[f"{name}_plain"], times[f"{name}_k1"]) for name in OPTIMIZERS}


def wire_bytes_per_row(dim: int, batch: int) -> dict[str, dict[str, float]]:
    """Bytes per pushed row of a ``PUSH_MANY`` part of ``batch`` rows on the MPI wire
    (payload: ids, gradients and, counted, counts and statistics; the header and table
    of contents are per part, not per row)."""
    out = {}
    for name, opt in OPTIMIZERS.items():
        plain = 8 + 4 * dim  # an id word, the float32 gradient
        counts = 8 * wire.count_words(batch, False) / batch  # one byte each, padded
        counted = plain + counts + 4 * opt.stat_dim(dim)
        out[name] = {"plain": plain, "counted": counted, "growth": counted / plain - 1}
    return out
