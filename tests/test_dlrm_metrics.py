"""AUC, log loss and the popularity baseline against brute-force definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridrec.metrics import average_ranks, log_loss, popularity_scores, roc_auc


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
    assert roc_auc(y, s) == pytest.approx(_auc_pairs(y, s), abs=1e-12)


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
    assert log_loss(y, p) == pytest.approx(want, rel=1e-12)
    assert math.isfinite(log_loss(np.array([1]), np.array([0.0])))  # clipped


def test_popularity_scores_are_smoothed_click_rates() -> None:
    items = np.array([1, 1, 1, 2, 2, 3])
    labels = np.array([1, 1, 0, 0, 0, 1])
    rate = 0.5
    got = popularity_scores(items, labels, np.array([1, 2, 3, 7]), smoothing=2.0)
    want = [(2 + 2 * rate) / (3 + 2), (0 + 2 * rate) / (2 + 2), (1 + 2 * rate) / (1 + 2), rate]
    assert got.tolist() == pytest.approx(want)
