"""TinyLFU admission (``CacheConfig(policy="tinylfu")``).

* The cache against a per-id pure-Python model of the policy (same multiply-shift
  hashes, same halving, same victim pool, same decisions), step by step over random
  Zipf batches: identical sketch counters, admitted ids, rejections and cached ids.
* Bounds 0, one worker: bit-identical to the plain store, with admissions refused,
  evictions and prefetch (both prefetch modes, and tables sharing one cache).
* Bounds (2, 3) with SGD: every pending gradient of refused and evicted rows reaches the
  store exactly (gradients and step size chosen so float sums are exact).
* The sketch itself, the cache checkpoint of the sketch, and config errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import ps
from cache.sketch import MULTIPLIERS, FrequencySketch
from tolerance import assert_same

pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

MASK = (1 << 64) - 1


def _zipf_batches(rows: int, n: int, size: int, seed: int, a: float = 1.2) -> list[np.ndarray]:
    """``n`` batches of ``size`` Zipf(``a``) draws over ``rows`` ids (ranks scattered)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows)
    return [perm[(rng.zipf(a, size) - 1) % rows].astype(np.int64) for _ in range(n)]


class Model:
    """TinyLFU by the rules of ``docs/cache_admission.md``, one id at a time in Python."""

    def __init__(self, capacity: int, width: int, depth: int, period: int, chunk: int) -> None:
        self.capacity, self.width, self.depth, self.period = capacity, width, depth, period
        self.chunk = chunk
        self.lines, self.per_row = depth * width // 16, 16 // depth
        self.counters = [0] * (depth * width)  # flat, lines of 16
        self.added = 0
        self.key: dict[int, tuple[int, int]] = {}  # cached id -> (frequency, last tick)
        self.pool: list[tuple[int, tuple[int, int]]] = []  # (id, key when found)
        self.pool_at = 0
        self.tick = 0
        self.rejected = 0

    def _cells(self, x: int) -> list[int]:
        """The flat positions of ``x``'s counters: one line, ``per_row`` slots per row."""
        h = [(x * MULTIPLIERS[d]) & MASK for d in range(self.depth)]
        line = ((h[0] >> 32) * self.lines) >> 32
        k = self.per_row
        return [
            16 * line + d * k + ((((h[d] >> 16) & 0xFFFF) * k) >> 16) for d in range(self.depth)
        ]

    def estimate(self, x: int) -> int:
        return min(self.counters[c] for c in self._cells(x))

    def _add(self, ids: list[int]) -> None:
        for x in ids:
            for c in self._cells(x):
                self.counters[c] += 1
        self.added += len(ids)
        if self.added >= self.period:  # halve the sketch and the frequencies kept
            self.counters = [c >> 1 for c in self.counters]
            self.added = 0
            self.key = {x: (f >> 1, t) for x, (f, t) in self.key.items()}
            self.pool_at = len(self.pool)

    def _valid(self, x: int, key: tuple[int, int]) -> bool:
        return self.key.get(x) == key and key[1] < self.tick

    def _victims(self, k: int) -> list[int]:
        """The first ``k`` valid pool entries; a new search of max(k, chunk) if short
        (always with chunk 1: the exact order)."""
        if k <= 0:
            return []
        got: list[int] = []
        if self.chunk > 1:
            got = [x for x, key in self.pool[self.pool_at :] if self._valid(x, key)][:k]
        if len(got) < k:
            ranked = sorted((key, x) for x, key in self.key.items() if key[1] < self.tick)
            self.pool = [(x, key) for key, x in ranked[: max(k, self.chunk)]]
            self.pool_at = 0
            got = [x for x, _ in self.pool[:k]]
        return got

    def step(self, batch: np.ndarray) -> set[int]:
        """Serve one batch; the ids admitted."""
        self.tick += 1
        ids = sorted({int(x) for x in batch})
        self._add(ids)
        est = {x: self.estimate(x) for x in ids}
        for x in ids:  # this batch's cached rows are in use: not victims
            if x in self.key:
                self.key[x] = (self.key[x][0], self.tick)
        misses = sorted((x for x in ids if x not in self.key), key=lambda x: (-est[x], x))
        free = min(len(misses), self.capacity - len(self.key))
        victims = self._victims(len(misses) - free)
        n = 0
        while n < len(victims) and est[misses[free + n]] > self.key[victims[n]][0]:
            n += 1
        for v in victims[:n]:
            del self.key[v]
        if n:  # later searches start after the last victim taken
            last = victims[n - 1]
            self.pool_at += [x for x, _ in self.pool[self.pool_at :]].index(last) + 1
        admitted = misses[: free + n]
        self.rejected += len(misses) - len(admitted)
        for x in ids:
            if x in self.key or x in admitted:
                self.key[x] = (est[x], self.tick)
        return set(admitted)


