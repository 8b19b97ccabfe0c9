"""Gradient compression codecs (comm.compression), checked against independent numpy math.

* unbiasedness (TernGrad without clipping, natural compression): the mean of many
  decodes of one vector equals the vector within 5 standard errors, with the
  per-element variance derived from the method (not fitted);
* top-k error feedback: replayed step by step against a numpy reference; the sum of
  what was sent plus the residual equals the sum of the gradients, and the residual
  stays within the bound that top-k's contraction gives;
* casts: exact on representable values, rounding error within the format's epsilon;
* wire bytes per codec equal the formulas; bad inputs raise ValueError naming the key;
* the size-1 allreduce applies the codec.
Multi-rank runs: tests/comm/ranks/compression_allreduce.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import comm
from comm.compression import (
    CODECS,
    Codec,
    TernGrad,
    TopK,
    compressed_allreduce,
    compressed_allreduce_async,
    get_codec,
)
from comm.compression.terngrad import pack_2bit, unpack_2bit
from multiproc import run_ranks
from tolerance import assert_close, gamma, sum_tol, unit_roundoff

DRAWS = 4000  # decodes per unbiasedness test
SIGMAS = 5.0


def sample_vector(n: int = 240, seed: int = 0) -> torch.Tensor:
    """Values over many binades, both signs, exact zeros and exact powers of two."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(-20, 3, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).float()
    x[:4] = torch.tensor([0.0, 0.25, -4.0, 0.0])
    return x


def mean_of_decodes(codec: Codec, x: torch.Tensor, draws: int, per_call: int = 100) -> np.ndarray:
    """Mean of ``draws`` independent decodes of ``x``; ``per_call`` copies of ``x`` share one
    encode (the same max and hence scale as ``x`` alone, fresh noise for every element)."""
    n = x.numel()
    tiled = x.repeat(per_call)  # [per_call * n]
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws // per_call):
        dec = codec.decode(codec.encode(tiled, key="g"), tiled.numel())
        total += dec.double().view(per_call, n).sum(0)
    return (total / (draws // per_call * per_call)).numpy()


def assert_within_sigmas(
    mean: np.ndarray, x: np.ndarray, var: np.ndarray, draws: int, biased: np.ndarray
) -> None:
    """``mean`` within SIGMAS standard errors of ``x``, and ``biased`` (a deterministic
    rounding, the obvious wrong implementation) is not: the bound has teeth."""
    bound = SIGMAS * np.sqrt(var / draws)
    err = np.abs(mean - x)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"element {worst}: x={x[worst]!r} mean={mean[worst]!r} |err|={err[worst]:.3g} > "
        f"{SIGMAS} sigma = {bound[worst]:.3g}"
    )
    caught = int(np.sum(np.abs(biased - x) > bound))
    assert caught >= len(x) // 4, f"test too weak: a biased rounding fails only {caught} elements"


def test_terngrad_unclipped_is_unbiased() -> None:
    x = sample_vector()
    codec = TernGrad(clip=None, seed=7)
    assert codec.unbiased
    mean = mean_of_decodes(codec, x, DRAWS)
    xs = x.double().numpy()
    s = np.abs(xs).max()
    var = s * np.abs(xs) - xs**2  # s*b with P(b = sign x) = |x|/s: Bernoulli variance
    assert_within_sigmas(mean, xs, var, DRAWS, biased=np.round(xs / s) * s)


def test_natural_is_unbiased() -> None:
    x = sample_vector()
    x[10] = 3e-39  # below the smallest level 2^(3-126): rounded to 0 or 2^-123
    codec = get_codec("natural", seed=11)
    assert codec.unbiased
    mean = mean_of_decodes(codec, x, DRAWS)
    xs = x.double().numpy()
    a = np.abs(xs)
    lo = np.exp2(np.floor(np.log2(np.where(a > 0, a, 1.0))))
    hi = 2 * lo
    smallest = 2.0 ** (int(np.ceil(np.log2(a.max()))) - 126)
    lo = np.where(a < smallest, 0.0, lo)
    hi = np.where(a < smallest, smallest, hi)
    var = np.where(a > 0, (a - lo) * (hi - a), 0.0)  # two-point distribution on [lo, hi]
    nearest = np.sign(xs) * np.where(a - lo < hi - a, lo, hi)
    assert_within_sigmas(mean, xs, var, DRAWS, biased=nearest)


def test_natural_rounds_to_neighbouring_powers_of_two() -> None:
    x = sample_vector(seed=3)
    codec = get_codec("natural")
    d = codec.decode(codec.encode(x, key="g"), x.numel()).double().numpy()
    xs = x.double().numpy()
    nz = xs != 0
    assert np.all(d[~nz] == 0)
    assert np.all(np.sign(d[nz]) == np.sign(xs[nz]))
    lo = np.exp2(np.floor(np.log2(np.abs(xs[nz]))))
    assert np.all((np.abs(d[nz]) == lo) | (np.abs(d[nz]) == 2 * lo))


def test_terngrad_values_scale_and_clipping() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    x[17] = 40.0  # an outlier far past 2.5 sigma
    codec = TernGrad(seed=2)  # clip=2.5 (the paper's)
    assert not codec.unbiased
    enc = codec.encode(x, key="w")
    std = float(x.double().std(correction=0))
    assert enc.scale is not None and enc.payload.dtype == torch.uint8
    # max|clipped| = c * sigma. fp32's sigma: a sum of n non-negative squared deviations
    # (each a subtraction and a square), a division, a square root and the product by c:
    # within gamma_{n+4} of itself. (Still far below the 1/(2n) of correction=1.)
    want = 2.5 * std
    assert_close(enc.scale.item(), want, atol=gamma(x.numel() + 4, torch.float32) * want,
                 what="TernGrad scale", why="fp32 std of n values against float64")  # fmt: skip
    d = codec.decode(enc, x.numel())
    s = float(enc.scale.item())
    assert set(d.unique().tolist()) <= {-s, 0.0, s}
    assert torch.all((d == 0) | (torch.sign(d) == torch.sign(x)))
    unclipped = TernGrad(clip=None).encode(x, key="w")
    assert unclipped.scale is not None and unclipped.scale.item() == 40.0
    const = TernGrad().encode(torch.full((5,), -3.0), key="c")  # sigma 0: not clipped, exact
    assert torch.equal(TernGrad().decode(const, 5), torch.full((5,), -3.0))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1001])
