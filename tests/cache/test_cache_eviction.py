"""LRU / LFU eviction, write-back of evicted pending rows, and the bounded-staleness rules,
checked against a sequential replay: a per-id Python model of the cache rules (dicts, one
row at a time) driving its own InProcessStore. Cached ids and clocks must be identical;
served rows and the final PS rows and optimizer state bit-identical at bounds (0, 0), and
otherwise equal up to the rounding of the store's kernels on another grouping of rows:
the model pushes an evicted row's pending sum at once, the cache with its next push."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch

import cache
import ps
from cache.policy import FREE, TICK_BITS, EvictionPolicy
from ps_reference import WHY as REPLAY
from ps_reference import RecordingStore
from tolerance import assert_close, assert_same, served_tol

pytestmark = pytest.mark.timeout(120)

DIM = 4
ROWS = 40


@dataclass
class _Entry:
    row: torch.Tensor  # [D]
    clock: int
    state: torch.Tensor | None = None  # the optimizer's local step: the row's state [S]
    pend: torch.Tensor | None = None  # [D]
    sq: torch.Tensor | None = None  # the counted push's statistic of `pend` [Q]
    count: int = 0
    last_use: int = 0
    freq: int = 0


class ReplayCache:
    """The documented cache rules, one id at a time (docs/cache.md), over ``store``; the
    copies take an SGD step of ``lr``, or with ``opt`` that optimizer's step with the
    row's state (read from the store with the row)."""

    def __init__(
        self,
        store: ps.Store,
        cap: int,
        s_r: int,
        s_w: int,
        lr: float,
        policy: str,
        opt: ps.Optimizer | None = None,
    ) -> None:
        self.store, self.cap, self.s_r, self.s_w, self.lr, self.policy = (
            store,
            cap,
            s_r,
            s_w,
            lr,
            policy,
        )
        self.opt = opt
        self.e: dict[int, _Entry] = {}
        self.tick = 0
        spec = store.spec("t")
        self.q = spec.optimizer.stat_dim(spec.dim) if s_w > 0 else 0
        self.counted = s_w > 0  # rows pushed with their updates' count and statistic

    def _square(self, g: torch.Tensor) -> torch.Tensor:
        """The statistic of one update ``g`` ``[D]`` (``[Q]``: mean(g^2) or g^2)."""
        return (g * g).mean().reshape(1) if self.q == 1 else (g * g)[: self.q]

    def _send(
        self, ids: list[int], grads: list[torch.Tensor], entries: list[_Entry | None]
    ) -> None:
        """One push of ``ids``; ``entries[i]`` the cached row whose pending updates it
        carries (None: one update of a row not cached)."""
        if not ids:
            return
        g = torch.stack(grads)
        if not self.counted:
            self.store.push("t", torch.tensor(ids), g)
            return
        counts = torch.tensor([1 if e is None else e.count for e in entries])
        stats = torch.stack(
            [torch.zeros(self.q) if e is None or e.sq is None else e.sq for e in entries]
        )
        self.store.push_many([ps.PushRequest("t", torch.tensor(ids), g, counts, stats)])

    def _key(self, i: int) -> tuple[int, ...]:
        e = self.e[i]
        return (e.last_use, i) if self.policy == "lru" else (e.freq, e.last_use, i)

    def pull(self, ids: list[int]) -> torch.Tensor:
        self.tick += 1
        ids = sorted(set(ids))
        ps_clock = self.store.clocks("t", torch.tensor(ids)).tolist()
        out: dict[int, torch.Tensor] = {}
        misses = []
        for i, c in zip(ids, ps_clock, strict=True):
            e = self.e.get(i)
            if e is None:
                misses.append(i)
                continue
            if c > e.clock + self.s_r:  # refresh; re-apply unpushed local updates
                fresh = self.store.pull("t", torch.tensor([i])).rows[0]
                if self.opt is not None:  # the PS row and state, advanced as the PS will
                    e.row, e.state = fresh.clone(), self._state(i)
                    if e.count > 0:
                        assert e.pend is not None
                        self._ahead(e)
                    e.clock = c
                    e.last_use, e.freq = self.tick, e.freq + 1
                    continue
                if e.count > 0 and self.lr != 0:
                    assert e.pend is not None
                    fresh = fresh - self.lr * e.pend
                e.row, e.clock = fresh, c
            e.last_use, e.freq = self.tick, e.freq + 1
        need = len(misses) - (self.cap - len(self.e))
        if need > 0:
            cands = [i for i, e in self.e.items() if e.last_use < self.tick]
            victims = sorted(cands, key=self._key)[:need]
            pending = [i for i in victims if self.e[i].count > 0]
            pend = [self.e[i].pend for i in pending]
            self._send(pending, pend, [self.e[i] for i in pending])  # type: ignore[arg-type]
            for i in victims:
                del self.e[i]
        free = self.cap - len(self.e)
        for n, i in enumerate(misses):
            got = self.store.pull("t", torch.tensor([i]))
            if n < free:
                self.e[i] = _Entry(got.rows[0], int(got.clocks[0]), last_use=self.tick, freq=1)
                if self.opt is not None:
                    self.e[i].state = self._state(i)
            else:
                out[i] = got.rows[0]  # passed through
        return torch.stack([out[i] if i in out else self.e[i].row for i in ids])

    def push(self, ids: list[int], grads: torch.Tensor) -> None:
        push_ids, push_g, owners = [], [], []
        for i, g in zip(ids, grads, strict=True):
            e = self.e.get(i)
            if e is None:
                push_ids.append(i)
                push_g.append(g)
                owners.append(None)
                continue
            e.pend = g.clone() if e.count == 0 else e.pend + g  # type: ignore[operator]
            sq = self._square(g)
            e.sq = sq if e.count == 0 or e.sq is None else e.sq + sq
            if self.opt is not None:
                assert e.state is not None
                row, state = e.row.clone().unsqueeze(0), e.state.clone().unsqueeze(0)
                self.opt.apply(row, state, g.unsqueeze(0))
                e.row, e.state = row[0], state[0]
            elif self.lr != 0:
                e.row = e.row - self.lr * g
            e.count += 1
            if e.count > self.s_w:
                push_ids.append(i)
                push_g.append(e.pend)
                owners.append(_Entry(e.row, e.clock, count=e.count, sq=e.sq))
                e.pend, e.sq, e.count = None, None, 0
        self._send(push_ids, push_g, owners)

    def _state(self, i: int) -> torch.Tensor:
        return self.store.state("t", torch.tensor([i]))[0]

    def _ahead(self, e: _Entry) -> None:
        """``e``'s row and state (the PS's) advanced by its pending updates."""
        assert self.opt is not None and e.state is not None and e.pend is not None
        row, state = e.row.clone().unsqueeze(0), e.state.clone().unsqueeze(0)
        if self.counted:
            sq = e.sq if e.sq is not None else torch.zeros(self.q)
            counts, stats = torch.tensor([e.count]), sq.reshape(1, -1)
            self.opt.apply_counted(row, state, e.pend.unsqueeze(0), counts, stats)
        else:
            self.opt.apply(row, state, e.pend.unsqueeze(0))
        e.row, e.state = row[0], state[0]

    def flush(self) -> None:
        pending = sorted(i for i, e in self.e.items() if e.count > 0)
        self._send(pending, [self.e[i].pend for i in pending], [self.e[i] for i in pending])  # type: ignore[misc]
        for i in pending:
            self.e[i].pend, self.e[i].sq, self.e[i].count = None, None, 0


