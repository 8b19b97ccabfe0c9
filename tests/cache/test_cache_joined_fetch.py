"""A serving pull and its prefetch joined into one store request (``cache.joined_fetch``):
each half of the joined reply equals the reply to its own request, bit for bit (the
same rows read from the same store), for conditional and plain halves in every
combination; requests that cannot be one (other bounds, columns or tables) are not
joined."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ps
from cache.joined_fetch import join


def _store() -> ps.InProcessStore:
    store = ps.InProcessStore()
    spec = ps.TableSpec(name="t", num_rows=500, dim=3, optimizer=ps.RowWiseAdagrad(lr=0.1))
    store.create_table(spec)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # clocks 0 .. 6 spread over the rows
        ids = torch.unique(torch.randint(0, 500, (300,), generator=gen))
        store.push("t", ids, torch.randn(ids.numel(), 3, generator=gen))
    return store


def _request(ids: np.ndarray, conditional: bool, rng: np.random.Generator) -> ps.PullRequest:
    if not conditional:
        return ps.PullRequest("t", torch.from_numpy(ids), with_state=True)
    clocks = torch.from_numpy(rng.integers(-3, 7, ids.size))  # some past the bound, some not
    return ps.PullRequest("t", torch.from_numpy(ids), clocks, 1, True)


def _same(got: ps.PullResult, want: ps.PullResult) -> None:
    assert torch.equal(got.rows, want.rows) and torch.equal(got.clocks, want.clocks)
    assert (got.positions is None) == (want.positions is None)
    if want.positions is not None:
        assert got.positions is not None and torch.equal(got.positions, want.positions)
    assert got.state is not None and want.state is not None
    assert torch.equal(got.state, want.state)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("cond_a", "cond_b"), [(True, False), (True, True), (False, False),
                                                (False, True)])  # fmt: skip
def test_each_half_of_a_joined_reply_is_its_own(cond_a: bool, cond_b: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = _store()
    chosen = rng.permutation(500)[: rng.integers(2, 200)]
    cut = int(rng.integers(1, chosen.size))
    a, b = np.sort(chosen[:cut]), np.sort(chosen[cut:])  # disjoint, each increasing
    first, second = _request(a, cond_a, rng), _request(b, cond_b, rng)
    joined = join(first, second)
    assert joined is not None
    request, where = joined
    ids = request.ids.numpy()
    assert np.array_equal(ids, np.sort(chosen)) and request.with_state
    got_a, got_b = where.split(store.pull_many([request])[0])
    want_a, want_b = store.pull_many([first, second])
    _same(got_a, want_a)
    _same(got_b, want_b)


def test_requests_that_cannot_be_one_are_not_joined() -> None:
    ids_a, ids_b = torch.tensor([1, 4]), torch.tensor([2, 9])
    clocks = torch.zeros(2, dtype=torch.int64)
    bound_1 = ps.PullRequest("t", ids_a, clocks, 1)
    assert join(bound_1, ps.PullRequest("t", ids_b, clocks, 2)) is None  # other bounds
    assert join(bound_1, ps.PullRequest("u", ids_b)) is None  # another table
    assert join(bound_1, ps.PullRequest("t", ids_b, with_state=True)) is None  # other columns
    assert join(bound_1, ps.PullRequest("t", ids_b)) is not None