def test_pack_2bit_roundtrip(n: int) -> None:
    codes = torch.randint(0, 3, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 4)
    expect = np.zeros(math.ceil(n / 4), dtype=np.int64)  # little end first, numpy reference
    for i, c in enumerate(codes.tolist()):
        expect[i // 4] |= c << (2 * (i % 4))
    assert packed.tolist() == expect.tolist()
    assert torch.equal(unpack_2bit(packed, n), codes)


def topk_reference(grads: list[np.ndarray], k: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Sequential numpy replay of top-k with error feedback: (sent per step, residual)."""
    r = np.zeros_like(grads[0])
    sent = []
    for g in grads:
        acc = r + g
        idx = np.argsort(-np.abs(acc), kind="stable")[:k]
        s = np.zeros_like(acc)
        s[idx] = acc[idx]
        sent.append(s)
        r = acc - s
    return sent, r


def test_topk_error_feedback() -> None:
    n, ratio, steps = 200, 0.05, 300
    codec = TopK(ratio=ratio)
    k = codec.k_for(n)
    assert k == 10
    gen = torch.Generator().manual_seed(4)
    # A constant drift plus noise: the drift's small coordinates only get sent thanks
    # to the accumulated residual.
    drift = torch.linspace(-0.05, 0.05, n)
    grads = [(drift + 0.3 * torch.randn(n, generator=gen)).float() for _ in range(steps)]
    ref_sent, _ = topk_reference([g.double().numpy() for g in grads], k)
    delta = k / n
    big_g = max(float(g.norm()) for g in grads)
    bound = math.sqrt(1 - delta) * big_g / (1 - math.sqrt(1 - delta))  # contraction fixpoint
    sum_sent = torch.zeros(n, dtype=torch.float64)
    sum_g = torch.zeros(n, dtype=torch.float64)
    # The codec's fp32 accumulator acc = residual + g rounds once per step (|error| <= u
    # |acc|); what it sends or keeps is acc itself. So an entry sent now is off from the
    # float64 replay by at most u times the sum of its |acc| since it was last sent
    # (``window``), and sent plus kept is off from the gradients' sum by at most u times
    # the sum of every |acc| so far (``every``), plus the float64 sums' own rounding.
    u = unit_roundoff(torch.float32)
    window = torch.zeros(n, dtype=torch.float64)
    every = torch.zeros(n, dtype=torch.float64)
    for t, g in enumerate(grads):
        enc = codec.encode(g, key="layer")
        assert enc.wire_bytes() == 8 * k
        sent = codec.decode(enc, n).double()
        assert int((sent != 0).sum()) == k
        residual = codec.residuals["layer"].double()
        acc = (sent + residual).abs()  # one of the two is 0
        window += acc
        every += acc
        tol = 2 * u * float(window[sent != 0].max())  # 2: u of acc, acc within u of exact
        assert_close(sent, torch.from_numpy(ref_sent[t]), atol=tol, what=f"sent at step {t}",
                     why="one fp32 rounding of each accumulation since the last send")  # fmt: skip
        window[sent != 0] = 0.0
        sum_sent += sent
        sum_g += g.double()
        # Nothing is lost: what was sent plus what is held back is every gradient.
        tol = 2 * u * float(every.max()) + sum_tol(torch.float64, 2 * (t + 1), float(every.max()))
        assert_close(sum_sent + residual, sum_g, atol=tol, what=f"sent + kept at step {t}",
                     why="one fp32 rounding of each accumulation")  # fmt: skip
        assert float(residual.norm()) <= bound, (t, float(residual.norm()), bound)
    # Without error feedback (residual dropped every step) the drift's small entries are
    # never sent and the error grows with the number of steps instead of staying bounded.
    plain = TopK(ratio=ratio)
    sum_plain = torch.zeros(n, dtype=torch.float64)
    for g in grads:
        sum_plain += plain.decode(plain.encode(g, key="layer"), n).double()
        plain.reset()
    feedback_error = float((sum_sent - sum_g).norm())  # = |residual|, bounded
    assert float((sum_plain - sum_g).norm()) > 5 * feedback_error


def test_topk_keys_are_independent_and_checked() -> None:
    codec = TopK(ratio=0.5)
    a, b = torch.tensor([1.0, -2.0, 0.5, 0.1]), torch.tensor([3.0, 0.0])
    codec.encode(a, key="a")
    codec.encode(b, key="b")
    assert torch.equal(codec.residuals["a"], torch.tensor([0.0, 0.0, 0.5, 0.1]))
    assert torch.equal(codec.residuals["b"], torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="'a' has 2 values but its error-feedback residual has 4"):
        codec.encode(b, key="a")
    codec.reset("a")
    codec.encode(b, key="a")
    codec.reset()
    assert codec.residuals == {}


def test_casts_exact_on_representable_values() -> None:
    fp16_ok = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 2.0**-24, 1 / 1024, 1000.0, -0.125])
    fp16 = get_codec("fp16")
    assert torch.equal(fp16.decode(fp16.encode(fp16_ok, key="k"), 9), fp16_ok)
    x = torch.randn(500, generator=torch.Generator().manual_seed(5)) * 1e3
    bf16_ok = x.to(torch.bfloat16).float()
    bf16 = get_codec("bf16")
    assert torch.equal(bf16.decode(bf16.encode(bf16_ok, key="k"), 500), bf16_ok)
    for codec, eps in ((fp16, 2.0**-11), (bf16, 2.0**-8)):
        d = codec.decode(codec.encode(x, key="k"), 500)
        assert torch.all((d - x).abs() <= eps * x.abs()), codec.name
    # fp16 saturates instead of overflowing to Inf; bf16 keeps float32's range.
    big = torch.tensor([1e6, -1e30])
    assert fp16.decode(fp16.encode(big, key="k"), 2).tolist() == [65504.0, -65504.0]
    assert torch.isfinite(bf16.decode(bf16.encode(big, key="k"), 2)).all()
    none = get_codec("none")
    assert torch.equal(none.decode(none.encode(x, key="k"), 500), x)


@pytest.mark.parametrize("n", [1, 7, 1000, 4097])
def test_wire_bytes_formulas(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    expected = {
        "none": 4 * n,
        "fp16": 2 * n,
        "bf16": 2 * n,
        "terngrad": math.ceil(n / 4) + 4,  # 2 bits per value + float32 scale
        "natural": n + 4,  # 1 byte per value + the reference exponent
        "topk": 8 * max(1, math.ceil(0.01 * n)),  # int32 index + float32 value
    }
    assert set(expected) == set(CODECS)
    for name, nbytes in expected.items():
        codec = get_codec(name)
        assert codec.encode(x, key="k").wire_bytes() == nbytes, name
        assert codec.expected_wire_bytes(n) == nbytes, name
        codec.encode(x, key="k")
        assert codec.stats == {"calls": 2, "bytes_in": 8 * n, "bytes_on_wire": 2 * nbytes}


def test_rng_policy_seed_and_rank() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    for name in ("terngrad", "natural"):
        a, b = get_codec(name, seed=3, rank=1), get_codec(name, seed=3, rank=1)
        other = get_codec(name, seed=3, rank=2)
        for _ in range(3):  # the same stream, step after step
            ea, eb, eo = (c.encode(x, key="k") for c in (a, b, other))
            assert torch.equal(ea.payload, eb.payload), name
        assert not torch.equal(ea.payload, eo.payload), name
        unbound = get_codec(name, seed=3)
        unbound.bind_rank(2)  # what the allreduce does with group.rank
        assert unbound.rank == 2
        assert torch.equal(
            unbound.encode(x, key="k").payload,
            get_codec(name, seed=3, rank=2).encode(x, key="k").payload,
        )
        unbound.bind_rank(0)  # an explicit or earlier rank wins
        assert unbound.rank == 2


@pytest.mark.parametrize("name", list(CODECS))
def test_local_allreduce_applies_codec(name: str) -> None:
    x = torch.randn(333, generator=torch.Generator().manual_seed(9))
    codec = get_codec(name, seed=5)
    replay = get_codec(name, seed=5, rank=0)  # LocalGroup binds rank 0
    for _ in range(2):  # the second step also exercises top-k's residual
        flat = x.clone()
        h = compressed_allreduce_async(comm.LocalGroup(), flat, codec, key="b0")
        assert h.wait() is flat
        assert torch.equal(flat, replay.decode(replay.encode(x, key="b0"), 333)), name
    assert codec.stats == {
        "calls": 2,
        "bytes_in": 2 * 4 * 333,
        "bytes_on_wire": 2 * replay.expected_wire_bytes(333),
    }


def test_bad_inputs_name_the_key() -> None:
    group = comm.LocalGroup()
    codec = get_codec("terngrad")
    bad = {
        "ints": torch.arange(4),
        "matrix": torch.zeros(2, 2),
        "nan": torch.tensor([1.0, float("nan")]),
        "inf": torch.tensor([float("inf"), 1.0]),
    }
    for key, t in bad.items():
        with pytest.raises(ValueError, match=repr(key)):
            codec.encode(t, key=key)
        with pytest.raises(ValueError, match=repr(key)):
            compressed_allreduce(group, t, codec, key=key)
    with pytest.raises(ValueError, match="'f64'.*float32"):
        compressed_allreduce(group, torch.zeros(3, dtype=torch.float64), codec, key="f64")
    with pytest.raises(ValueError, match="'strided'.*contiguous"):
        compressed_allreduce(group, torch.zeros(6)[::2], codec, key="strided")
    with pytest.raises(ValueError, match="unknown codec 'zip'; expected one of none, fp16, bf16"):
        get_codec("zip")
    with pytest.raises(ValueError, match="ratio must be in \\(0, 1\\], got 0"):
        get_codec("topk", ratio=0)
    with pytest.raises(ValueError, match="clip must be > 0.*got -1"):
        get_codec("terngrad", clip=-1)
    with pytest.raises(ValueError, match="bad options"):
        get_codec("fp16", ratio=0.1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_compressed_allreduce_matches_replayed_ranks(backend: str, nprocs: int) -> None:
    outs = run_ranks("compression_allreduce.py", nprocs, backend, timeout=200)
    text = "\n".join(outs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok compression" in text, text