@pytest.mark.parametrize("sole", [False, True], ids=["shared", "sole-writer"])
@pytest.mark.parametrize("chunk", [1, 6, 24])
def test_matches_the_per_id_model(chunk: int, sole: bool) -> None:
    rows, capacity, dim = 400, 40, 4
    width, depth, period = 128, 3, 120
    spec = ps.TableSpec(name="t", num_rows=rows, dim=dim, optimizer=ps.SGD(lr=0.1))
    inner = ps.InProcessStore()
    inner.create_table(spec)
    cfg = cache.CacheConfig(
        capacity_rows=capacity, policy="tinylfu", read_bound=1, write_bound=2,
        evict_chunk=chunk, sketch_width=width, sketch_depth=depth, sketch_period=period,
        sole_writer=sole,
    )  # fmt: skip
    store = cache.CachedStore(inner, cfg)
    model = Model(capacity, width, depth, period, chunk)
    g = torch.Generator().manual_seed(1)
    before: set[int] = set()
    for step, batch in enumerate(_zipf_batches(rows, 60, 24, seed=chunk)):
        ids = torch.from_numpy(batch)
        store.pull("t", ids)
        store.push("t", ids, torch.randn(ids.numel(), dim, generator=g))
        admitted = model.step(batch)
        cached = set(store.cached_ids("t").tolist())
        assert cached == set(model.key), f"step {step}"
        assert cached - before == admitted, f"step {step}"
        before = cached
        sketch = store._caches["t"].sketch
        assert sketch is not None
        want = torch.tensor(model.counters, dtype=torch.int32)
        assert torch.equal(sketch.counters, want), f"step {step}"
        assert store.cache_stats()["t"]["rejected"] == model.rejected
    st = store.cache_stats()["t"]
    assert st["rejected"] > 0 and st["evictions"] > 0 and st["sketch_halvings"] > 0


# Bounds 0, one worker, bit for bit by design (docs/numerics.md): the cache sums repeated
# ids with the store's own ``coalesce`` and pushes every row of a batch at once (refused
# rows pass through in the same push), so each store gets the same rows with the same sums
# in the same sorted order; every reused row is refreshed from the store.
SAME = "bounds (0, 0): the same pushes, rows in the same order, through the same kernels"
# SGD with lr 1 from zero rows on multiples of 1/4: every partial sum and every update is
# exact in float32, so any grouping of the pushes gives the exact sum.
EXACT = "SGD lr 1 from 0 on multiples of 1/4: every sum exact in float32"


def _same_tables(a: ps.Store, b: ps.Store, table: str, rows: int) -> None:
    every = torch.arange(rows)
    assert_same(a.pull(table, every).rows, b.pull(table, every).rows, what="rows", why=SAME)
    assert torch.equal(a.clocks(table, every), b.clocks(table, every))
    assert_same(a.state(table, every), b.state(table, every), what="state", why=SAME)


