"""Stochastic rounding of float32 rows to fp16 / bf16 (:mod:`ps.rounding`).

The reference is the definition itself, computed independently of the bit tricks: the
two neighbours of ``x`` in the narrow type are found by float64 arithmetic on the
narrow type's grid (``torch.nextafter`` on the round-to-nearest value), and a rounded
value must be one of them; the random bits are the module docstring's hash on Python
ints. Unbiasedness is a statistical check: over ``n`` roundings of one value (different
versions or rows: different random bits), the mean's error in units of the gap between
the neighbours is a mean of ``n`` Bernoulli draws minus their probability, whose
standard deviation is at most ``0.5 / sqrt(n)``; the tests allow six of those.

The draws themselves (four 16-bit lanes of one 64-bit hash per four columns) are checked
for uniformity per lane and for independence of adjacent columns, within the lanes of
one hash and across two hashes. The inputs are fixed, so each statistic is one number;
every bound is six standard deviations of that statistic under the hypothesis (uniform,
independent draws), which a good hash passes and a broken lane or a shared bit fails by
far.
"""

from __future__ import annotations

import math

import pytest
import torch

from ps.rounding import round_to, rounding_bits

pytestmark = [pytest.mark.timeout(60)]

NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest narrow value <= x and the smallest >= x (float64), for finite x
    inside the narrow type's range."""
    near = x.to(dtype)
    up = torch.nextafter(near, torch.tensor(math.inf, dtype=dtype))
    down = torch.nextafter(near, torch.tensor(-math.inf, dtype=dtype))
    x64, n64 = x.double(), near.double()
    lo = torch.where(n64 <= x64, n64, down.double())
    hi = torch.where(n64 >= x64, n64, up.double())
    return lo, hi


def _values() -> torch.Tensor:
    """Values over many binades, both signs, fp16 subnormals and exact narrow values."""
    g = torch.Generator().manual_seed(0)
    mags = torch.logspace(-7, 4, 300, dtype=torch.float64)
    rnd = torch.rand(300, generator=g, dtype=torch.float64) + 0.5
    x = (mags * rnd).to(torch.float32)
    exact = torch.tensor([0.5, 1.0, -2.0, 0.0, 6.103515625e-05, 5.960464477539063e-08])
    return torch.cat([x, -x, exact])


@pytest.mark.parametrize("name", sorted(NARROW))
def test_every_value_goes_to_one_of_its_two_neighbours(name: str) -> None:
    dtype = NARROW[name]
    x = _values()[None, :].expand(64, -1).contiguous()  # [64 versions, V]
    n = x.shape[0]
    got = torch.cat(
        [
            round_to(x[i : i + 1], dtype, seed=7, ids=torch.tensor([3]), versions=torch.tensor([i]))
            for i in range(n)
        ]
    )
    assert got.dtype == dtype and got.shape == x.shape
    lo, hi = _neighbours(x, dtype)
    g64 = got.double()
    assert bool(((g64 == lo) | (g64 == hi)).all()), "a value left its two neighbours"
    exact = lo == hi  # already representable: never moves
    assert torch.equal(g64[exact], x.double()[exact])


@pytest.mark.parametrize("name", sorted(NARROW))
def test_the_mean_of_many_roundings_is_the_value(name: str) -> None:
    dtype = NARROW[name]
    values = torch.tensor([0.1, -0.3337, 1.7e-3, 3.3e-6, 2.4e-7, 12345.6])
    n = 4000
    x = values[None, :].expand(n, -1).contiguous()  # [n, 6]: row i is version i
    ids = torch.zeros(n, dtype=torch.int64)
    got = round_to(x, dtype, seed=1, ids=ids, versions=torch.arange(n)).double()
    lo, hi = _neighbours(values[None, :], dtype)
    gap = (hi - lo)[0]
    err = (got.mean(0) - values.double()) / gap  # in units of the gap
    assert bool((err.abs() <= 6 * 0.5 / math.sqrt(n)).all()), err


