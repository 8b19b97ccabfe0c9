"""Stochastic rounding of float32 rows to fp16 / bf16 (:mod:`ps.rounding`).

The reference is the definition itself, computed independently of the bit tricks: the
two neighbours of ``x`` in the narrow type are found by float64 arithmetic on the
narrow type's grid (``torch.nextafter`` on the round-to-nearest value), and a rounded
value must be one of them. Unbiasedness is a statistical check: over ``n`` roundings
of one value (different versions: different random bits), the mean's error in units
of the gap between the neighbours is a mean of ``n`` Bernoulli draws minus their
probability, whose standard deviation is at most ``0.5 / sqrt(n)``; the test allows
six of those.
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
    assert a.shape == (3, 16) and bool((a >= 0).all()) and bool((a < 2**32).all())
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
