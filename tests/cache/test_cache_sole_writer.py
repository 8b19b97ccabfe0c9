"""A cache that is its tables' only writer (``CacheConfig.sole_writer``) asks the PS only
about its misses and the rows it pushed more than ``s_r`` times since their read.

The reference is the same cache asking about every cached row (the default): with one
writer the PS clock of a cached row is exactly its copy clock plus the cache's own
pushes since, so the PS would have answered "fresh" for every row the sole writer does
not ask about. Both caches must therefore serve the same bits, leave the same rows,
clocks and optimizer state in their stores, and move the same rows, while the sole
writer sends fewer ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import ps
from tolerance import assert_same
from wrapped_store import WrappedStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

ROWS, DIM = 400, 8
SAME = (
    "one writer: the rows the sole writer does not ask about are exactly those the PS "
    "would not return, so both caches install and serve the same rows"
)


class _CountingStore(WrappedStore):
    """Counts the ids sent in conditional pulls (what the cache asks the PS about)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def pull_async(self, table, ids, *, clocks=None, bound=None):  # type: ignore[no-untyped-def]
        if clocks is not None:
            self.asked += int(ids.numel())
        return super().pull_async(table, ids, clocks=clocks, bound=bound)


def _train(sole: bool, policy: str, bounds: tuple[int, int], prefetch: bool):
    inner = _CountingStore()
    opt = ps.RowWiseAdagrad(lr=0.1)
    for name in ("a", "b"):
        inner.create_table(ps.TableSpec(name=name, num_rows=ROWS, dim=DIM, optimizer=opt))
    cfg = cache.CacheConfig(
        capacity_rows=60, policy=policy, read_bound=bounds[0], write_bound=bounds[1],
        sole_writer=sole, group_tables=True, evict_chunk=4,
    )  # fmt: skip
    store = cache.CachedStore(inner, cfg)
    rng = np.random.default_rng(5)

    def batch() -> list[ps.PullRequest]:
        return [
            ps.PullRequest(n, torch.from_numpy((rng.zipf(1.3, size=80) - 1) % ROWS))
            for n in ("a", "b")
        ]

    served, nxt = [], batch()
    for _ in range(40):
        reqs, nxt = nxt, batch()
        got = store.pull_many(reqs)
        served.extend(r.rows.clone() for r in got)
        if prefetch:
            store.prefetch_many(nxt)
        grads = [torch.from_numpy(rng.standard_normal((80, DIM)).astype(np.float32)) for _ in reqs]
        store.push_many(
            [ps.PushRequest(r.table, r.ids, g) for r, g in zip(reqs, grads, strict=True)]
        )
    stats = store.cache_stats()
    store.flush()
    every = torch.arange(ROWS)
    final = [
        (inner.pull(n, every).rows, inner.clocks(n, every), inner.state(n, every)) for n in "ab"
    ]
    return served, final, stats, inner.asked


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
@pytest.mark.parametrize("bounds", [(0, 0), (2, 1), (4, 4)], ids=str)
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_sole_writer_serves_the_same_rows_asking_less(
    policy: str, bounds: tuple[int, int], prefetch: bool
) -> None:
    ref = _train(False, policy, bounds, prefetch)
    sole = _train(True, policy, bounds, prefetch)
    for k, (x, y) in enumerate(zip(sole[0], ref[0], strict=True)):
        assert_same(x, y, what=f"served rows of request {k}", why=SAME)
    for x, y in zip(sole[1], ref[1], strict=True):
        assert_same(x[0], y[0], what="final rows", why=SAME)
        assert torch.equal(x[1], y[1])
        assert_same(x[2], y[2], what="optimizer state", why=SAME)
    (name,) = ref[2]
    for key in ("rows_pushed", "misses", "refreshes", "hits", "evictions", "staleness_served"):
        assert sole[2][name][key] == ref[2][name][key], key
    if bounds[0] == 0:  # every reused row was pushed since its read: all are asked
        assert sole[3] == ref[3]
    else:
        assert sole[3] < ref[3]  # asked about fewer ids
    assert sole[2][name]["evictions"] > 0
    assert sole[2][name]["hits"] > 0 or bounds[0] == 0  # at (0, 0) every reuse is a refresh


def test_sole_writer_is_a_bool() -> None:
    with pytest.raises(TypeError, match="sole_writer must be a bool"):
        cache.CacheConfig(capacity_rows=4, sole_writer=1)  # type: ignore[arg-type]