def test_the_bits_are_a_function_of_seed_id_version_and_column() -> None:
    ids = torch.tensor([5, 9, 5])
    versions = torch.tensor([1, 1, 1])
    a = rounding_bits(3, ids, versions, 16)
    assert a.shape == (3, 16) and bool((a >= 0).all()) and bool((a < 2**16).all())
    assert torch.equal(a[0], a[2]), "the same row and version must draw the same bits"
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, rounding_bits(4, ids, versions, 16)), "the seed must matter"
    assert not torch.equal(a, rounding_bits(3, ids, versions + 1, 16))
    assert len(set(a[0].tolist())) == 16, "columns must draw different bits"
    # A row's bits do not depend on which other rows are rounded with it.
    assert torch.equal(rounding_bits(3, ids[1:2], versions[1:2], 16)[0], a[1])


def test_fp16_saturates_and_non_finite_values_stay() -> None:
    x = torch.tensor([[7e4, -7e4, 65504.0, math.inf, -math.inf, math.nan]])
    got = round_to(x, torch.float16, seed=0, ids=torch.tensor([1]), versions=torch.tensor([1]))
    assert got[0, :3].tolist() == [65504.0, -65504.0, 65504.0]
    assert got[0, 3].item() == math.inf and got[0, 4].item() == -math.inf
    assert math.isnan(got[0, 5].item())
    b = round_to(x, torch.bfloat16, seed=0, ids=torch.tensor([1]), versions=torch.tensor([1]))
    assert b[0, 3].item() == math.inf and math.isnan(b[0, 5].item())


def test_fp32_is_returned_as_it_is_and_other_types_are_refused() -> None:
    x = torch.randn(2, 3)
    assert round_to(x, torch.float32, seed=0, ids=torch.arange(2), versions=torch.ones(2)) is x
    with pytest.raises(ValueError, match="fp16 or bf16"):
        round_to(x, torch.int8, seed=0, ids=torch.arange(2), versions=torch.ones(2))


# ------------------------------------------------------------------ the random bits

_M64 = (1 << 64) - 1


