"""How far two float computations of the same quantity may be apart, and why.

Every numeric comparison in the suite is one of three kinds:

* **Bit-exact** (:func:`assert_same`): only where both sides run the same operations in
  the same order on tensors of the same layout, so the same kernels produce the same
  bits on any CPU. A fused multiply-add (ATen's vectorised kernels use one on AVX2 and
  AVX-512, its scalar kernels and numpy do not), a reduction in another order, or a
  BLAS call on another alignment breaks that, so a bit-exact check must not straddle
  two of those.
* **One sum in two orders** (:func:`sum_tol`): two evaluations of a sum of ``terms``
  terms whose absolute values add up to ``magnitude``, differing only in the order of
  the additions (or the rounding of the products). Each is within ``gamma_n * magnitude``
  of the exact sum, ``gamma_n = n u / (1 - n u)`` with the unit roundoff ``u = eps / 2``
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4 and
  Lemma 3.1), so they are within twice that of each other. This is a worst case, not an
  estimate: a check at this tolerance cannot fail by rounding on any CPU.
* **A training run replayed** (:func:`replay_tol`): several steps through nonlinear
  layers and adaptive optimizers, where a rounding difference in one step is amplified
  by the next ones (Adam's ``m / sqrt(v)`` turns a relative error in a gradient near zero
  into an absolute one of up to ``lr``) and no useful closed-form bound exists. There
  the rounding error of the computation is *measured*: the fp32 reference's distance
  to a float64 replay of the same computation (same seeds, same data, every tensor in
  float64) is how much fp32 rounding moves the result on this machine. A second fp32
  run of the same computation in another order (other ranks, other kernels) is about
  as far from the exact result, so the two differ by at most a small multiple of it.
  :data:`REPLAY_FACTOR` = 4: 2 from the triangle inequality (each fp32 run is one error
  away from the exact result), times 2 because the run under test may round more than
  the reference (its reductions over ranks add a rounding level per sum).

Two derived bounds complete them for the dense tests: :func:`cross_entropy_tol` (two
evaluations of a mean cross entropy, e.g. fused and vocabulary-parallel) with
:func:`cross_entropy_grad_tol`, and :class:`AdamDrift` (how far Adam moves a weight when
its gradients are off by a known amount: ``2 lr d / eps`` per step).

:func:`assert_close` compares with ``torch.testing.assert_close`` at a given absolute
tolerance and no relative one (the tolerance already carries the magnitudes), naming
what was compared and the tolerance's reason in the message.
"""

from __future__ import annotations

import math

import torch

# How many times its own measured rounding error two fp32 runs of one computation may
# differ (see the module docstring).
REPLAY_FACTOR = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one rounding in ``dtype``."""
    return float(torch.finfo(dtype).eps) / 2.0


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of ``n``
    consecutive roundings (e.g. a recursive sum of ``n + 1`` terms)."""
    nu = max(int(n), 0) * unit_roundoff(dtype)
    if nu >= 1.0:
        raise ValueError(f"gamma_{n} undefined in {dtype}: n * u = {nu:.3g} >= 1")
    return nu / (1.0 - nu)


def sum_tol(dtype: torch.dtype, terms: int, magnitude: float) -> float:
    """Two evaluations of a sum of ``terms`` terms (any order, products rounded or
    fused) whose absolute values add up to ``magnitude``: at most this far apart.

    Each evaluation is within ``gamma_{terms} * magnitude`` of the exact sum (one
    rounding per addition plus one per product), so the two are within twice that."""
    return 2.0 * gamma(terms, dtype) * float(magnitude)