def _stores(opt: ps.Optimizer) -> tuple[ps.InProcessStore, RecordingStore]:
    """The cache's store and the model's (which remembers its pushes, for tolerances)."""
    a, b = ps.InProcessStore(), RecordingStore()
    for s in (a, b):
        s.create_table(ps.TableSpec(name="t", num_rows=ROWS, dim=DIM, optimizer=opt))
    return a, b


def _batches(steps: int, seed: int) -> list[list[int]]:
    """Skewed id sets: a few hot ids in most batches, a long tail."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.distributions.Categorical(1.0 / torch.arange(1, ROWS + 1).float() ** 1.1)
    torch.manual_seed(seed)
    perm = torch.randperm(ROWS, generator=g)
    out = []
    for _ in range(steps):
        n = int(torch.randint(3, 12, (1,), generator=g))
        out.append(sorted(set(perm[ranks.sample((n,))].tolist())))
    return out


OPTS = {
    "sgd": ps.SGD(lr=0.1),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.1),
    "adam": ps.Adam(lr=0.01),
}


# Bounds (0, 0), bit for bit by design (docs/numerics.md): every update is pushed at once
# (nothing is pending when a row is evicted), so both stores get each batch's rows with the
# same gradients in the same sorted order, and every reused row is refreshed from the store.
SAME = "bounds (0, 0): the same pushes, rows in the same order, through the same kernels"
SERVED = (
    f"{REPLAY}, plus one rounding per local step of a cached copy (the same float32 "
    "operations in the cache and the model) of the rows' magnitude"
)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(("s_r", "s_w"), [(0, 0), (2, 3), (4, 1)])
@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("local_step", ["optimizer", "sgd"])
def test_matches_sequential_replay(
    policy: Literal["lru", "lfu"],
    s_r: int,
    s_w: int,
    opt: str,
    local_step: Literal["optimizer", "sgd"],
) -> None:
    inner, ref_store = _stores(OPTS[opt])
    cfg = cache.CacheConfig(
        capacity_rows=8,
        policy=policy,
        read_bound=s_r,
        write_bound=s_w,
        evict_chunk=1,
        local_step=local_step,
    )
    store = cache.CachedStore(inner, cfg)
    spec = inner.spec("t")
    ref = ReplayCache(ref_store, 8, s_r, s_w, cfg.lr_for(spec), policy, cfg.local_optimizer(spec))
    g = torch.Generator().manual_seed(7)
    exact = (s_r, s_w) == (0, 0)
    every = torch.arange(ROWS)
    store_tol = 0.0  # the largest replay tolerance of a store row so far
    moved = torch.zeros(ROWS)  # per row: its local SGD steps' moves summed
    touched = torch.zeros(ROWS, dtype=torch.int64)  # per row: its batches so far
    for step, ids in enumerate(_batches(60, seed=3)):
        got = store.pull("t", torch.tensor(ids)).rows
        want = ref.pull(ids)
        what = f"step {step}: served rows"
        if exact:
            assert_same(got, want, what=what, why=SAME)
        else:
            store_tol = max(store_tol, ref_store.rows_tol("t", every))
            t = torch.tensor(ids)
            tol = served_tol(store_tol, want, moved[t], touched[t])
            assert_close(got, want, atol=tol, what=what, why=SERVED)
        assert store.cached_ids("t").tolist() == sorted(ref.e), f"step {step}: cached ids"
        grads = torch.randn(len(ids), DIM, generator=g)
        store.push("t", torch.tensor(ids), grads)
        before = torch.stack([ref.e[i].row if i in ref.e else torch.zeros(DIM) for i in ids])
        ref.push(ids, grads)
        after = torch.stack([ref.e[i].row if i in ref.e else torch.zeros(DIM) for i in ids])
        moved[torch.tensor(ids)] += (after - before).abs().amax(dim=1)  # ids distinct
        touched[torch.tensor(ids)] += 1
    store.flush()
    ref.flush()
    rows, state = inner.pull("t", every).rows, inner.state("t", every)
    ref_store.assert_table("t", every, rows, state, exact=SAME if exact else None, what="store")
    assert torch.equal(inner.clocks("t", every), ref_store.clocks("t", every))
    st = store.cache_stats()["t"]
    assert st["evictions"] > 0 and st["pending_rows"] == 0
    if s_w > 0:
        assert st["evicted_pending"] > 0  # pending rows were evicted (and pushed)
    assert max(st["staleness_served"]) <= s_r


def test_lru_and_lfu_choose_different_victims() -> None:
    """Capacity 3: id 0 used often long ago, 1 and 2 used once recently; a new id 3 arrives.
    LRU evicts 0 (least recent); LFU keeps 0 (most used) and evicts 1 (fewest uses, older)."""
    cases: list[tuple[Literal["lru", "lfu"], int]] = [("lru", 0), ("lfu", 1)]
    for policy, evicted in cases:
        inner, _ = _stores(ps.SGD(lr=0.1))
        cfg = cache.CacheConfig(capacity_rows=3, policy=policy, evict_chunk=1)
        store = cache.CachedStore(inner, cfg)
        for ids in ([0], [0], [0], [1], [2], [3]):
            store.pull("t", torch.tensor(ids))
        assert store.cached_ids("t").tolist() == sorted({0, 1, 2, 3} - {evicted}), policy
        assert store.cache_stats()["t"]["evictions"] == 1


def test_lfu_counts_repeats_within_a_request() -> None:
    """Frequency counts lookups, not distinct keys: an id repeated in one request counts twice."""
    inner, _ = _stores(ps.SGD(lr=0.1))
    store = cache.CachedStore(
        inner, cache.CacheConfig(capacity_rows=2, policy="lfu", evict_chunk=1)
    )
    store.pull("t", torch.tensor([5, 6, 6]))  # 5 once, 6 twice
    store.pull("t", torch.tensor([7]))  # evicts 5 (fewer uses), not 6
    assert store.cached_ids("t").tolist() == [6, 7]


def test_evicted_pending_updates_are_pushed_never_dropped() -> None:
    """SGD with lr 1/2 on gradients in multiples of 1/8: exact arithmetic, so after flush every
    row is exactly its initial value minus lr times the sum of all its gradients, however the
    cache batched and evicted them (capacity 4 of 40 rows, write bound 5)."""
    inner, _ = _stores(ps.SGD(lr=0.5))
    every = torch.arange(ROWS)
    zero = inner.pull("t", every).rows
    inner.push("t", every, 2 * zero)  # rows := 0 (exactly)
    cfg = cache.CacheConfig(capacity_rows=4, read_bound=3, write_bound=5, local_lr=0.0)
    store = cache.CachedStore(inner, cfg)
    total = torch.zeros(ROWS, DIM)
    g = torch.Generator().manual_seed(1)
    for ids in _batches(80, seed=5):
        t = torch.tensor(ids)
        store.pull("t", t)
        grads = torch.randint(-8, 9, (len(ids), DIM), generator=g).float() / 8
        store.push("t", t, grads)
        total[t] += grads
    st = store.cache_stats()["t"]
    assert st["evicted_pending"] > 0 and st["pending_rows"] > 0
    store.flush()
    assert store.cache_stats()["t"]["pending_rows"] == 0
    # Rows from 0, lr 1/2, multiples of 1/8: every partial sum and update is exact.
    exact = "SGD lr 1/2 from 0 on multiples of 1/8: every sum exact in float32"
    assert_same(inner.pull("t", every).rows, -0.5 * total, what="rows after flush", why=exact)


@pytest.mark.parametrize("kind", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_victim_search_equals_partitioning_every_key(kind: str, seed: int) -> None:
    """``EvictionPolicy.victims`` (a strided sample bounds the k smallest keys, then one
    pass collects them) picks exactly the slots a partition of every key picks: the k
    smallest keys among the evictable, unprotected slots, ties at the k-th by smaller row
    id, over many ties (few distinct ticks and frequencies) and every k."""
    rng = np.random.default_rng(seed)
    c, tick = 300_000, 50  # large enough that the sample is one key in 4
    policy = EvictionPolicy(c, kind)
    last = rng.integers(0, tick + 3, c)  # some used at or after tick: not evictable
    freq = rng.integers(0, 4, c) if policy.lfu else np.zeros(c, dtype=np.int64)
    policy.key[:] = (freq << 32) + last if policy.lfu else last
    policy.key[rng.integers(0, c, c // 50)] = FREE
    row_id = rng.permutation(10 * c)[:c].astype(np.int64)
    protect = rng.integers(0, c, c // 20)

    def by_partition(k: int) -> np.ndarray:
        key = np.where(policy.evictable(tick), policy.key, FREE)
        key[protect] = FREE
        if k >= int(np.count_nonzero(key != FREE)):
            return np.flatnonzero(key != FREE)
        cut = np.partition(key, k - 1)[k - 1]
        below, at = np.flatnonzero(key < cut), np.flatnonzero(key == cut)
        at = at[np.argsort(row_id.take(at), kind="stable")][: k - below.size]
        return np.concatenate([below, at])

    for k in (1, 3, 1000, c // 16, c // 5, c // 2, c):
        got = policy.victims(k, tick, protect, row_id)
        assert np.array_equal(got, by_partition(k)), k


def test_pool_victims_skip_each_calls_protected_slots_over_many_calls() -> None:
    """``EvictionPolicy.ordered_victims`` from its pool: each call's victims are the first
    pool entries that are still valid and not in that call's ``protect`` (which may hold
    -1, an uncached id), call after call, so slots protected in an earlier call are not
    left out of a later one (the marks are per call)."""
    rng = np.random.default_rng(5)
    c, tick = 5_000, 100
    policy = EvictionPolicy(c, "tinylfu")
    policy.key[:] = (rng.integers(0, 8, c) << 32) + rng.integers(0, tick, c)
    row_id = np.arange(c, dtype=np.int64)
    chunk = c // 2
    for call in range(600):
        protect = np.concatenate([rng.integers(0, c, 200), [-1, -1]])
        k = int(rng.integers(1, 50))
        got = policy.ordered_victims(k, tick, protect, row_id, chunk)
        pool = policy.pool[policy.pool_at :]
        valid = (policy.key.take(pool) == policy.pool_key[policy.pool_at :]) & ~np.isin(
            pool, protect
        )
        assert np.array_equal(got, pool[valid][:k]), call
        assert not np.isin(got, protect).any()
        assert np.array_equal(policy.taken_frequency(), policy.key[got] >> TICK_BITS)


@pytest.mark.parametrize("seed", range(3))
def test_the_pool_is_in_key_order_ties_by_row_id(seed: int) -> None:
    """The pool a search leaves (``EvictionPolicy.ordered_victims``) is the victims sorted
    by key, ties by smaller row id: ``np.lexsort`` of the two, over many ties."""
    rng = np.random.default_rng(seed)
    c, tick = 20_000, 30
    policy = EvictionPolicy(c, "tinylfu")
    policy.key[:] = (rng.integers(0, 3, c) << 32) + rng.integers(0, tick, c)  # many ties
    row_id = rng.permutation(50 * c)[:c].astype(np.int64)
    got = policy.ordered_victims(c // 4, tick, None, row_id, c // 2)
    found = policy.victims(c // 2, tick, None, row_id)
    want = found[np.lexsort((row_id.take(found), policy.key.take(found)))]
    assert np.array_equal(policy.pool, want)
    assert np.array_equal(got, want[: c // 4])