def _splitmix64_int(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _reference_bits(seed: int, row_id: int, version: int, dim: int) -> list[int]:
    """The module docstring's definition on Python ints (uint64 by masking)."""
    key = _splitmix64_int(_splitmix64_int(seed & ((1 << 63) - 1)) ^ (row_id & _M64))
    key = _splitmix64_int((key + (version & _M64) * 0x9E3779B97F4A7C15) & _M64)
    out = []
    for column in range(dim):
        h = (key + (column // 4 + 1) * 0xD1B54A32D192ED03) & _M64
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & _M64
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & _M64
        h ^= h >> 33
        out.append((h >> (16 * (column % 4))) & 0xFFFF)
    return out


def test_the_bits_are_the_documented_hash() -> None:
    ids = torch.tensor([0, 5, -3, 2**62, -(2**63)])
    versions = torch.tensor([1, -7, 0, 2**40, 2**63 - 1])
    for seed in (0, 7, -1, 2**63 - 1, 2**64 - 1):
        for dim in (1, 4, 13, 64):
            got = rounding_bits(seed, ids, versions, dim)
            for r in range(ids.numel()):
                want = _reference_bits(seed, int(ids[r]), int(versions[r]), dim)
                assert got[r].tolist() == want, (seed, dim, r)


def _draws() -> torch.Tensor:
    """16-bit draws ``[N, 64]`` of 4000 rows x 8 versions (several seeds of tables)."""
    ids = torch.arange(4000, dtype=torch.int64).repeat(8)
    versions = torch.arange(8, dtype=torch.int64).repeat_interleave(4000)
    return torch.cat([rounding_bits(seed, ids, versions, 64) for seed in (1, 2**40 + 3)])


# The bit fields whose distribution the rounding uses: bf16 adds all 16 bits, fp16 the
# low 13; a field of 8 bits gives 256 cells of a chi-square test.
_FIELDS = {"bits 8-15": (8, 0xFF), "bits 5-12": (5, 0xFF), "bits 0-7": (0, 0xFF)}


def _chi_square_bound(cells: int) -> float:
    """Mean plus six standard deviations of a chi-square of ``cells - 1`` degrees of
    freedom (the statistic's distribution for uniform cells; ~N(k, 2k) at k = 255)."""
    k = cells - 1
    return k + 6 * math.sqrt(2 * k)


def _chi_square(values: torch.Tensor, cells: int) -> float:
    counts = torch.bincount(values.reshape(-1), minlength=cells).double()
    expected = values.numel() / cells
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("lane", [0, 1, 2, 3])
def test_each_lane_draws_uniform_16_bit_values(lane: int) -> None:
    r = _draws()[:, lane::4]  # [N, 16]: the columns that take this lane of their hash
    n = r.numel()
    for name, (shift, mask) in _FIELDS.items():
        chi2 = _chi_square((r >> shift) & mask, mask + 1)
        assert chi2 <= _chi_square_bound(mask + 1), (lane, name, chi2)
    # mean and variance of a uniform value on [0, 2**16): (2**16 - 1) / 2 and
    # (2**32 - 1) / 12; the sample mean's standard deviation is sqrt(var / n), the
    # sample variance's sqrt((m4 - var**2) / n) with m4 = (2**16)**4 / 80 (uniform)
    x = r.double()
    var = (2.0**32 - 1) / 12
    assert abs(float(x.mean()) - (2**16 - 1) / 2) <= 6 * math.sqrt(var / n)
    m4 = 2.0**64 / 80
    assert abs(float(x.var()) - var) <= 6 * math.sqrt((m4 - var**2) / n)


# Pairs of columns (first lane, distance): adjacent lanes of one hash, lane 3 of a group
# with lane 0 of the next group's hash, and each lane with the same lane of the next
# group (hash inputs that differ by the group step: without the finaliser's mixing these
# would be one draw plus a constant).
_PAIRS = {
    "lanes 0-1": (0, 1),
    "lanes 1-2": (1, 1),
    "lanes 2-3": (2, 1),
    "lane 3-next group's 0": (3, 1),
    **{f"lane {lane}-next group's {lane}": (lane, 4) for lane in range(4)},
}


@pytest.mark.parametrize("pair", sorted(_PAIRS))
def test_adjacent_columns_draw_independent_values(pair: str) -> None:
    r = _draws()
    lane, distance = _PAIRS[pair]
    cols = torch.arange(lane, 64 - distance, 4)  # the first column of each pair
    a, b = r[:, cols], r[:, cols + distance]
    n = a.numel()
    # Pearson correlation: ~N(0, 1/n) for independent draws
    xa, xb = a.double() - a.double().mean(), b.double() - b.double().mean()
    corr = float((xa * xb).mean() / (xa.std() * xb.std()))
    assert abs(corr) <= 6 / math.sqrt(n), (pair, corr)
    # the joint distribution of 4-bit fields (256 cells), for the top of each field the
    # two types add: bf16's bits 12-15 and fp16's bits 9-12
    for shift in (12, 9):
        joint = ((a >> shift) & 0xF) * 16 + ((b >> shift) & 0xF)
        chi2 = _chi_square(joint, 256)
        assert chi2 <= _chi_square_bound(256), (pair, shift, chi2)


@pytest.mark.parametrize("name", sorted(NARROW))
def test_the_mean_over_rows_and_lanes_is_the_value(name: str) -> None:
    """Every column of many rows holds one value; per lane, the mean of its roundings
    over the rows is the value within six standard deviations of a mean of Bernoulli
    draws (at most ``0.5 * gap / sqrt(n)``)."""
    dtype = NARROW[name]
    n = 20000
    row = torch.tensor([0.1, -0.3337, 1.7e-3, 3.3e-6, 2.4e-7, 12345.6, 0.7071, -5.5e-5])
    values = row.repeat(8)  # [64]: each value in every lane (columns 8k + i, lane i % 4)
    x = values[None, :].expand(n, -1).contiguous()  # [n, 64]
    got = round_to(x, dtype, seed=11, ids=torch.arange(n), versions=torch.full((n,), 3)).double()
    lo, hi = _neighbours(values[None, :], dtype)
    gap = (hi - lo)[0]  # [64]
    err = (got.mean(0) - values.double()) / gap  # [64], in units of the gap
    assert bool((err.abs() <= 6 * 0.5 / math.sqrt(n)).all()), err
    # and pooled per lane: 16 columns x n rows
    pooled = err.reshape(16, 4).mean(0)
    assert bool((pooled.abs() <= 6 * 0.5 / math.sqrt(16 * n)).all()), pooled
