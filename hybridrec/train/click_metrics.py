"""Click-prediction metrics in plain numpy: ROC AUC and log loss."""

from __future__ import annotations

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
