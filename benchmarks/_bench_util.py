"""Helpers shared by the benchmarks: Zipf id batches, a timer, a CPU job beside a bench."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

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


class ZipfDraws:
    """Batches of ids drawn WITH repeats from a Zipf(``a``) law truncated to ``rows`` ids.

    Rank ``k`` (1-based) has probability ``k**-a / H`` (``H`` = sum over ``1..rows``);
    ranks are scattered over the ids by a seeded permutation per table, so hot ids are
    not neighbours in memory. ``batch(step)`` gives, for every table, the sorted
    distinct ids of ``draws`` draws (a Criteo-shaped sparse feature: one id per
    sample per table, hot ids repeat); it depends only on ``(seed, step)``, so runs
    that compare two systems can draw the same batches lazily.

    ``expected_distinct(top)`` is the analytic number of distinct ids per batch, in
    all and outside the ``top`` most popular ids: ``sum_k 1 - (1 - p_k)**draws``.
    """

    def __init__(self, rows: int, draws: int, tables: int = 1, a: float = 1.05, seed: int = 0):
        if rows < 1 or draws < 1 or tables < 1:
            raise ValueError(
                f"ZipfDraws: rows, draws, tables must be >= 1, got {rows, draws, tables}"
            )
        self.rows, self.draws, self.tables, self.a, self.seed = rows, draws, tables, a, seed
        p = np.arange(1, rows + 1, dtype=np.float64) ** -a
        self.p = p / p.sum()  # [rows] probability of rank k + 1
        self.cdf = np.cumsum(self.p)
        rng = np.random.default_rng(seed)
        self.scatter = [rng.permutation(rows).astype(np.int64) for _ in range(tables)]

    def batch(self, step: int) -> list[np.ndarray]:
        """``tables`` sorted int64 arrays of the distinct ids drawn at ``step``."""
        rng = np.random.default_rng((self.seed, step))
        u = rng.random((self.tables, self.draws))
        ranks = np.minimum(np.searchsorted(self.cdf, u), self.rows - 1)  # [T, draws]
        return [np.unique(self.scatter[t][ranks[t]]) for t in range(self.tables)]

    def expected_distinct(self, top: int) -> tuple[float, float]:
        """``(all, outside the top ids)``: expected distinct ids in one table's batch."""
        seen = -np.expm1(self.draws * np.log1p(-self.p))  # [rows] P(rank drawn at least once)
        return float(seen.sum()), float(seen[top:].sum())


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# What --under-load runs beside a bench: another user's CPU job, two torch threads of
# matrix products (it never finishes by itself; the context manager stops it).
_LOAD = """
import torch
torch.set_num_threads({threads})
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


@contextlib.contextmanager
def cpu_load(threads: int = 2) -> Iterator[None]:
    """A ``threads``-thread CPU job in another process for the block (started, given a
    moment to spin up, always killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOAD.format(threads=threads)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        if proc.poll() is not None:
            raise RuntimeError(f"the --under-load CPU job exited at once (code {proc.returncode})")
        yield
    finally:
        proc.kill()
        proc.wait()
