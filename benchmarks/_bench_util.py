"""Helpers shared by the benchmarks: Zipf id batches, the interleaved timing loop, a CPU
job beside a bench."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import numpy as np

R = TypeVar("R")
T = TypeVar("T")


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


# ---------------------------------------------------------------- the timing loop
#
# Every benchmark that compares variants times them in turns, round after round, so that
# the machine's load drifting (other jobs, clock speed, caches) hits every variant alike,
# and reports medians of the rounds; a ratio of two variants can be taken per round (the
# two blocks ran back to back) and then the median. :func:`interleaved` is that loop.

#: How the variants take turns: ``"rotate"`` starts round ``r`` at variant ``r % n``
#: (A B C, B C A, C A B: every variant runs in every position, after every other one);
#: ``"alternate"`` reverses every other round (A B C, C B A); ``"fixed"`` keeps one order.
Order = Literal["rotate", "alternate", "fixed"]


def seconds_per_call(
    fn: Callable[[], object],
    calls: int = 1,
    *,
    sync: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call over ``calls`` calls of ``fn`` on ``clock``. ``sync`` (a device's
    synchronize) runs before the clock starts and before it stops, so work queued on the
    device counts in the block that queued it."""
    if sync is not None:
        sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    if sync is not None:
        sync()
    return (clock() - t0) / calls


def reported(fn: Callable[[], R], calls: int) -> R:
    """A timer for variants that measure themselves (a block timed inside, a job's own step
    time, a counter's change): what one call returns."""
    if calls != 1:
        raise ValueError(f"reported: a self-measuring variant is called once, not {calls} times")
    return fn()


def round_order(names: Sequence[str], r: int, order: Order) -> list[str]:
    """The variants of round ``r`` in the order they run (see :data:`Order`)."""
    names = list(names)
    if order == "rotate":
        k = r % len(names) if names else 0
        return names[k:] + names[:k]
    if order == "alternate":
        return names if r % 2 == 0 else names[::-1]
    if order == "fixed":
        return names
    raise ValueError(f"round_order: unknown order {order!r}")


@overload
def interleaved(
    variants: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    calls: int = ...,
    warmup: int = ...,
    order: Order = ...,
    before_round: Callable[[int], object] | None = ...,
    after_round: Callable[[int, dict[str, list[float]]], object] | None = ...,
) -> dict[str, list[float]]: ...


@overload
def interleaved(
    variants: Mapping[str, Callable[[], R]],
    rounds: int,
    *,
    timer: Callable[[Callable[[], R], int], T],
    calls: int = ...,
    warmup: int = ...,
    order: Order = ...,
    before_round: Callable[[int], object] | None = ...,
    after_round: Callable[[int, dict[str, list[T]]], object] | None = ...,
) -> dict[str, list[T]]: ...


def interleaved(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    timer: Callable[[Callable[[], Any], int], Any] = seconds_per_call,
    calls: int = 1,
    warmup: int = 1,
    order: Order = "rotate",
    before_round: Callable[[int], object] | None = None,
    after_round: Callable[[int, dict[str, list[Any]]], object] | None = None,
) -> dict[str, list[Any]]:
    """``{name: [one figure per round]}``: the variants timed in turns for ``rounds``
    rounds, ``calls`` calls of a variant per timed block.

    ``timer(fn, calls)`` measures one block; the default is :func:`seconds_per_call`
    (seconds per call on the host clock). A benchmark passes its own for a barrier and
    the max over ranks, CUDA events, a device synchronize, or :func:`reported` for
    variants that measure themselves. First every variant runs one block of ``warmup``
    calls through the same timer, in the order given, its figure dropped (through the
    timer so that ranks stay matched in their collectives and work in flight is waited
    for); ``warmup=0`` skips it. ``before_round(r)`` runs untimed before round ``r``
    (e.g. to build its batches), ``after_round(r, times)`` after it (e.g. a progress line).
    """
    if rounds < 0 or calls < 1 or warmup < 0:
        raise ValueError(
            "interleaved: needs rounds >= 0, calls >= 1, warmup >= 0; "
            f"got {rounds}, {calls}, {warmup}"
        )
    if warmup:
        for fn in variants.values():
            timer(fn, warmup)
    times: dict[str, list[Any]] = {name: [] for name in variants}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for name in round_order(list(variants), r, order):
            times[name].append(timer(variants[name], calls))
        if after_round is not None:
            after_round(r, times)
    return times


def repeated(op: Callable[[int], object], n: int) -> Callable[[], None]:
    """One timed figure: ``op(i)`` for ``i`` in ``0 .. n - 1`` (each of ``n`` batches)."""

    def run() -> None:
        for i in range(n):
            op(i)

    return run


def medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each variant's rounds."""
    return {name: statistics.median(t) for name, t in times.items()}


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median over rounds of ``num[r] / den[r]``. Both blocks of a round ran back to
    back under the same load, so the median of per-round ratios is steadier on a shared
    machine than a ratio of medians."""
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


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
