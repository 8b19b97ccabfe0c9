"""AUC, log loss, normalized entropy, calibration, sliced reports and the popularity
baseline against brute-force definitions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.train.click_metrics import (
    average_ranks,
    calibration,
    click_report,
    log_loss,
    normalized_entropy,
    popularity_scores,
    roc_auc,
)
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


def _entropy_by_sum(y: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Log loss and the base rate's entropy, each as a plain Python loop over samples."""
    loss = -sum(math.log(q) if t else math.log(1 - q) for t, q in zip(y, p, strict=True))
    rate = sum(y) / len(y)
    ent = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return loss / len(y), ent


@pytest.mark.parametrize("seed", [0, 1])
def test_normalized_entropy_and_calibration_match_their_definitions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 500)
    p = rng.uniform(0.05, 0.95, 500)
    loss, ent = _entropy_by_sum(y, p)
    # numpy's pairwise sum and the Python loop add the same 500 terms in another order.
    tol = sum_tol(torch.float64, 500, abs(loss)) / ent + 1e-15
    assert_close(normalized_entropy(y, p), loss / ent, atol=tol, what="NE", why="500 terms")
    # Predicting the base rate for everyone scores exactly 1 (up to the log's rounding).
    base = np.full(500, y.mean())
    assert_close(normalized_entropy(y, base), 1.0, atol=1e-12, what="NE of the base rate",
                 why="the same log twice, summed")  # fmt: skip
    want = (p.sum() / 500) / (y.sum() / 500)
    assert_close(calibration(y, p), want, atol=sum_tol(torch.float64, 500, want),
                 what="calibration", why="500 terms")  # fmt: skip
    assert calibration(y, y.astype(np.float64)) == 1.0
    with pytest.raises(ValueError, match="both classes, got a base rate of 0.0 over 3 labels"):
        normalized_entropy(np.zeros(3), np.full(3, 0.5))
    with pytest.raises(ValueError, match="needs positives, got none in 3 labels"):
        calibration(np.zeros(3), np.full(3, 0.5))


def test_click_report_per_slice_equals_each_slice_alone() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 300)
    p = rng.uniform(0.01, 0.99, 300)
    gender = rng.choice(np.array(["F", "M"]), 300)
    y[gender == "F"] = 0  # one slice with no click: its AUC and NE have no value
    p_f = p.copy()
    report = click_report(y, p_f, gender)
    assert report["count"] == 300 and report["auc"] == roc_auc(y, p)
    assert report["ne"] == normalized_entropy(y, p) and report["logloss"] == log_loss(y, p)
    slices = report["slices"]
    assert isinstance(slices, dict) and list(slices) == ["F", "M"]
    m = gender == "M"
    assert slices["M"]["auc"] == roc_auc(y[m], p[m]) and slices["M"]["count"] == int(m.sum())
    assert slices["M"]["calibration"] == calibration(y[m], p[m])
    assert slices["F"]["auc"] is None and slices["F"]["ne"] is None
    assert slices["F"]["calibration"] is None and slices["F"]["positives"] == 0
    ints = click_report(y, p, torch.as_tensor(m.astype(np.int64)))["slices"]
    assert isinstance(ints, dict) and list(ints) == ["0", "1"]
    with pytest.raises(ValueError, match="300 labels but 2 slice values"):
        click_report(y, p, np.zeros(2))


@pytest.mark.timeout(120)
def test_the_window_scores_the_last_steps_of_every_rank(tmp_path: Path) -> None:
    """The metrics file's windowed training AUC is the AUC of the last N steps' samples:
    replayed here from the same predictions, through a window that drops older steps."""
    from comm import LocalGroup
    from hybridrec.train.metric_window import ClickWindow

    window = ClickWindow(3)
    gen = torch.Generator().manual_seed(0)
    steps = [(torch.randn(50, generator=gen), torch.randint(0, 2, (50,), generator=gen).float())
             for _ in range(5)]  # fmt: skip
    for logits, labels in steps:
        window.add(logits, labels)
    got = window.report(LocalGroup())
    probs = torch.cat([torch.sigmoid(lg) for lg, _ in steps[2:]])
    labels = torch.cat([y for _, y in steps[2:]])
    assert got["window_samples"] == 150.0
    assert got["train_auc"] == roc_auc(labels, probs)
    assert got["train_ne"] == normalized_entropy(labels, probs)
    assert got["train_calibration"] == calibration(labels, probs)
    with pytest.raises(ValueError, match="needs >= 1 step, got 0"):
        ClickWindow(0)


@pytest.mark.timeout(240)
def test_step_lines_carry_the_windowed_metrics(tmp_path: Path) -> None:
    import json

    import comm
    from hybridrec.dlrm.config import DLRMJobConfig
    from hybridrec.dlrm.job import train

    out = tmp_path / "m.jsonl"
    train(DLRMJobConfig(data="synthetic", synthetic_samples=2_000, synthetic_rows=200,
                        batch_size=100, epochs=1, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
                        verbose=False, progress=False, log_every=5, metrics_window=4,
                        metrics_out=str(out)), comm.LocalGroup())  # fmt: skip
    lines = [json.loads(s) for s in out.read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step"]
    assert steps and all(r["window_samples"] == 400 for r in steps)  # 4 steps x 100
    assert all(0.0 <= r["train_auc"] <= 1.0 and r["train_ne"] > 0 for r in steps)
    train(DLRMJobConfig(data="synthetic", synthetic_samples=2_000, synthetic_rows=200,
                        batch_size=100, epochs=1, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
                        verbose=False, progress=False, log_every=5, metrics_window=0,
                        metrics_out=str(tmp_path / "off.jsonl")), comm.LocalGroup())  # fmt: skip
    off = [json.loads(s) for s in (tmp_path / "off.jsonl").read_text().splitlines()]
    assert not any("train_auc" in r for r in off)
