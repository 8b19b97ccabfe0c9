"""The loss of a next-item recommender: softmax over a sampled set of candidate items.

A sequence model gives one hidden vector per predicted position, ``hidden [n, D]``; the
position's target is an item id in ``0..V-1``. The item table ``[V, D]`` (tied: the
model's input table too) lives in an embedding collection that may be local, sharded or
in a parameter server, so nothing here touches it: the caller fetches the rows of
``Candidates.ids`` and passes them in.

One step::

    cand = candidates(targets, sampler, gen, in_batch=global_targets)
    #   ids          [C]  distinct, sorted: global_targets ∪ sampler draws
    #   log_q        [C]  log expected count of each id in the candidate draw
    #   target_index [n]  position of each target in ids
    rows = lookup(cand.ids)                           # [C, D], from the collection
    loss = sampled_softmax_loss(hidden, rows, cand)   # 0-d: sum over the n positions
    (loss / global_positions).backward()

The candidates of a position are every in-batch item (the targets of the whole global
batch, so data-parallel ranks share one candidate set; give every rank the same
generator state too, e.g. seeded from the step) plus ``negatives`` items drawn by a
:class:`NegativeSampler` (mixed negative sampling: Yang et al., WWW 2020). The positive
column of a position is its target's; every other column is a negative for it, including
another position's target (the usual in-batch softmax). Candidates are deduplicated: a
sampled item equal to the position's own target *is* its positive column (an "accidental
hit" cannot appear as a separate negative), and an item in the batch several times, or
drawn several times, is one column; the logQ correction accounts for the copies.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

SAMPLER_KINDS = ("uniform", "popularity")


@dataclass(kw_only=True, slots=True)
class NegativeSampler:
    """Draws ``negatives`` item ids per step, with replacement, from ``0..num_items-1``.

    * ``kind="uniform"``: every item with probability ``1 / num_items``.
    * ``kind="popularity"``: item ``i`` with probability ``w_i / sum(w)``, where
      ``w_i = max(counts[i], floor) ** alpha``; ``counts`` int64 ``[num_items]`` are the
      items' training counts. ``alpha = 1`` follows the counts, ``0.75`` flattens them
      (word2vec's choice), ``0`` is uniform. The floor: an item never seen in training
      (count 0) is drawn as often as one seen ``floor`` times, by default once, so every
      item can be a negative; ``floor=0`` never draws unseen items (with ``alpha > 0``).

    Drawing is inverse-CDF sampling on a float64 cumulative sum (no category limit, unlike
    ``torch.multinomial``'s 2**24), on the generator's device; the same generator state
    gives the same ids.
    """

    num_items: int
    negatives: int
    kind: Literal["uniform", "popularity"] = "uniform"
    alpha: float = 1.0
    counts: Tensor | None = None
    floor: float = 1.0
    # The popularity weights' cumulative sum (float64 [V]) per device, built on first use.
    _cdf: dict[torch.device, Tensor] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )
    _log_w: Tensor | None = field(init=False, default=None, repr=False, compare=False)
    _last: int = field(init=False, default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError(f"NegativeSampler: num_items must be >= 1, got {self.num_items}")
        if self.negatives < 0:
            raise ValueError(f"NegativeSampler: negatives must be >= 0, got {self.negatives}")
        if self.kind not in SAMPLER_KINDS:
            raise ValueError(
                f"NegativeSampler: unknown kind {self.kind!r}; expected one of {SAMPLER_KINDS}"
            )
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"NegativeSampler: alpha must be finite and >= 0, got {self.alpha}")
        if not (math.isfinite(self.floor) and self.floor >= 0):
            raise ValueError(f"NegativeSampler: floor must be finite and >= 0, got {self.floor}")
        if self.kind == "uniform":
            if self.counts is not None:
                warnings.warn(
                    "NegativeSampler: counts are ignored with kind='uniform'", stacklevel=3
                )
            return
        counts = self.counts
        if counts is None:
            raise ValueError("NegativeSampler: kind='popularity' needs counts (int64 [num_items])")
        if counts.dtype != torch.int64 or tuple(counts.shape) != (self.num_items,):
            raise ValueError(
                f"NegativeSampler: counts must be int64 [{self.num_items}], got "
                f"{counts.dtype} {list(counts.shape)}"
            )
        if counts.numel() and int(counts.min()) < 0:
            raise ValueError(f"NegativeSampler: counts must be >= 0, got min {int(counts.min())}")
        w = counts.to(torch.float64).clamp_min(self.floor).pow(self.alpha)  # [V]
        positive = torch.nonzero(w > 0).flatten()
        if positive.numel() == 0:
            raise ValueError(
                f"NegativeSampler: every weight is 0 (all counts 0 and floor={self.floor})"
            )
        cdf = torch.cumsum(w, 0)
        self._cdf[cdf.device] = cdf
        self._log_w = torch.log(w) - torch.log(cdf[-1])  # log probability per item
        self._last = int(positive[-1])

    def sample(self, generator: torch.Generator) -> Tensor:
        """``negatives`` ids, int64 ``[N]``, drawn with replacement on ``generator.device``."""
        device = generator.device
        if self.kind == "uniform":
            return torch.randint(
                0, self.num_items, (self.negatives,), generator=generator, device=device
            )
        cdf = self._cdf.get(device)
        if cdf is None:
            cdf = self._cdf[device] = next(iter(self._cdf.values())).to(device)
        u = torch.rand(self.negatives, generator=generator, dtype=torch.float64, device=device)
        # First i with cdf[i] > u * total: item i has the interval [cdf[i-1], cdf[i]), so an
        # item of weight 0 (empty interval) is never drawn; u * total may round up to the
        # total, hence the clamp to the last item of positive weight.
        ids = torch.searchsorted(cdf, u * cdf[-1], right=True)
        return ids.clamp_max_(self._last)

    def log_prob(self, ids: Tensor) -> Tensor:
        """float64 ``[n]``: log probability that one draw gives ``ids[j]`` (``-inf`` for an
        item that is never drawn)."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_items):
            raise ValueError(
                f"NegativeSampler.log_prob: ids must be in [0, {self.num_items}), got "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        if self.kind == "uniform":
            return torch.full(
                ids.shape, -math.log(self.num_items), dtype=torch.float64, device=ids.device
            )
        assert self._log_w is not None
        return self._log_w.to(ids.device)[ids]


@dataclass(kw_only=True, frozen=True, slots=True)
class Candidates:
    """The columns of one step's sampled softmax.

    ``ids`` int64 ``[C]``: the distinct candidate item ids, sorted: the in-batch items
    ∪ the sampler's draws.

    ``log_q`` float32 ``[C]``: ``log Q_i``, the log of item ``i``'s expected number of
    copies in the candidate draw, ``Q_i = b_i + N * p_i``, where ``b_i`` is how many times
    ``i`` occurs in ``in_batch`` and ``p_i`` the sampler's probability of ``i`` in one of
    its ``N`` draws (``N * p_i = 0`` without a sampler). Why: the candidates are a draw of
    ``B + N`` items, ``B`` from the data (the batch's targets, whose items occur in
    proportion to their popularity; the batch's own count ``b_i`` is the estimate of its
    expectation that is at hand) and ``N`` from the sampler. Training with a softmax over
    such a draw favours items drawn often: its normaliser ``sum_{j in draw} exp(s_j)``
    weighs item ``j`` by its number of copies, ``Q_j`` in expectation, where the full
    softmax weighs every item once. Logits ``s_j - log Q_j`` undo that, so that
    ``sum_{j in draw} exp(s_j - log Q_j)`` estimates ``sum_{all j} exp(s_j)``
    (importance sampling: Bengio and Senécal 2008; Jean et al. 2015; the logQ correction
    of Yi et al., RecSys 2019, "Sampling-bias-corrected neural modeling for large corpus
    item recommendations", where ``Q`` comes from streaming frequency estimates). The
    estimate is unbiased for the draw as a multiset, one column per copy; here copies
    share one column, which counts an item drawn more than once only once: a small
    under-weighting where ``Q_i`` is near or above 1 (the popular head; in-batch items
    have ``b_i >= 1``), nothing where ``Q_i`` is small. The value does not depend on how
    many copies were actually drawn: ``log_q`` is a function of the ids alone.

    ``target_index`` int64 ``[n]``: the column of each target, ``ids[target_index] ==
    targets``.
    """

    ids: Tensor
    log_q: Tensor
    target_index: Tensor


def _check_ids(name: str, ids: Tensor, num_items: int | None) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"candidates: {name} must be int64 [n], got {ids.dtype} {list(ids.shape)}")
    if num_items is not None and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_items:
            raise ValueError(
                f"candidates: {name} must be item ids in [0, {num_items}), got [{lo}, {hi}]"
            )


def candidates(
    targets: Tensor,
    sampler: NegativeSampler | None,
    generator: torch.Generator | None,
    *,
    in_batch: Tensor | None = None,
) -> Candidates:
    """The candidate set of one step: ``in_batch`` (default ``targets``) ∪ ``sampler``'s draws.

    ``targets`` int64 ``[n]``: this rank's targets; each must occur in ``in_batch``.
    ``in_batch`` int64 ``[B]``: the items whose rows are in-batch negatives, with their
    repeats (they set ``log_q``); pass the global batch's targets so that data-parallel
    ranks build the same candidates. ``generator`` drives the sampler (may be None when
    there is no sampler or it draws 0). The result lives on ``targets``' device.
    """
    num_items = sampler.num_items if sampler is not None else None
    _check_ids("targets", targets, num_items)
    batch = targets if in_batch is None else in_batch
    _check_ids("in_batch", batch, num_items)
    batch = batch.to(targets.device)
    batch_ids, batch_counts = torch.unique(batch, sorted=True, return_counts=True)
    missing = targets[~torch.isin(targets, batch_ids)]
    if missing.numel():
        shown = torch.unique(missing)[:8].tolist()
        raise ValueError(
            f"candidates: targets not in in_batch: {shown} ({missing.numel()} of "
            f"{targets.numel()} targets); in_batch must hold every target"
        )
    drawn = sampler is not None and sampler.negatives > 0
    if drawn:
        if generator is None:
            raise ValueError("candidates: the sampler draws negatives but generator is None")
        assert sampler is not None
        sampled = sampler.sample(generator).to(targets.device)
        ids = torch.unique(torch.cat([batch_ids, sampled]), sorted=True)  # [C]
    else:
        ids = batch_ids
    # b_i: the in-batch count of each candidate (0 for items only drawn).
    b = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
    b[torch.searchsorted(ids, batch_ids)] = batch_counts.to(torch.float64)
    if drawn:
        assert sampler is not None
        b += sampler.negatives * torch.exp(sampler.log_prob(ids))
    return Candidates(
        ids=ids,
        log_q=torch.log(b).to(torch.float32),
        target_index=torch.searchsorted(ids, targets),
    )


def _compute_dtype(*ts: Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64: never accumulate in half precision."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def sampled_softmax_loss(
    hidden: Tensor,
    cand_rows: Tensor,
    cand: Candidates,
    *,
    correct: bool = True,
    temperature: float = 1.0,
) -> Tensor:
    """Sum over the ``n`` positions of the cross entropy over the ``C`` candidates.

    ``hidden [n, D]``, ``cand_rows [C, D]`` (the rows of ``cand.ids``, in that order).
    Logits ``hidden @ cand_rows.T / temperature``, minus ``cand.log_q`` when ``correct``
    (see :class:`Candidates`); the positive of position ``j`` is column
    ``cand.target_index[j]``. Computed in float32 (float64 if an input is). Returns a
    0-d tensor: the sum, which the caller divides by the global number of positions.
    """
    _check_temperature(temperature)
    c = cand.ids.numel()
    if hidden.dim() != 2 or cand_rows.dim() != 2 or cand_rows.shape != (c, hidden.shape[1]):
        raise ValueError(
            f"sampled_softmax_loss: hidden must be [n, D] and cand_rows [C={c}, D], got "
            f"{list(hidden.shape)} and {list(cand_rows.shape)}"
        )
    if cand.target_index.shape != (hidden.shape[0],):
        raise ValueError(
            f"sampled_softmax_loss: {hidden.shape[0]} hidden rows but "
            f"{cand.target_index.numel()} targets in cand"
        )
    dt = _compute_dtype(hidden, cand_rows)
    logits = hidden.to(dt) @ cand_rows.to(dt).T / temperature  # [n, C]
    if correct:
        logits = logits - cand.log_q.to(dt)
    return F.cross_entropy(logits, cand.target_index, reduction="sum")


def full_softmax_loss(
    hidden: Tensor, item_rows: Tensor, targets: Tensor, *, temperature: float = 1.0
) -> Tensor:
    """Sum over the ``n`` positions of the cross entropy over every item.

    ``hidden [n, D]``, ``item_rows [V, D]`` (the whole table), ``targets`` int64 ``[n]``;
    the same arithmetic as :func:`sampled_softmax_loss` with every item a candidate.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or item_rows.dim() != 2 or item_rows.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"full_softmax_loss: hidden must be [n, D] and item_rows [V, D], got "
            f"{list(hidden.shape)} and {list(item_rows.shape)}"
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"full_softmax_loss: {hidden.shape[0]} hidden rows but targets {list(targets.shape)}"
        )
    dt = _compute_dtype(hidden, item_rows)
    logits = hidden.to(dt) @ item_rows.to(dt).T / temperature  # [n, V]
    return F.cross_entropy(logits, targets, reduction="sum")
