"""A batched push through the cache is checked whole before anything is applied: a NaN
in one table's gradients names that table and row, and no table (the store, the cached
copies, the pending sums) changes, whether the tables share one cache or not."""

from __future__ import annotations

import pytest
import torch

import cache
import ps

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("grouped", [True, False], ids=["shared-cache", "cache-per-table"])
@pytest.mark.parametrize("bounds", [(0, 0), (2, 2)])
def test_a_bad_gradient_in_one_table_applies_nothing(
    grouped: bool, bounds: tuple[int, int]
) -> None:
    inner = ps.InProcessStore()
    for name in ("a", "b", "c"):
        inner.create_table(ps.TableSpec(name=name, num_rows=10, dim=2, optimizer=ps.SGD(lr=0.1)))
    config = cache.CacheConfig(
        capacity_rows=5, read_bound=bounds[0], write_bound=bounds[1], group_tables=grouped
    )
    store = cache.CachedStore(inner, config)
    ids = torch.tensor([1, 2, 7])
    tables = ("a", "b", "c")
    store.pull_many([ps.PullRequest(t, ids) for t in tables])
    served = [r.rows.clone() for r in store.pull_many([ps.PullRequest(t, ids) for t in tables])]
    state = store.cache_state()
    bad = torch.ones(3, 2)
    bad[2, 1] = float("inf")
    with pytest.raises(ValueError, match=r"push table 'b': gradient of row id 7 \(position 2\)"):
        store.push_many(
            [ps.PushRequest("a", ids, torch.ones(3, 2)), ps.PushRequest("b", ids, bad),
             ps.PushRequest("c", ids, torch.ones(3, 2))]
        )  # fmt: skip
    after = store.cache_state()  # flushes: nothing is pending
    assert sorted(after) == sorted(state)
    for name in state:
        for key in state[name]:
            assert torch.equal(after[name][key], state[name][key]), (name, key)
    again = store.pull_many([ps.PullRequest(t, ids) for t in tables])
    for r, want in zip(again, served, strict=True):
        assert torch.equal(r.rows, want)  # the copies and the store as they were
    assert int(inner.clocks("a", ids).sum()) == 0