@pytest.mark.parametrize(
    ("prefetch", "verify", "grouped"),
    [(False, True, False), (True, True, False), (True, False, False), (True, True, True)],
    ids=["plain", "prefetch", "prefetch-trusted", "grouped"],
)
def test_bounds_zero_bit_identical(prefetch: bool, verify: bool, grouped: bool) -> None:
    rows, dim = 300, 8
    names = ["a", "b"] if grouped else ["a"]
    plain, inner = ps.InProcessStore(), ps.InProcessStore()
    for n in names:
        spec = ps.TableSpec(name=n, num_rows=rows, dim=dim, optimizer=ps.RowWiseAdagrad(lr=0.1))
        plain.create_table(spec)
        inner.create_table(spec)
    cfg = cache.CacheConfig(
        capacity_rows=30, policy="tinylfu", verify_prefetched=verify, group_tables=grouped,
        sketch_width=256, sketch_period=200, prefetch="on",
    )  # fmt: skip
    store = cache.CachedStore(inner, cfg)
    g = torch.Generator().manual_seed(0)
    per_table = {n: _zipf_batches(rows, 41, 20, seed=i) for i, n in enumerate(names)}
    batches = [{n: torch.from_numpy(per_table[n][s]) for n in names} for s in range(41)]
    for step in range(40):
        ids = batches[step]  # repeats and unsorted order on purpose
        if prefetch:
            store.prefetch_many([ps.PullRequest(n, batches[step + 1][n]) for n in names])
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in names])
        want = plain.pull_many([ps.PullRequest(n, ids[n]) for n in names])
        for x, y in zip(got, want, strict=True):
            assert_same(x.rows, y.rows, what=f"step {step} rows", why=SAME)
        grads = {n: torch.randn(ids[n].numel(), dim, generator=g) for n in names}
        store.push_many([ps.PushRequest(n, ids[n], grads[n]) for n in names])
        plain.push_many([ps.PushRequest(n, ids[n], grads[n]) for n in names])
    store.flush()
    for n in names:
        _same_tables(inner, plain, n, rows)
    (st,) = store.cache_stats().values()
    assert st["staleness_served"] == {0: st["lookups"]}
    assert st["rejected"] > 0 and st["evictions"] > 0
    assert st["prefetched"] > 0 or not prefetch


@pytest.mark.parametrize("prefetch", [False, True])
def test_pending_sums_of_refused_and_evicted_rows_reach_the_store(prefetch: bool) -> None:
    """SGD (lr 1) on the store, rows starting at 0, gradients multiples of 1/4: every sum
    is exact in float32, so after flush each row is minus the sum of its gradients."""
    rows, dim = 300, 4
    zero = ps.UniformInit(low=0.0, high=0.0)
    spec = ps.TableSpec(name="t", num_rows=rows, dim=dim, optimizer=ps.SGD(lr=1.0), init=zero)
    inner = ps.InProcessStore()
    inner.create_table(spec)
    every = torch.arange(rows)
    cfg = cache.CacheConfig(
        capacity_rows=25, policy="tinylfu", read_bound=2, write_bound=3, local_lr=0.0,
        sketch_width=128, sketch_period=150,
    )  # fmt: skip
    store = cache.CachedStore(inner, cfg)
    total = torch.zeros(rows, dim)
    g = torch.Generator().manual_seed(3)
    batches = [torch.from_numpy(b) for b in _zipf_batches(rows, 51, 24, seed=5)]
    for step in range(50):
        ids = batches[step]
        if prefetch:
            store.prefetch("t", batches[step + 1])
        store.pull("t", ids)
        grads = torch.randint(-8, 9, (ids.numel(), dim), generator=g).float() / 4
        store.push("t", ids, grads)
        total.index_add_(0, ids, grads)
    st = store.cache_stats()["t"]
    assert st["rejected"] > 0 and st["evicted_pending"] > 0 and st["pending_rows"] > 0
    store.flush()
    assert_same(inner.pull("t", every).rows, -total, what="rows after flush", why=EXACT)


def test_sketch_counts_halves_and_never_underestimates() -> None:
    sk = FrequencySketch(width=64, depth=3, period=1000)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, 300).astype(np.int64)  # repeats count each time
    assert not sk.add(ids)
    uniq, true = np.unique(ids, return_counts=True)
    assert (sk.estimate(uniq) >= true).all()
    assert int(sk.counters.sum()) == 3 * ids.size
    before = sk.counters.clone()
    assert sk.add(np.arange(700, dtype=np.int64))  # 1000 added: halved
    assert sk.added == 0 and sk.halvings == 1
    again = FrequencySketch(width=64, depth=3, period=10**6)
    again.counters.copy_(before)
    again.add(np.arange(700, dtype=np.int64))
    assert torch.equal(sk.counters, again.counters >> 1)


