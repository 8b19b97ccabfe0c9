"""AUC, log loss and the popularity baseline against brute-force definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridrec.train.click_metrics import average_ranks, log_loss, popularity_scores, roc_auc
from tolerance import assert_close, sum_tol


def _auc_pairs(y: np.ndarray, s: np.ndarray) -> float:
    """P(score of a random positive > that of a random negative), ties 1/2."""
    pos, neg = s[y == 1], s[y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pair_count_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 200)
    s = rng.integers(0, 15, 200).astype(np.float64)  # many ties
    # Bit for bit: both are the same exact count of half-integer wins (the rank sum and
    # the pair sum are exact in float64) divided by the same exact P * N, one rounding.
    assert roc_auc(y, s) == _auc_pairs(y, s)


def test_auc_extremes() -> None:
    y = np.array([0, 0, 1, 1])
    assert roc_auc(y, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(y, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert roc_auc(y, np.zeros(4)) == 0.5
    with pytest.raises(ValueError, match="both classes, got 0 positives and 3 negatives"):
        roc_auc(np.zeros(3), np.arange(3.0))


def test_average_ranks() -> None:
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_log_loss() -> None:
    y = np.array([1, 0, 1])
    p = np.array([0.9, 0.2, 0.5])
    want = -(math.log(0.9) + math.log(0.8) + math.log(0.5)) / 3
    # A mean of 3 terms of magnitude sum 3 * want: 3 roundings (two additions, the
    # division), and each log (numpy's SIMD one is not correctly rounded; math.log is)
    # within 4 ulp, i.e. 8 more roundings of at most the same magnitude.
    tol = sum_tol(torch.float64, 3 + 8, want)
    assert_close(log_loss(y, p), want, atol=tol, what="log loss", why="a mean of 3 logs")
    assert math.isfinite(log_loss(np.array([1]), np.array([0.0])))  # clipped


def test_popularity_scores_are_smoothed_click_rates() -> None:
    items = np.array([1, 1, 1, 2, 2, 3])
    labels = np.array([1, 1, 0, 0, 0, 1])
    rate = 0.5
    got = popularity_scores(items, labels, np.array([1, 2, 3, 7]), smoothing=2.0)
    want = [(2 + 2 * rate) / (3 + 2), (0 + 2 * rate) / (2 + 2), (1 + 2 * rate) / (1 + 2), rate]
    # Bit for bit: the same additions and divisions of the same exact counts and rate
    # (IEEE rounds each correctly, vectorised or not).
    assert got.tolist() == want