def replay_tol(
    ref: torch.Tensor, ref64: torch.Tensor, *, floor_terms: int = 1, factor: float = REPLAY_FACTOR
) -> float:
    """The tolerance for a fp32 run against the fp32 reference ``ref`` of the same
    computation, from the reference's own rounding error ``|ref - ref64|`` (``ref64``: the
    same computation replayed in float64), times ``factor``.

    The measured error can be zero by chance on a tiny tensor; the tolerance is never
    below :func:`sum_tol` of ``floor_terms`` terms of the reference's magnitude (the
    error of the last operation alone)."""
    if ref.shape != ref64.shape:
        raise ValueError(f"reference shapes differ: {tuple(ref.shape)} vs {tuple(ref64.shape)}")
    measured = float((ref.double() - ref64.double()).abs().max()) if ref.numel() else 0.0
    scale = float(ref64.double().abs().max()) if ref.numel() else 0.0
    return max(factor * measured, sum_tol(ref.dtype, max(floor_terms, 1), scale))


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` in float64 (0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    return float((actual.detach().double() - expected.detach().double()).abs().max())


def assert_close(
    actual: torch.Tensor | float,
    expected: torch.Tensor | float,
    *,
    atol: float,
    what: str,
    why: str = "",
) -> None:
    """``actual`` within ``atol`` of ``expected`` everywhere (no relative part: ``atol``
    carries the magnitudes), shapes equal; the message names ``what`` and ``why``."""
    if not math.isfinite(atol) or atol < 0:
        raise ValueError(f"{what}: tolerance must be finite and >= 0, got {atol}")
    # A Python float as a tensor would be float32 (torch's default dtype): keep its bits.
    a = torch.as_tensor(actual, dtype=None if torch.is_tensor(actual) else torch.float64).double()
    e = torch.as_tensor(expected, dtype=None if torch.is_tensor(expected) else torch.float64)
    e = e.double()
    reason = f" ({why})" if why else ""
    head = f"{what}: off by {max_abs_diff(a, e):.3g} > tolerance {atol:.3g}{reason}"

    torch.testing.assert_close(
        a,
        e,
        atol=atol,
        rtol=0.0,
        equal_nan=False,
        msg=lambda detail: f"{head}\n{detail}",
    )


def assert_same(actual: torch.Tensor, expected: torch.Tensor, *, what: str, why: str) -> None:
    """Bit for bit (same dtype, shape and bits; NaNs equal); ``why`` says what makes the
    two computations identical."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: {actual.dtype} {tuple(actual.shape)} vs "
            f"{expected.dtype} {tuple(expected.shape)}"
        )
    if not torch.equal(actual, expected) and not (
        actual.is_floating_point()
        and torch.equal(torch.nan_to_num(actual, nan=0.0), torch.nan_to_num(expected, nan=0.0))
        and torch.equal(actual.isnan(), expected.isnan())
    ):
        raise AssertionError(
            f"{what}: not bit for bit ({why}); max |diff| {max_abs_diff(actual, expected):.3g}"
        )


# ---------------------------------------------------------------- cross entropy, Adam
# The mean cross entropy of ``N`` rows of ``V`` logits, ``mean_i (log S_i - (z_it - m_i))``
# with ``m_i = max_j z_ij`` and ``S_i = sum_j exp(z_ij - m_i)``, computed in another order
# (``F.cross_entropy``'s fused log-softmax, the vocabulary-parallel one summing shards, a
# pipeline's micro-batches): each ``exp`` and ``log`` is within 2 u (vectorised kernels
# are accurate to 1 ulp, not correctly rounded), so ``S_i`` is within ``gamma_{V+1}``
# relative, and ``log S_i`` within that absolute (``S_i >= 1``) plus 2 u of itself; the
# subtraction, the rounding of ``z_it - m_i`` and the mean of ``N`` terms add
# ``gamma_{N+4}`` of ``mag = mean_i (|log S_i| + |z_it - m_i|)``. Its gradient
# ``(softmax_ij - [j = t_i]) * g / N``: the softmax within ``gamma_{V+3}`` of itself (at
# most 1), the one-hot subtraction and the scaling add three roundings. Two evaluations
# are within twice each bound (``sum_tol``).


def cross_entropy_tol(
    logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32
) -> float:
    """Two ``dtype`` evaluations of ``F.cross_entropy(logits [..., V], targets [...])``
    (mean over the rows) are at most this far apart; ``logits`` best in float64."""
    z = logits.detach().double().reshape(-1, logits.shape[-1])  # [N, V]
    t = targets.reshape(-1)
    n, v = z.shape
    m = z.max(dim=1).values
    lse = (z - m[:, None]).exp().sum(1).log()  # [N], >= 0
    z_t = z.gather(1, t[:, None]).squeeze(1) - m  # [N], <= 0
    mag = float((lse.abs() + z_t.abs()).mean())
    return sum_tol(dtype, v + 1, 1.0) + sum_tol(dtype, n + 4, mag)


def cross_entropy_grad_tol(
    n: int, vocab: int, upstream: float = 1.0, dtype: torch.dtype = torch.float32
) -> float:
    """Two ``dtype`` evaluations of the gradient of ``upstream * (mean cross entropy of
    n rows of vocab logits)`` with respect to the logits: at most this far apart."""
    return sum_tol(dtype, vocab + 6, abs(upstream) / n)


class AdamDrift:
    """How far Adam (or AdamW) moves a parameter when its gradients are off by at most
    ``grad_tol`` per step (one fp32 backward against another, in another order).

    Adam's step is ``lr * m / (sqrt(v) + eps)`` with ``m`` and ``sqrt(v)`` weighted means
    (of the gradients, of their squares' root): each moves by at most the largest gradient
    error ``d`` so far, and ``|m| <= sqrt(v) + eps`` (up to the betas' bias corrections),
    so the step moves by at most ``2 lr d / eps``. Where a gradient is near zero this is
    what fp32's rounding does to the weights, far above their own rounding; the sum over
    the steps so far is added to the replayed tolerance of the weights."""

    def __init__(self, lr: float, eps: float) -> None:
        self.lr, self.eps = lr, eps
        self._worst: dict[object, float] = {}
        self._drift: dict[object, float] = {}

    def step(self, key: object, grad_tol: float) -> None:
        """One optimizer step of parameter ``key`` with a gradient within ``grad_tol``."""
        worst = max(self._worst.get(key, 0.0), grad_tol)
        self._worst[key] = worst
        self._drift[key] = self._drift.get(key, 0.0) + 2.0 * self.lr * worst / self.eps

    def __getitem__(self, key: object) -> float:
        return self._drift.get(key, 0.0)


# ---------------------------------------------------------------- cached copies


def served_tol(
    store_tol: float, want: torch.Tensor, moved: torch.Tensor, touched: torch.Tensor
) -> float:
    """The tolerance of served rows against the reference's ``want`` ``[N, D]``: a served
    row is a store row read at some step so far (within ``store_tol``, the largest replay
    tolerance of the store's rows so far) or a copy of one moved since by the cache: per
    batch of the row (``touched`` ``[N]`` so far) at most one local SGD step and one
    re-application of its pending sum at a refresh. Both sides compute those alike (a
    float32 product, then a subtraction), each rounding once more on each side, of a
    value within ``moved`` ``[N]`` (the row's local steps' moves summed) of the served
    row's magnitude."""
    if want.numel() == 0:
        return store_tol
    magnitude = float((want.abs().amax(dim=1) + moved).max())
    return store_tol + sum_tol(torch.float32, 2 * max(int(touched.max()), 1), magnitude)