def test_cache_state_keeps_the_sketch() -> None:
    spec = ps.TableSpec(name="t", num_rows=100, dim=4, optimizer=ps.SGD(lr=0.1))
    inner = ps.InProcessStore()
    inner.create_table(spec)
    cfg = cache.CacheConfig(capacity_rows=10, policy="tinylfu", sketch_width=64)
    store = cache.CachedStore(inner, cfg)
    for b in _zipf_batches(100, 10, 16, seed=2):
        store.pull("t", torch.from_numpy(b))
    state = store.cache_state()
    other = cache.CachedStore(inner, cfg)
    other.load_cache_state(state)
    sa, sb = store._caches["t"].sketch, other._caches["t"].sketch
    assert sa is not None and sb is not None
    assert torch.equal(sa.counters, sb.counters)
    assert (sa.added, sa.halvings) == (sb.added, sb.halvings)
    assert torch.equal(store.cached_ids("t"), other.cached_ids("t"))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"policy": "arc"}, r"policy must be one of \('lru', 'lfu', 'tinylfu'\), got 'arc'"),
        ({"policy": "lfu", "sketch_width": 64}, r"sketch_width=64 applies to policy='tinylfu'"),
        ({"policy": "tinylfu", "sketch_width": 100}, r"sketch_width must be a power of 2"),
        ({"policy": "tinylfu", "sketch_depth": 9}, r"sketch_depth must be in \[1, 8\], got 9"),
        ({"policy": "tinylfu", "sketch_period": 0}, r"sketch_period must be >= 1, got 0"),
    ],
)
def test_config_errors(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cache.CacheConfig(capacity_rows=10, **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sketch_depth must be an int, got float"):
        cache.CacheConfig(capacity_rows=10, policy="tinylfu", sketch_depth=2.0)  # type: ignore[arg-type]


def test_default_sketch_size() -> None:
    cfg = cache.CacheConfig(capacity_rows=1000, policy="tinylfu")
    assert cfg.sketch(1000) == (1024, 4, 10_000)
    assert cfg.sketch(1025) == (2048, 4, 10_250)


@pytest.mark.parametrize("sole", [False, True], ids=["shared", "sole-writer"])
@pytest.mark.parametrize("verify", [True, False], ids=["misses-only", "trusted"])
@pytest.mark.parametrize("riding", [True, False], ids=["riding", "standalone"])
def test_installs_decide_by_the_estimates_of_their_plan(
    monkeypatch: pytest.MonkeyPatch, riding: bool, verify: bool, sole: bool
) -> None:
    """A fetch's install decides admissions with the estimates its plan took
    (``Fetch.est``), which needs nothing counted in between: at every install, for a
    serving pull (every id) and for a prefetch (its misses), they are the sketch's."""
    from cache.table_cache import Fetch, TableCache

    rows, dim = 300, 4
    spec = ps.TableSpec(name="t", num_rows=rows, dim=dim, optimizer=ps.SGD(lr=0.1))
    inner = ps.InProcessStore()
    inner.create_table(spec)
    cfg = cache.CacheConfig(
        capacity_rows=30, policy="tinylfu", read_bound=1, write_bound=2,
        verify_prefetched=verify, sketch_width=128, sketch_period=150, evict_chunk=6,
        prefetch="on", sole_writer=sole,
    )  # fmt: skip
    store = cache.CachedStore(inner, cfg)
    checked = {"serving": 0, "prefetch": 0}
    finish_one = TableCache._finish_one

    def install(self: TableCache, f: Fetch) -> object:
        if not f.done:
            assert self.sketch is not None and f.est is not None
            at = np.flatnonzero(~f.hit) if f.prefetch else np.arange(f.uniq.size)
            now = self.sketch.estimate(f.uniq.take(at))
            assert np.array_equal(f.est.take(at), now)
            checked["prefetch" if f.prefetch else "serving"] += at.size
        return finish_one(self, f)

    monkeypatch.setattr(TableCache, "_finish_one", install)
    g = torch.Generator().manual_seed(2)
    batches = [torch.from_numpy(b) for b in _zipf_batches(rows, 41, 24, seed=7)]
    for step in range(40):
        ids = batches[step]
        if riding:
            store.prefetch_many([ps.PullRequest("t", batches[step + 1])])
        else:
            store.prefetch("t", batches[step + 1])
        store.pull("t", ids)
        store.push("t", ids, torch.randn(ids.numel(), dim, generator=g))
    st = store.cache_stats()["t"]
    assert checked["serving"] > 0 and checked["prefetch"] > 0
    assert st["sketch_halvings"] > 0 and st["evictions"] > 0 and st["prefetched"] > 0
