"""The sampled softmax of hybridrec.seq.softmax against the full softmax and hand values.

* Every item a candidate, no negatives: the sampled loss and its gradients are the full
  softmax's (the same operations).
* ``log_q`` worked out by hand (in-batch counts plus ``N`` times the sampler's
  probability), and the loss against a hand-written cross entropy over corrected logits.
* The correction does what it is for: averaged over many draws of negatives, the
  corrected gradient is much closer to the full softmax's than the uncorrected one.
* The popularity sampler draws item ``i`` with probability ``max(count, floor) ** alpha``
  normalised (a chi-square bound over 200k draws), never an item of weight 0.
* The same generator state gives the same candidates; bad input names its value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from hybridrec.seq.softmax import (
    Candidates,
    NegativeSampler,
    candidates,
    full_softmax_loss,
    sampled_softmax_loss,
)
from tolerance import assert_close

pytestmark = pytest.mark.timeout(60)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def zipf(v: int) -> Tensor:
    """float64 [v]: item i's popularity, proportional to 1 / (i + 1)."""
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)
    return p / p.sum()


def grads(
    loss_of: Callable[[Tensor, Tensor], Tensor], hidden: Tensor, rows: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d rows)."""
    h = hidden.clone().requires_grad_(True)
    r = rows.clone().requires_grad_(True)
    loss = loss_of(h, r)
    loss.backward()
    assert h.grad is not None and r.grad is not None
    return loss.detach(), h.grad, r.grad


def sampled_of(cand: Candidates, correct: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """The sampled loss of ``cand`` as a function of (hidden, the whole table)."""

    def loss(h: Tensor, rows: Tensor) -> Tensor:
        return sampled_softmax_loss(h, rows[cand.ids], cand, correct=correct)

    return loss


# ---------------------------------------------------------------- sampled = full


@pytest.mark.parametrize("correct", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.07])
def test_every_item_a_candidate_is_the_full_softmax(correct: bool, temperature: float) -> None:
    """in_batch = all V items once, no negatives: ids = 0..V-1, log_q = log 1 = 0, and the
    sampled loss runs the full loss's operations (within 1e-6 relative)."""
    v, d, n = 50, 8, 20
    g = gen(0)
    rows, hidden = torch.randn(v, d, generator=g), torch.randn(n, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    sampler = NegativeSampler(num_items=v, negatives=0)
    cand = candidates(targets, sampler, None, in_batch=torch.arange(v))
    assert torch.equal(cand.ids, torch.arange(v)) and torch.equal(cand.target_index, targets)
    assert torch.equal(cand.log_q, torch.zeros(v))

    def sampled(h: Tensor, r: Tensor) -> Tensor:
        return sampled_softmax_loss(h, r[cand.ids], cand, correct=correct, temperature=temperature)

    def full(h: Tensor, r: Tensor) -> Tensor:
        return full_softmax_loss(h, r, targets, temperature=temperature)

    got, want = grads(sampled, hidden, rows), grads(full, hidden, rows)
    for what, a, b in zip(("loss", "d hidden", "d rows"), got, want, strict=True):
        scale = float(b.abs().max())
        assert_close(a, b, atol=1e-6 * scale, what=what, why="the same operations")
    assert got[0].shape == () and got[0].dtype == torch.float32


def test_loss_is_the_corrected_cross_entropy_by_hand() -> None:
    """The loss equals sum_j (logsumexp_c(z_jc) - z_j,t(j)), z = h r / T - log_q, written out."""
    g = gen(3)
    v, d, n = 30, 4, 6
    rows, hidden = torch.randn(v, d, generator=g), torch.randn(n, d, generator=g)
    targets = torch.tensor([1, 4, 4, 9, 1, 20])
    sampler = NegativeSampler(num_items=v, negatives=7)
    cand = candidates(targets, sampler, gen(4))
    t = 0.5
    loss = sampled_softmax_loss(hidden, rows[cand.ids], cand, temperature=t)
    want = 0.0
    for j in range(n):
        z = [
            float(hidden[j].double() @ rows[i].double()) / t - float(cand.log_q[c])
            for c, i in enumerate(cand.ids.tolist())
        ]
        pos = z[int(cand.target_index[j])]
        want += math.log(sum(math.exp(x) for x in z)) - pos
    assert_close(loss, want, atol=1e-5 * abs(want), what="loss", why="float32 against float64")
    half = sampled_softmax_loss(hidden.bfloat16(), rows[cand.ids].bfloat16(), cand)
    assert half.dtype == torch.float32  # accumulated in float32


# ---------------------------------------------------------------- log_q


def test_log_q_by_hand_uniform() -> None:
    """V=10, targets 3, 3, 5, N=4 uniform draws: Q = in-batch count + 4/10 per candidate."""
    targets = torch.tensor([3, 3, 5])
    sampler = NegativeSampler(num_items=10, negatives=4)
    cand = candidates(targets, sampler, gen(11))
    drawn = sampler.sample(gen(11))
    assert cand.ids.tolist() == sorted({3, 5, *drawn.tolist()})
    batch = {3: 2, 5: 1}
    want = [math.log(batch.get(i, 0) + 4 / 10) for i in cand.ids.tolist()]
    assert_close(cand.log_q, torch.tensor(want), atol=1e-6, what="log_q", why="float32 logs")
    assert cand.log_q.dtype == torch.float32
    assert cand.ids[cand.target_index].tolist() == [3, 3, 5]


def test_log_q_by_hand_popularity_and_global_batch() -> None:
    """Popularity weights max(count, floor) ** alpha; in_batch (the global batch) sets the
    in-batch counts, also for items that are not this rank's targets."""
    counts = torch.tensor([0, 1, 4, 9, 0, 16], dtype=torch.int64)
    sampler = NegativeSampler(num_items=6, negatives=3, kind="popularity", counts=counts, alpha=0.5)
    w = [1.0, 1.0, 2.0, 3.0, 1.0, 4.0]  # max(count, 1) ** 0.5
    assert_close(
        sampler.log_prob(torch.arange(6)),
        torch.tensor([math.log(x / 12) for x in w], dtype=torch.float64),
        atol=1e-15,
        what="log_prob",
    )
    targets = torch.tensor([2])
    everyone = torch.tensor([2, 0, 2, 5])  # the global batch's targets
    cand = candidates(targets, sampler, gen(5), in_batch=everyone)
    batch = {0: 1, 2: 2, 5: 1}
    want = [math.log(batch.get(i, 0) + 3 * w[i] / 12) for i in cand.ids.tolist()]
    assert_close(cand.log_q, torch.tensor(want), atol=1e-6, what="log_q", why="float32 logs")
    assert set(cand.ids.tolist()) >= {0, 2, 5} and cand.ids[cand.target_index].tolist() == [2]


def test_without_sampler_log_q_is_the_batch_count() -> None:
    cand = candidates(torch.tensor([7, 2, 7]), None, None, in_batch=torch.tensor([7, 2, 7, 7, 9]))
    assert cand.ids.tolist() == [2, 7, 9]
    assert_close(cand.log_q, torch.tensor([0.0, math.log(3), 0.0]), atol=1e-7, what="log_q")
    assert cand.target_index.tolist() == [1, 0, 1]


def test_accidental_hits_merge_into_the_positive() -> None:
    """With 3 items and 60 draws every item is drawn, targets included: each id is one
    column, so a draw of a position's target is its positive, never a separate negative."""
    cand = candidates(torch.tensor([0, 2]), NegativeSampler(num_items=3, negatives=60), gen(1))
    assert cand.ids.tolist() == [0, 1, 2] and cand.target_index.tolist() == [0, 2]


@pytest.mark.parametrize("kind", ["uniform", "popularity"])
def test_correction_brings_the_gradient_toward_the_full_softmax(kind: str) -> None:
    """Averaged over K = 100 draws of N = 200 negatives (V = 1000 Zipf-popular items, 128
    Zipf targets as in-batch negatives), the gradient with respect to the hidden vectors
    with the logQ correction has a relative error to the full softmax's gradient below
    0.2 and below 0.65 times the uncorrected one's (measured with these seeds: uniform
    0.086 vs 0.165, popularity 0.139 vs 0.251; what remains with the correction is the bias
    of the in-batch part and of the sampled softmax itself, not noise: it stays there at
    K = 400)."""
    v, d, n, negatives, draws = 1000, 16, 128, 200, 100
    g = gen(0)
    rows = torch.randn(v, d, generator=g)
    pop = zipf(v)
    counts = (pop * 100_000).round().to(torch.int64)
    targets = torch.multinomial(pop, n, replacement=True, generator=g)
    hidden = torch.randn(n, d, generator=g) * 0.5
    _, full, _ = grads(lambda h, r: full_softmax_loss(h, r, targets), hidden, rows)
    sampler = NegativeSampler(
        num_items=v,
        negatives=negatives,
        kind=kind,  # type: ignore[arg-type]
        counts=counts if kind == "popularity" else None,
    )
    errors = {}
    for correct in (True, False):
        g = gen(1000)
        mean = torch.zeros_like(full)
        for _ in range(draws):
            c = candidates(targets, sampler, g)
            _, dh, _ = grads(sampled_of(c, correct), hidden, rows)
            mean += dh / draws
        errors[correct] = float((mean - full).norm() / full.norm())
    assert errors[True] < 0.2, errors
    assert errors[True] < 0.65 * errors[False], errors


# ---------------------------------------------------------------- the sampler


def chi2_bound(dof: int, z: float = 4.75) -> float:
    """The chi-square quantile at about 1 - 1e-6 (z = 4.75 standard deviations), by the
    Wilson-Hilferty approximation ``k (1 - 2/(9k) + z sqrt(2/(9k)))**3``."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(("alpha", "floor"), [(1.0, 1.0), (0.75, 1.0), (1.0, 0.0), (0.0, 1.0)])
def test_popularity_frequencies_follow_the_counts(alpha: float, floor: float) -> None:
    """200k draws: Pearson's chi-square of the item counts against max(count, floor) **
    alpha, over the items of positive weight, below its 1 - 1e-6 quantile (~55.5 for 19
    degrees of freedom); items of weight 0 (count 0 with floor 0) never drawn."""
    v, draws = 20, 200_000
    counts = torch.randint(0, 50, (v,), generator=gen(2))
    counts[[3, 11]] = 0
    sampler = NegativeSampler(
        num_items=v, negatives=draws, kind="popularity", counts=counts, alpha=alpha, floor=floor
    )
    ids = sampler.sample(gen(9))
    assert ids.shape == (draws,) and ids.dtype == torch.int64
    seen = torch.bincount(ids, minlength=v).double()
    w = counts.double().clamp_min(floor) ** alpha
    p = w / w.sum()
    assert_close(sampler.log_prob(torch.arange(v)).exp(), p, atol=1e-15, what="log_prob")
    live = p > 0
    assert float(seen[~live].sum()) == 0.0, "an item of weight 0 was drawn"
    expected = draws * p[live]
    chi2 = float(((seen[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    assert chi2 < chi2_bound(dof), (chi2, chi2_bound(dof), dof)


def test_uniform_frequencies() -> None:
    v, draws = 20, 200_000
    ids = NegativeSampler(num_items=v, negatives=draws).sample(gen(8))
    seen = torch.bincount(ids, minlength=v).double()
    chi2 = float(((seen - draws / v) ** 2 / (draws / v)).sum())
    assert chi2 < chi2_bound(v - 1), chi2


@pytest.mark.parametrize("kind", ["uniform", "popularity"])
def test_same_generator_state_same_candidates(kind: str) -> None:
    counts = torch.arange(100, dtype=torch.int64)
    sampler = NegativeSampler(
        num_items=100,
        negatives=30,
        kind=kind,  # type: ignore[arg-type]
        counts=counts if kind == "popularity" else None,
    )
    targets = torch.tensor([5, 17, 99])
    a, b = candidates(targets, sampler, gen(42)), candidates(targets, sampler, gen(42))
    for x, y in ((a.ids, b.ids), (a.log_q, b.log_q), (a.target_index, b.target_index)):
        assert torch.equal(x, y)
    other = candidates(targets, sampler, gen(43))
    assert not torch.equal(a.ids, other.ids)
    g = gen(7)
    first, second = sampler.sample(g), sampler.sample(g)  # the generator moves on
    assert not torch.equal(first, second)
    assert torch.equal(first, sampler.sample(gen(7)))


# ---------------------------------------------------------------- errors


def test_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"targets not in in_batch: \[8\] \(1 of 2 targets\)"):
        candidates(torch.tensor([1, 8]), None, None, in_batch=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="negatives must be >= 0, got -3"):
        NegativeSampler(num_items=10, negatives=-3)
    with pytest.raises(ValueError, match=r"unknown kind 'zipf'; expected one of"):
        NegativeSampler(num_items=10, negatives=3, kind="zipf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_items must be >= 1, got 0"):
        NegativeSampler(num_items=0, negatives=3)
    with pytest.raises(ValueError, match="alpha must be finite and >= 0, got -1"):
        NegativeSampler(num_items=10, negatives=3, alpha=-1.0)
    with pytest.raises(ValueError, match="needs counts"):
        NegativeSampler(num_items=10, negatives=3, kind="popularity")
    with pytest.raises(ValueError, match=r"counts must be int64 \[10\], got torch.int64 \[9\]"):
        NegativeSampler(num_items=10, negatives=3, kind="popularity", counts=torch.ones(9).long())
    zeros = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"every weight is 0 \(all counts 0 and floor=0.0\)"):
        NegativeSampler(num_items=4, negatives=3, kind="popularity", counts=zeros, floor=0.0)
    with pytest.warns(UserWarning, match="counts are ignored with kind='uniform'"):
        NegativeSampler(num_items=4, negatives=3, counts=zeros)
    sampler = NegativeSampler(num_items=10, negatives=3)
    with pytest.raises(ValueError, match=r"targets must be item ids in \[0, 10\), got \[2, 10\]"):
        candidates(torch.tensor([2, 10]), sampler, gen(0))
    with pytest.raises(ValueError, match="generator is None"):
        candidates(torch.tensor([2]), sampler, None)
    with pytest.raises(ValueError, match="temperature must be finite and > 0, got 0.0"):
        cand = Candidates(
            ids=torch.arange(2),
            log_q=torch.zeros(2),
            target_index=torch.zeros(1, dtype=torch.int64),
        )
        sampled_softmax_loss(torch.zeros(1, 3), torch.zeros(2, 3), cand, temperature=0.0)
    with pytest.raises(ValueError, match=r"cand_rows \[C=2, D\], got \[1, 3\] and \[3, 3\]"):
        sampled_softmax_loss(torch.zeros(1, 3), torch.zeros(3, 3), cand)
