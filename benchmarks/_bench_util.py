"""Helpers shared by the parameter-server benchmarks: Zipf id batches, a timer."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def zipf_unique_batches(
    rows: int, batch: int, n_batches: int, a: float = 1.05, seed: int = 0
) -> list[np.ndarray]:
    """``n_batches`` int64 arrays of ``batch`` distinct Zipf(``a``) ids in ``[0, rows)``.

    Popularity ranks are scattered over the table by a seeded permutation, so hot
    ids are not neighbours in memory; ids keep the order of their first draw.
    """
    if batch > rows:
        raise ValueError(f"zipf_unique_batches: batch {batch} > rows {rows}")
    rng = np.random.default_rng(seed)
    scatter = rng.permutation(rows).astype(np.int64)  # popularity rank -> id
    out = []
    for _ in range(n_batches):
        seen = np.empty(0, dtype=np.int64)
        while seen.size < batch:
            more = scatter[(rng.zipf(a, size=4 * batch) - 1) % rows]
            drawn = np.concatenate([seen, more])
            _, first = np.unique(drawn, return_index=True)
            seen = drawn[np.sort(first)]
        out.append(seen[:batch].copy())
    return out


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
