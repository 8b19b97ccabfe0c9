"""How the planner's calibration measures: the row width and ids it times with, the
timing statistic, and the least-squares fits of times to a cost law."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hybridrec.plan.costs import Linear
from hybridrec.plan.idlaw import ZipfSampler

DIM = 16  # row width every per-row cost is timed at


def ids_of(rng: np.random.Generator, law: str, rows: int, n: int) -> np.ndarray:
    """``n`` ids of a table of ``rows`` rows: "uniform", else Zipf(1.2)."""
    if law == "uniform":
        return rng.integers(0, rows, n)
    return ZipfSampler(rows, 1.2).draw(rng, n)


def timed(fn: Callable[[], object], reps: int, warm: int = 2, quantile: float = 0.5) -> float:
    """Seconds of ``fn()``: the median (``quantile``) of ``reps`` calls after ``warm``.

    The median is the statistic the validation takes of the job's steps. Operations
    between processes (a PS round trip, a collective) are timed at the lower quartile
    instead (:mod:`hybridrec.plan.mpi_probe`): each waits for another process to be
    scheduled, and on a machine shared with other work their median can be that wait,
    many times the cost, for a whole calibration."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.quantile(out, quantile))


def fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least-squares coefficients (clipped at 0) of ``times ~ rows @ coef``."""
    a = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if (coef < 0).any():  # refit without the negative terms (a cost is never negative)
        keep = coef >= 0
        coef = np.zeros_like(coef)
        if keep.any():
            sub, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            coef[keep] = np.maximum(sub, 0.0)
    return [float(c) for c in coef]


def fit_linear(points: list[tuple[float, float, float]]) -> Linear:
    """``(count, amount, seconds)`` points -> :class:`Linear`."""
    alpha, beta = fit([[c, a] for c, a, _ in points], [s for _, _, s in points])
    return Linear(alpha_s=alpha, beta_s=beta)
