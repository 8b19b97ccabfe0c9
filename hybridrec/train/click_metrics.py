"""Click-prediction metrics in plain numpy: what recommender teams report.

* :func:`roc_auc`: the ranking quality (0.5 chance, 1 perfect);
* :func:`log_loss`: mean binary cross-entropy in nats per sample;
* :func:`normalized_entropy`: log loss over the entropy of the base rate (NE, as in
  "Practical Lessons from Predicting Clicks on Ads at Facebook", He et al. 2014): 1 is
  what always predicting the observed click rate scores, lower is better; unlike log
  loss it compares across data sets with other click rates;
* :func:`calibration`: mean predicted over observed click rate (1 is calibrated);
* :func:`click_report`: all of them on one set of predictions, also per value of a
  slice column (``{"auc", "logloss", "ne", "calibration", "count", "positives"}``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _np(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy().reshape(-1)
    return np.asarray(x, dtype=np.float64).reshape(-1)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x`` (``[n]``), ties sharing their average rank."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Start index of each run of equal values, and the run each sorted item is in.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])  # [G]
    ends = np.r_[starts[1:], len(x)]  # [G] exclusive
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    run = np.repeat(np.arange(len(starts)), ends - starts)  # [n]
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = avg[run]
    return ranks


def roc_auc(labels: np.ndarray | torch.Tensor, scores: np.ndarray | torch.Tensor) -> float:
    """Area under the ROC curve by the rank statistic (Mann-Whitney U).

    AUC = (sum of the positives' ranks - P(P+1)/2) / (P * N): the probability that a
    random positive scores above a random negative, ties counting one half.
    """
    y = _np(labels)
    s = _np(scores)
    if y.shape != s.shape:
        raise ValueError(f"roc_auc: {y.shape[0]} labels but {s.shape[0]} scores")
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"roc_auc needs both classes, got {n_pos} positives and {n_neg} negatives")
    ranks = average_ranks(s)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(
    labels: np.ndarray | torch.Tensor, probs: np.ndarray | torch.Tensor, eps: float = 1e-7
) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` (clipped to [eps, 1-eps])."""
    y = _np(labels)
    p = np.clip(_np(probs), eps, 1.0 - eps)
    if y.shape != p.shape:
        raise ValueError(f"log_loss: {y.shape[0]} labels but {p.shape[0]} probabilities")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def popularity_scores(
    train_items: np.ndarray | torch.Tensor,
    train_labels: np.ndarray | torch.Tensor,
    items: np.ndarray | torch.Tensor,
    smoothing: float = 10.0,
) -> np.ndarray:
    """Each item's training click rate, smoothed toward the global rate.

    ``score(i) = (clicks_i + smoothing * rate) / (views_i + smoothing)``; an item
    never seen in training gets the global rate.
    """
    ti = _np(train_items).astype(np.int64)
    ty = _np(train_labels)
    q = _np(items).astype(np.int64)
    size = int(max(ti.max(initial=0), q.max(initial=0))) + 1
    views = np.bincount(ti, minlength=size).astype(np.float64)
    clicks = np.bincount(ti, weights=ty, minlength=size)
    rate = float(ty.mean()) if len(ty) else 0.5
    return ((clicks + smoothing * rate) / (views + smoothing))[q]


# The metrics a report gives as numbers (validation rows as val_<name>, the DLRM result
# as test_<name>, the training window as train_<name>): ROC AUC, log loss (nats per
# sample), normalized entropy and calibration.
CLICK_METRICS = ("auc", "logloss", "ne", "calibration")


def metric_values(report: dict[str, Any]) -> dict[str, float]:
    """:data:`CLICK_METRICS` of a :func:`click_report` as floats, NaN where one has no
    value (AUC and NE of a one-class set, anything of an empty one)."""
    return {k: float("nan") if report[k] is None else float(report[k]) for k in CLICK_METRICS}


def _binary_entropy(rate: float) -> float:
    """Entropy in nats of a Bernoulli(``rate``) label."""
    return float(-(rate * np.log(rate) + (1.0 - rate) * np.log(1.0 - rate)))


def normalized_entropy(
    labels: np.ndarray | torch.Tensor, probs: np.ndarray | torch.Tensor, eps: float = 1e-7
) -> float:
    """Log loss (:func:`log_loss`, the same clipping) over the entropy of the labels'
    base rate; ValueError when the labels hold one class only (zero entropy)."""
    y = _np(labels)
    rate = float(y.mean()) if len(y) else 0.0
    if not 0.0 < rate < 1.0:
        raise ValueError(
            f"normalized_entropy needs both classes, got a base rate of {rate} over {len(y)} labels"
        )
    return log_loss(y, probs, eps) / _binary_entropy(rate)


def calibration(labels: np.ndarray | torch.Tensor, probs: np.ndarray | torch.Tensor) -> float:
    """Mean predicted probability over the observed click rate; ValueError without
    positives (the observed rate is 0)."""
    y, p = _np(labels), _np(probs)
    if y.shape != p.shape:
        raise ValueError(f"calibration: {y.shape[0]} labels but {p.shape[0]} probabilities")
    clicks = float(y.sum())
    if clicks <= 0.0:
        raise ValueError(f"calibration needs positives, got none in {len(y)} labels")
    return float(p.sum() / clicks)  # (sum p / n) / (sum y / n): the n cancels


def _report(y: np.ndarray, p: np.ndarray) -> dict[str, float | int | None]:
    """The metrics of one set; those a one-class set has no value for are None."""
    positives = int((y > 0.5).sum())
    both = 0 < positives < len(y)
    return {
        "count": len(y),
        "positives": positives,
        "auc": roc_auc(y, p) if both else None,
        "logloss": log_loss(y, p) if len(y) else None,
        "ne": normalized_entropy(y, p) if both else None,
        "calibration": calibration(y, p) if positives else None,
    }


def click_report(
    labels: np.ndarray | torch.Tensor,
    probs: np.ndarray | torch.Tensor,
    slices: np.ndarray | torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every metric of this module on ``probs`` (``[n]``, probabilities) against
    ``labels`` (``[n]``, 0/1); with ``slices`` (``[n]``, a column's value per sample), the
    same per distinct value under ``"slices"`` (``{str(value): metrics}``, values in
    ascending order). A slice with one class has ``auc`` and ``ne`` None, not an error: a
    small slice of a held-out set often has no click."""
    y, p = _np(labels), _np(probs)
    if y.shape != p.shape:
        raise ValueError(f"click_report: {y.shape[0]} labels but {p.shape[0]} probabilities")
    report: dict[str, Any] = dict(_report(y, p))
    if slices is not None:
        s = slices.detach().cpu().numpy().reshape(-1) if isinstance(slices, torch.Tensor) else (
            np.asarray(slices).reshape(-1)
        )  # fmt: skip
        if s.shape != y.shape:
            raise ValueError(f"click_report: {y.shape[0]} labels but {s.shape[0]} slice values")
        values, which = np.unique(s, return_inverse=True)
        report["slices"] = {
            str(v.item() if hasattr(v, "item") else v): _report(y[which == i], p[which == i])
            for i, v in enumerate(values)
        }
    return report
