"""Tables sharing one cache (``CacheConfig(group_tables=True)``).

References: the plain store fed the same requests one table at a time (bounds 0:
bit-identical), and a per-table cache over ONE table holding the group's tables packed
one after the other (any bounds: a shared cache is exactly that cache, so cached ids,
clocks and statistics must be equal, and served rows, PS rows and optimizer state equal
up to the rounding of the store's kernels on another layout: the packed table gets a's
and b's rows in one push where the shared cache pushes them to two tables).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cache
import ps
from ps import PullRequest, PushRequest
from ps_reference import WHY as REPLAY
from ps_reference import RecordingStore
from tolerance import assert_close, assert_same, served_tol

pytestmark = pytest.mark.timeout(60)

DIM = 4
ROWS = {"a": 60, "b": 90, "c": 50}  # a, b share a cache (dim 4); c has dim 8
# Bounds 0, one worker, bit for bit by design (docs/numerics.md): the cache sums repeated
# ids with the store's own ``coalesce`` and pushes every row of a batch at once, so each
# table of the store gets the same rows with the same sums in the same sorted order as the
# plain store's; every reused row is refreshed from the store.
SAME = "bounds (0, 0): the same pushes, rows in the same order, through the same kernels"


def _specs(opt: ps.Optimizer, init: ps.UniformInit | None = None) -> list[ps.TableSpec]:
    return [
        ps.TableSpec(name=n, num_rows=r, dim=DIM * (2 if n == "c" else 1), optimizer=opt, init=init)
        for n, r in ROWS.items()
    ]


def _batches(steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Skewed ids with repeats, unsorted: squares of small numbers modulo the rows.
    return [
        {n: torch.randint(0, 12, (9,), generator=g) ** 2 % r for n, r in ROWS.items()}
        for _ in range(steps)
    ]


def _step(
    store: ps.Store, ids: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> list[ps.PullResult]:
    got = store.pull_many([PullRequest(n, i) for n, i in ids.items()])
    store.push_many([PushRequest(n, i, grads[n]) for n, i in ids.items()])
    return got


@pytest.mark.parametrize("opt", [ps.SGD(lr=0.1, momentum=0.9), ps.Adam(lr=0.01)], ids=str)
@pytest.mark.parametrize("verify", [True, False])
def test_bounds_zero_bit_identical_to_the_plain_store(opt: ps.Optimizer, verify: bool) -> None:
    plain, inner = ps.InProcessStore(), ps.InProcessStore()
    for spec in _specs(opt):
        plain.create_table(spec)
        inner.create_table(spec)
    cfg = cache.CacheConfig(
        capacity_rows=6, group_tables=True, verify_prefetched=verify, prefetch="on"
    )
    store = cache.CachedStore(inner, cfg)
    batches = _batches(31, seed=1)
    g = torch.Generator().manual_seed(2)
    for step in range(30):
        ids = batches[step]
        store.prefetch_many([PullRequest(n, i) for n, i in batches[step + 1].items()])
        grads = {n: torch.randn(i.numel(), plain.spec(n).dim, generator=g) for n, i in ids.items()}
        got = _step(store, ids, grads)
        want = _step(plain, ids, grads)
        for n, a, b in zip(ids, got, want, strict=True):
            assert_same(a.rows, b.rows, what=f"step {step} {n} rows", why=SAME)
    store.flush()
    for n, r in ROWS.items():
        every = torch.arange(r)
        assert_same(inner.pull(n, every).rows, plain.pull(n, every).rows, what=n, why=SAME)
        assert torch.equal(inner.clocks(n, every), plain.clocks(n, every)), n
        assert_same(inner.state(n, every), plain.state(n, every), what=f"{n} state", why=SAME)
    stats = store.cache_stats()
    assert sorted(stats) == ["a+b", "c"]  # one cache for a and b, one for c
    assert stats["a+b"]["capacity"] == 12 and stats["a+b"]["evictions"] > 0
    assert stats["a+b"]["prefetched"] > 0


SERVED = (
    f"{REPLAY}, plus one rounding per local SGD step of a cached copy (the same float32 "
    "kernel on both sides) of the rows' magnitude"
)


@pytest.mark.parametrize("policy", ["lru", "lfu", "tinylfu"])
@pytest.mark.parametrize("bounds", [(0, 0), (2, 3)])
def test_a_shared_cache_is_one_cache_over_the_packed_tables(
    policy: str, bounds: tuple[int, int]
) -> None:
    """Tables a and b through a shared cache == one table 'ab' (a's rows, then b's)
    through a per-table cache of the same capacity, fed the packed ids."""
    opt = ps.RowWiseAdagrad(lr=0.1)
    same = ps.UniformInit(low=0.25, high=0.25, seed=0)  # equal first rows in both
    specs = [s for s in _specs(opt, same) if s.name != "c"]
    inner, ref_inner = ps.InProcessStore(), RecordingStore()  # its pushes: the tolerances
    for spec in specs:
        inner.create_table(spec)
    ref_inner.create_table(
        ps.TableSpec(name="ab", num_rows=ROWS["a"] + ROWS["b"], dim=DIM, optimizer=opt, init=same)
    )
    kw = dict(read_bound=bounds[0], write_bound=bounds[1], policy=policy, evict_chunk=1)
    store = cache.CachedStore(inner, cache.CacheConfig(capacity_rows=5, group_tables=True, **kw))
    ref = cache.CachedStore(ref_inner, cache.CacheConfig(capacity_rows=10, **kw))
    batches = _batches(26, seed=3)
    g = torch.Generator().manual_seed(4)
    every_packed = torch.arange(ROWS["a"] + ROWS["b"])
    store_tol = 0.0  # the largest replay tolerance of a store row so far
    moved = torch.zeros(ROWS["a"] + ROWS["b"])  # per row: its local SGD steps' moves summed
    touched = torch.zeros(ROWS["a"] + ROWS["b"], dtype=torch.int64)  # its batches so far
    for step in range(25):
        ids = {n: batches[step][n] for n in ("a", "b")}
        packed = torch.cat([ids["a"], ids["b"] + ROWS["a"]])
        nxt = torch.cat([batches[step + 1]["a"], batches[step + 1]["b"] + ROWS["a"]])
        store.prefetch_many([PullRequest(n, batches[step + 1][n]) for n in ("a", "b")])
        ref.prefetch_many([PullRequest("ab", nxt)])
        grads = {n: torch.randn(i.numel(), DIM, generator=g) for n, i in ids.items()}
        got = _step(store, ids, grads)
        want = ref.pull("ab", packed)
        store_tol = max(store_tol, ref_inner.rows_tol("ab", every_packed))
        tol = served_tol(store_tol, want.rows, moved[packed], touched[packed])
        pushed = torch.cat([grads["a"], grads["b"]])
        ref.push("ab", packed, pushed)
        moved.index_add_(0, packed, opt.lr * pushed.abs().amax(dim=1))
        touched[packed.unique()] += 1
        rows = torch.cat([r.rows for r in got])
        assert_close(rows, want.rows, atol=tol, what=f"step {step} served rows", why=SERVED)
    assert store.cached_ids("b").max() < ROWS["b"]
    want_b = ref.cached_ids("ab")
    assert torch.equal(store.cached_ids("b"), want_b[want_b >= ROWS["a"]] - ROWS["a"])
    store.flush()
    ref.flush()
    for n, lo in (("a", 0), ("b", ROWS["a"])):
        every = torch.arange(ROWS[n])
        packed = every + lo
        want = ref_inner.pull("ab", packed).rows
        ref_inner.assert_pull_close("ab", packed, inner.pull(n, every).rows, want, n)
        assert torch.equal(inner.clocks(n, every), ref_inner.clocks("ab", packed))
        ref_inner.assert_state_close("ab", packed, inner.state(n, every), n)
    mine, theirs = store.cache_stats()["a+b"], ref.cache_stats()["ab"]
    for key in ("hits", "misses", "refreshes", "evictions", "rows_pulled", "rows_pushed"):
        assert mine[key] == theirs[key], key


def test_one_message_per_step_and_cache_state_round_trip(tmp_path: Path) -> None:
    opt = ps.SGD(lr=0.5)
    inner = ps.InProcessStore()
    for spec in _specs(opt):
        inner.create_table(spec)
    cfg = cache.CacheConfig(capacity_rows=8, group_tables=True, read_bound=1, write_bound=1)
    store = cache.CachedStore(inner, cfg)
    batches = _batches(12, seed=5)
    grads = {n: torch.ones(9, inner.spec(n).dim) for n in ROWS}
    for step in range(5):
        store.prefetch_many([PullRequest(n, i) for n, i in batches[step + 1].items()])
        before = inner.request_counts()
        _step(store, batches[step], grads)
        after = inner.request_counts()
        assert after["pull_messages"] - before["pull_messages"] == 1, step
        assert after["push_messages"] - before["push_messages"] <= 1, step
    state = store.cache_state()
    assert sorted(state) == ["a+b", "c"]
    inner.save(tmp_path / "ps")
    copy = ps.InProcessStore()
    copy.load(tmp_path / "ps")
    resumed = cache.CachedStore(copy, cfg)
    resumed.load_cache_state(state)
    for n in ROWS:
        assert torch.equal(resumed.cached_ids(n), store.cached_ids(n)), n
    # Both continue alike from the same cache contents and a copy of the same store bits.
    why = "the same requests on copies of the same bits, through the same kernels"
    for step in range(5, 10):
        a = _step(store, batches[step], grads)
        b = _step(resumed, batches[step], grads)
        for x, y in zip(a, b, strict=True):
            assert_same(x.rows, y.rows, what=f"step {step} rows", why=why)


def test_dropping_one_table_keeps_the_others_pending_updates() -> None:
    inner = ps.InProcessStore()
    for spec in _specs(ps.SGD(lr=1.0)):
        inner.create_table(spec)
    cfg = cache.CacheConfig(capacity_rows=10, group_tables=True, write_bound=5)
    store = cache.CachedStore(inner, cfg)
    ids = torch.tensor([1, 2])
    store.pull_many([PullRequest("a", ids), PullRequest("b", ids)])
    before = inner.pull("b", ids).rows
    store.push_many(
        [PushRequest("a", ids, torch.ones(2, DIM)), PushRequest("b", ids, torch.ones(2, DIM))]
    )
    pending = "the updates are pending in the cache: nothing reached the store"
    assert_same(inner.pull("b", ids).rows, before, what="b before the drop", why=pending)
    store.drop_table("a")
    # Flushed, not lost: SGD lr 1 on a gradient of ones is one float32 subtraction of 1.
    flushed = "one correctly rounded subtraction of 1 on both sides"
    assert_same(inner.pull("b", ids).rows, before - 1.0, what="b after the drop", why=flushed)
    assert store.pull("b", ids).rows.shape == (2, DIM)  # b is cached again, alone
    assert sorted(store.cache_stats()) == ["b"]
    with pytest.raises(ValueError, match="'a'"):
        store.pull("a", ids)


def test_bad_requests_name_the_table_not_the_group() -> None:
    inner = ps.InProcessStore()
    for spec in _specs(ps.SGD(lr=1.0)):
        inner.create_table(spec)
    store = cache.CachedStore(inner, cache.CacheConfig(capacity_rows=4, group_tables=True))
    with pytest.raises(ValueError, match=r"table 'a'.*60"):
        store.pull_many(
            [PullRequest("b", torch.tensor([70])), PullRequest("a", torch.tensor([60]))]
        )
    with pytest.raises(ValueError, match="'b'"):
        store.push_many([PushRequest("b", torch.tensor([1]), torch.full((1, DIM), float("nan")))])
    stats = store.cache_stats()  # a group named in the order of its first request
    assert list(stats) == ["b+a"] and stats["b+a"]["updates"] == 0  # nothing reached it


def test_only_tables_requested_together_share_a_cache() -> None:
    inner = ps.InProcessStore()
    for spec in _specs(ps.SGD(lr=1.0)):
        inner.create_table(spec)
    inner.create_table(ps.TableSpec(name="d", num_rows=30, dim=DIM, optimizer=ps.SGD(lr=1.0)))
    store = cache.CachedStore(inner, cache.CacheConfig(capacity_rows=4, group_tables=True))
    ids = torch.tensor([1, 2])
    store.pull_many([PullRequest("a", ids), PullRequest("b", ids), PullRequest("c", ids)])
    store.pull("d", ids)  # d fits the group but was not asked with it
    assert sorted(store.cache_stats()) == ["a+b", "c", "d"]
