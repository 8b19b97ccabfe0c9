"""The cache's C kernels (cache/kernels/records.py) against their numpy paths: the same
training run through two caches, one forced onto numpy, gives identical bits in every
served row, every cache record, every statistic and every PS row, clock and optimizer
state; for LRU and LFU, with and without verifying prefetched rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import cache.table_cache as table_cache
import ps
from cache.kernels import records
from tests.support.cache_kernels import force_numpy_paths

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not records.available(), reason="no C compiler: numpy path only"),
]

ROWS, DIM = 300, 12


def _run(
    write_bound: int,
    lr: float | None,
    numpy_path: bool,
    monkeypatch: pytest.MonkeyPatch,
    policy: str = "lfu",
    verify: bool = True,
    sole: bool = False,
):
    if numpy_path:
        force_numpy_paths(monkeypatch)
    inner = ps.InProcessStore()
    inner.create_table(ps.TableSpec(name="t", num_rows=ROWS, dim=DIM, optimizer=ps.Adam(lr=0.05)))
    store = cache.CachedStore(
        inner,
        cache.CacheConfig(
            capacity_rows=40,
            read_bound=2,
            write_bound=write_bound,
            local_lr=lr,
            policy=policy,
            verify_prefetched=verify,
            prefetch="on",
            sole_writer=sole,
            exact_staleness=not verify,
        ),  # fmt: skip
    )
    rng = np.random.default_rng(7)
    served = []
    for step in range(30):
        ids = torch.from_numpy((rng.zipf(1.2, size=64) - 1) % ROWS)  # repeats, unsorted
        rows = store.pull("t", ids).rows  # [64, D]
        served.append(rows.clone())
        nxt = torch.from_numpy((rng.zipf(1.2, size=64) - 1) % ROWS)
        store.prefetch("t", nxt)
        grads = torch.from_numpy(rng.standard_normal((64, DIM)).astype(np.float32))
        store.push("t", ids, grads * (1 + step % 3))
    tc = store._caches["t"]
    slab = tc.slab.copy()
    # own8 is the records' OWN capped, on both paths
    assert np.array_equal(tc.own8, np.minimum(tc.meta[:, table_cache.OWN], records.OWN8_MAX))
    keys = tc.policy.key.copy()  # eviction keys: the serve pass writes LFU's and TinyLFU's
    # which row sits in which slot, and the free stack's order (the next admissions' slots)
    placed = (tc.row_id.copy(), tc.index.lookup(np.arange(ROWS)), tc.free[: tc.n_free].copy())
    stats = store.cache_stats()["t"]
    store.flush()
    every = torch.arange(ROWS)
    final = (inner.pull("t", every).rows, inner.clocks("t", every), inner.state("t", every))
    return served, slab, final, stats, keys, placed


@pytest.mark.parametrize("write_bound", [0, 1, 4])
@pytest.mark.parametrize("lr", [None, 0.0])
def test_kernel_equals_numpy_path(
    write_bound: int, lr: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _run(write_bound, lr, numpy_path=False, monkeypatch=monkeypatch)
    b = _run(write_bound, lr, numpy_path=True, monkeypatch=monkeypatch)
    _same_runs(a, b)


@pytest.mark.parametrize("policy", ["lru", "lfu", "tinylfu"])
@pytest.mark.parametrize("verify", [True, False])
def test_kernels_equal_numpy_paths_policies(
    policy: str, verify: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _run(3, None, numpy_path=False, monkeypatch=monkeypatch, policy=policy, verify=verify)
    b = _run(3, None, numpy_path=True, monkeypatch=monkeypatch, policy=policy, verify=verify)
    _same_runs(a, b)
    assert a[3]["hits"] > 0 and a[3]["prefetched"] > 0


def _same_runs(a, b) -> None:  # type: ignore[no-untyped-def]
    """Two :func:`_run` results, bit for bit: served rows, slab, final store, stats, keys,
    and which row sits in which slot."""
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert np.array_equal(a[1].view(np.int32), b[1].view(np.int32))  # bits, NaN-safe
    for x, y in zip(a[2], b[2], strict=True):
        assert torch.equal(x, y)
    assert a[3] == b[3]
    assert np.array_equal(a[4], b[4])
    for x, y in zip(a[5], b[5], strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("policy", ["lru", "lfu", "tinylfu"])
@pytest.mark.parametrize("sole", [False, True])
def test_admission_pass_equals_its_steps(
    policy: str, sole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-pass admission (evict, free stack, id map, row ids, records, state) against
    the separate eviction and install passes and numpy between them, every other pass in
    C on both sides: the same bits everywhere, with victims that hold pending sums."""
    a = _run(3, None, numpy_path=False, monkeypatch=monkeypatch, policy=policy, sole=sole)
    monkeypatch.setattr(table_cache, "admit_rows", lambda *a, **k: None)
    b = _run(3, None, numpy_path=False, monkeypatch=monkeypatch, policy=policy, sole=sole)
    monkeypatch.undo()
    _same_runs(a, b)
    assert a[3]["evictions"] > 0 and a[3]["evicted_pending"] > 0


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_kernels_equal_numpy_paths_sole_writer(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _run(1, None, numpy_path=False, monkeypatch=monkeypatch, policy=policy, sole=True)
    b = _run(1, None, numpy_path=True, monkeypatch=monkeypatch, policy=policy, sole=True)
    _same_runs(a, b)
    assert a[3]["hits"] > 0
    if policy == "tinylfu":  # plans that keyed their hits, and plans whose count halved
        assert a[3]["sketch_halvings"] > 0


def test_serve_pass_leaves_keyed_hits_keys() -> None:
    """serve_rows with ``old_keyed`` (the plan wrote the hits' keys) writes the keys of
    the other served rows as without it and leaves the hits' keys as they are; every
    other output is the same."""
    rng = np.random.default_rng(5)
    d, cap, n = 4, 64, 40
    w = 2 * d + 16
    slab = rng.standard_normal((cap, w)).astype(np.float32)
    slab[:, 2 * d :].view(np.int64)[:] = rng.integers(0, 9, (cap, 8))
    slots = rng.choice(cap, n, replace=False).astype(np.int64)
    slots[rng.random(n) < 0.2] = -1
    old = (rng.random(n) < 0.6) & (slots >= 0)
    est = rng.integers(0, 50, n).astype(np.int64)
    runs = []
    for old_keyed in (False, True):
        s, keys = slab.copy(), np.full(cap, -7, dtype=np.int64)
        got = records.serve_rows(
            s, d, slots, old, None, lfu=False, tick=3, keys=keys, key_freq=est,
            old_keyed=old_keyed,
        )  # fmt: skip
        assert got is not None
        runs.append((s, keys, got))
    (s0, k0, g0), (s1, k1, g1) = runs
    assert np.array_equal(s0.view(np.int32), s1.view(np.int32))
    cached = slots >= 0
    for a, b in zip(g0[:3], g1[:3], strict=True):  # rows, clocks, lag (no freq: not LFU)
        assert np.array_equal(a[cached], b[cached])
    assert g0[4:] == g1[4:]
    written = slots[cached & ~old]
    assert np.array_equal(k1[written], k0[written]) and (k0[written] != -7).all()
    assert (k1[slots[old]] == -7).all() and old.any()


def test_sole_writer_asks_misses_and_rows_past_the_bound() -> None:
    d, w = 4, 32
    slab = np.zeros((3, w), dtype=np.float32)
    meta = slab[:, 2 * d : 2 * d + 16].view(np.int64)
    meta[:, 0] = [10, 20, 30]  # CLOCK
    meta[:, 1] = [0, 3, 2]  # OWN
    own8 = np.minimum(meta[:, 1], records.OWN8_MAX).astype(np.uint8)
    slots = np.array([2, -1, 1, 0], dtype=np.int64)
    got = records.sole_writer_asks(slab, d, slots, own8, 2, -3)
    assert got is not None
    asked, clocks = got
    assert asked.tolist() == [1, 2] and clocks.tolist() == [-3, 20]  # the miss, OWN 3 > 2
    # At the cap the record's word decides: OWN 300 and 256 against a bound of 299.
    meta[:, 1] = [300, 256, 0]
    own8 = np.minimum(meta[:, 1], records.OWN8_MAX).astype(np.uint8)
    got = records.sole_writer_asks(slab, d, np.array([0, 1, 2]), own8, 299, -3)
    assert got is not None
    assert got[0].tolist() == [0] and got[1].tolist() == [10]


def test_kernel_skips_uncached_and_reports_due_rows() -> None:
    d, w = 4, 32  # records: row, pend, 8 int64 meta, padding
    slab = np.zeros((3, w), dtype=np.float32)
    slab[:, :d] = 1.0
    meta = slab[:, 2 * d : 2 * d + 16].view(np.int64)
    meta[1, 2] = 1  # slot 1 has one pending update already
    slots = np.array([1, -1, 2], dtype=np.int64)
    own8 = np.zeros(3, dtype=np.uint8)
    grads = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    got = records.update_rows(slab, d, slots, own8, grads, lr=0.5, write_bound=1, seq=9)
    assert got is not None
    due, due_g, due_k, due_s, _ = got
    assert due.tolist() == [0]  # slot 1 passed the bound; slot 2 has one pending now
    assert np.array_equal(due_g, grads[:1])
    assert due_k.tolist() == [2] and due_s.shape == (1, 0)  # its two updates; no statistic
    assert np.array_equal(slab[1, :d], 1.0 - np.float32(0.5) * grads[0])
    assert np.array_equal(slab[2, d : 2 * d], grads[2])
    assert meta[1].tolist()[1:3] == [1, 0] and meta[1, 6] == 9  # OWN, COUNT; PUSHED
    assert meta[2, 2] == 1 and meta[0].tolist() == [0] * 8  # slot 0 untouched
    assert own8.tolist() == [0, 1, 0]  # the copy of OWN follows


@pytest.mark.parametrize("q", [1, 4])
def test_kernel_sums_the_statistic_of_counted_pushes(q: int) -> None:
    """Q = 1: sum of mean(g^2) in the spare meta word; Q = D: sums of g^2 after the meta.
    Gradients in halves, so every square and sum is exact."""
    d = 4
    at = 2 * d + (14 if q == 1 else 16)
    w = 32 if q == 1 else 48
    slab = np.zeros((2, w), dtype=np.float32)
    slots = np.array([0, 1], dtype=np.int64)
    g1 = np.array([[0.5, -1.0, 1.5, 2.0], [1.0, 1.0, 0.5, 0.5]], dtype=np.float32)
    g2 = np.array([[1.0, 0.5, -0.5, 0.0], [2.0, 0.0, 1.0, -1.0]], dtype=np.float32)
    kw = {"lr": 0.0, "write_bound": 1, "stat_dim": q, "stat_at": at}
    own8 = np.zeros(2, dtype=np.uint8)
    first = records.update_rows(slab, d, slots, own8, g1, seq=1, **kw)
    assert first is not None and first[0].size == 0  # both rows pending
    got = records.update_rows(slab, d, slots, own8, g2, seq=2, **kw)
    assert got is not None
    due, due_g, due_k, due_s, _ = got
    assert due.tolist() == [0, 1] and due_k.tolist() == [2, 2]
    assert np.array_equal(due_g, g1 + g2)
    want = (g1 * g1).mean(axis=1, keepdims=True) + (g2 * g2).mean(axis=1, keepdims=True)
    assert np.array_equal(due_s, want if q == 1 else g1 * g1 + g2 * g2)
    assert not slab[:, at : at + q].any() and not slab[:, d : 2 * d].any()  # pushed: zeroed


@pytest.mark.parametrize("q", [0, 1, 4])
@pytest.mark.parametrize("write_bound", [0, 1, 2])
@pytest.mark.parametrize("evicted", [0, 1, 5])
def test_the_push_in_id_order_is_the_push_sorted(q: int, write_bound: int, evicted: int) -> None:
    """update_rows given the batch's ids: the same records and the same push as without
    them, with the rows not cached (one update each, statistic zero) and the evicted sums
    joined, then sorted by id; the evicted ids fall before, between and after the batch's."""
    rng = np.random.default_rng(q * 100 + write_bound * 10 + evicted)
    d, cap, n = 4, 40, 24
    at = 2 * d + (14 if q == 1 else 16)
    w = 48 if q > 1 else 32
    slab = rng.standard_normal((cap, w)).astype(np.float32)
    meta = slab[:, 2 * d : 2 * d + 16].view(np.int64)
    meta[:] = 0
    meta[:, 2] = rng.integers(0, write_bound + 1, cap)  # COUNT: pending updates so far
    if q:
        slab[:, at : at + q] = np.abs(slab[:, at : at + q])
    ids = np.sort(rng.choice(np.arange(3, 1000, 3), n, replace=False)).astype(np.int64)
    slots = rng.choice(cap, n, replace=False).astype(np.int64)
    slots[rng.random(n) < 0.3] = -1  # not cached
    grads = rng.standard_normal((n, d)).astype(np.float32)
    e_ids = np.sort(rng.choice(np.arange(1, 999, 3), evicted, replace=False)).astype(np.int64)
    e_ids[:1] = 0  # one before every batch id (which are 3, 6, ... 999)
    e_ids[1:][-1:] = 1000  # and, with two or more, one after them
    e_g = rng.standard_normal((evicted, d)).astype(np.float32)
    e_k = rng.integers(1, 4, evicted).astype(np.int64)
    e_s = rng.random((evicted, q)).astype(np.float32)
    kw = dict(lr=0.25, write_bound=write_bound, seq=5, stat_dim=q, stat_at=at)

    slab_a, own_a = slab.copy(), np.zeros(cap, dtype=np.uint8)
    got_a = records.update_rows(slab_a, d, slots, own_a, grads, **kw)
    assert got_a is not None
    due, due_g, due_k, due_s, no_ids = got_a
    assert no_ids is None
    through = np.flatnonzero(slots < 0)
    want_ids = np.concatenate([e_ids, ids[through], ids[due]])
    want_g = np.concatenate([e_g, grads[through], due_g])
    want_k = np.concatenate([e_k, np.ones(through.size, np.int64), due_k])
    want_s = np.concatenate([e_s, np.zeros((through.size, q), np.float32), due_s])
    order = np.argsort(want_ids)

    slab_b, own_b = slab.copy(), np.zeros(cap, dtype=np.uint8)
    ev = (e_ids, e_g, e_k, e_s) if evicted else None
    got_b = records.update_rows(slab_b, d, slots, own_b, grads, ids=ids, evicted=ev, **kw)
    assert got_b is not None
    pos, sums, counts, stats, push_ids = got_b
    assert np.array_equal(slab_b, slab_a) and np.array_equal(own_b, own_a)  # same records
    assert np.array_equal(push_ids, want_ids[order])
    assert np.array_equal(sums, want_g[order]) and np.array_equal(counts, want_k[order])
    assert np.array_equal(stats, want_s[order])
    batch_pos = np.concatenate([np.full(evicted, -1), through, due])[order]
    assert np.array_equal(pos, batch_pos)  # positions into the batch; -1: evicted


@pytest.mark.parametrize("keyed", ["no", "tick", "estimates"])
@pytest.mark.parametrize("sketched", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_plan_pass_equals_lookup_count_and_asks(seed: int, sketched: bool, keyed: str) -> None:
    """plan_pull: the slots of the dense map's lookup, the asks of sole_writer_asks,
    (with a sketch) the counters of FrequencySketch.add and the estimates of
    FrequencySketch.estimate after it, and (with keys) the eviction keys of
    EvictionPolicy.use marking the cached rows used (with the estimates: as TinyLFU's
    serving writes them), from one call."""
    from cache.kernels.plan_pull import plan_pull
    from cache.policy import EvictionPolicy
    from cache.sketch import FrequencySketch
    from cache.slot_index import DenseSlotIndex

    rng = np.random.default_rng(seed)
    rows, cap, d, w, bound = 5000, 300, 4, 32, 2
    index = DenseSlotIndex(rows)
    cached = rng.choice(rows, cap - 20, replace=False)
    index.insert(cached, rng.permutation(cap)[: cached.size])
    slab = np.zeros((cap, w), dtype=np.float32)
    meta = slab[:, 2 * d : 2 * d + 16].view(np.int64)
    meta[:, table_cache.CLOCK] = rng.integers(0, 50, cap)
    meta[:, table_cache.OWN] = rng.integers(0, 400, cap)  # some past own8's cap of 255
    own8 = np.minimum(meta[:, table_cache.OWN], records.OWN8_MAX).astype(np.uint8)
    ids = np.unique(rng.integers(0, rows, 700))  # increasing, some cached
    fill = -1 - bound
    a, b = FrequencySketch(64, 4, 10_000), FrequencySketch(64, 4, 10_000)
    a.add(rng.integers(0, rows, 300))  # earlier counts
    b.counters.copy_(a.counters)
    policy, want_policy = EvictionPolicy(cap, "tinylfu"), EvictionPolicy(cap, "tinylfu")
    for p in (policy, want_policy):  # keys of earlier uses, some slots empty
        p.use(np.arange(cap - 20), np.arange(cap - 20) % 7, 40)
    tick = 41
    got = plan_pull(
        ids, index.map, b.kernel_view() if sketched else None, slab, 2 * d, own8,
        own8_max=records.OWN8_MAX, clock_word=table_cache.CLOCK, own_word=table_cache.OWN,
        bound=bound, fill=fill, keys=None if keyed == "no" else policy.key, tick=tick,
        keys_with_estimates=keyed == "estimates",
    )  # fmt: skip
    assert got is not None
    slots = index.lookup(ids)
    if sketched:
        a.add(ids)
    cached = slots >= 0
    if keyed == "estimates" and sketched:
        want_policy.use(slots[cached], a.estimate(ids)[cached], tick)
    elif keyed != "no":  # (without a sketch there are no estimates: the tick alone)
        want_policy.use(slots[cached], None, tick)
    assert np.array_equal(policy.key, want_policy.key)
    want = records.sole_writer_asks(slab, d, slots, own8, bound, fill)
    assert want is not None
    assert np.array_equal(got[0], slots)
    assert np.array_equal(got[1], want[0]) and np.array_equal(got[2], want[1])
    assert got[1].size > 0 and (slots[got[1]] >= 0).any() and (slots[got[1]] < 0).any()
    if sketched:
        assert np.array_equal(got[3], a.estimate(ids))
        assert (got[3] >= 1).all() and (got[3] > 1).any()  # the earlier counts show
    else:
        assert got[3] is None
    assert torch.equal(b.counters, a.counters)


def test_sketch_kernels_equal_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sketch's C passes count and estimate exactly as its torch path (integers)."""
    import cache.sketch as sketch_mod

    rng = np.random.default_rng(3)
    batches = [(rng.zipf(1.1, size=500) - 1).astype(np.int64) for _ in range(20)]
    batches.append(np.array([-5, 2**62, -(2**63), 0, 0], dtype=np.int64))  # any int64 hashes
    got = []
    for torch_path in (False, True):
        if torch_path:
            monkeypatch.setattr(sketch_mod, "add_counts", lambda *a: False)
            monkeypatch.setattr(sketch_mod, "min_counts", lambda *a: None)
        sk = sketch_mod.FrequencySketch(width=1024, depth=4, period=3000)
        est = [sk.estimate(b) for b in batches if sk.add(b) or True]
        got.append((sk.counters.clone(), est, sk.halvings))
    assert torch.equal(got[0][0], got[1][0]) and got[0][2] == got[1][2] > 0
    for a, b in zip(got[0][1], got[1][1], strict=True):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


@pytest.mark.parametrize("seed", range(5))
def test_sorted_difference_equals_numpy(seed: int) -> None:
    """The merge pass gives the ids numpy's set difference gives, in order, also for
    empty sides, disjoint runs, one side inside the other, and negative ids."""
    from cache.kernels.sorted_ids import sorted_difference

    rng = np.random.default_rng(seed)
    cases = [
        (np.unique(rng.integers(-50, 400, 300)), np.unique(rng.integers(-50, 400, 200))),
        (np.arange(10), np.empty(0, dtype=np.int64)),
        (np.empty(0, dtype=np.int64), np.arange(10)),
        (np.arange(0, 10), np.arange(10, 20)),  # b after a
        (np.arange(10, 20), np.arange(0, 10)),  # b before a
        (np.arange(5, 8), np.arange(0, 20)),  # a inside b
        (np.arange(0, 20), np.arange(5, 8)),  # b inside a
    ]
    for a, b in cases:
        a, b = a.astype(np.int64), b.astype(np.int64)
        got = sorted_difference(a, b)
        assert got is not None and got.dtype == np.int64
        assert np.array_equal(got, np.setdiff1d(a, b, assume_unique=True))


@pytest.mark.parametrize("seed", range(5))
def test_victim_pool_kernel_equals_numpy(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's C pass takes the entries the numpy windows take, in order: entries whose
    key changed, rows of the current tick and protected slots (with -1 among them) are
    skipped, ``k`` beyond the valid entries gives them all, and the marks are clear after."""
    import cache.policy as policy_mod
    from cache.kernels.victim_pool import pool_valid

    four, no_marks = np.arange(4, dtype=np.int64), np.zeros(4, dtype=bool)
    # built here: else the comparison below would be numpy's path against itself
    assert pool_valid(four, four, four, -1, 9, None, no_marks, 2) is not None
    rng = np.random.default_rng(seed)
    cap, tick = 5000, 40
    for k in (1, 7, 300, 4000, 10_000):
        pol = policy_mod.EvictionPolicy(cap, "tinylfu")
        freq, last = rng.integers(0, 20, cap), rng.integers(0, tick + 1, cap)
        pol.key[:] = (freq << policy_mod.TICK_BITS) + last
        pol.key[rng.choice(cap, 200, replace=False)] = policy_mod.FREE
        pol.pool = rng.permutation(cap)[: cap // 2].astype(np.int64)
        pol.pool_key = pol.key.take(pol.pool)
        pol.pool_at = int(rng.integers(0, 50))
        changed = rng.choice(pol.pool, 300, replace=False)
        pol.key[changed] += 1 << policy_mod.TICK_BITS  # used since the search: invalid
        protect = np.concatenate([rng.choice(cap, 800), [-1, -1]]).astype(np.int64)
        got_c = pol._from_pool(k, tick, protect)
        taken_c = pol.taken.copy()
        assert not pol.marked.any()
        monkeypatch.setattr(policy_mod, "pool_valid", lambda *a: None)
        got_np = pol._from_pool(k, tick, protect)
        monkeypatch.undo()
        assert got_c.dtype == got_np.dtype == np.int64 and np.array_equal(got_c, got_np)
        assert 0 < got_c.size <= k
        # the positions consumed() moves past: where the entries sit in the whole pool
        assert np.array_equal(taken_c, pol.taken) and np.array_equal(pol.pool[taken_c], got_c)
        assert np.array_equal(pol.taken_frequency(), pol.key[got_c] >> policy_mod.TICK_BITS)
        assert np.all(np.diff(taken_c) > 0) and taken_c[0] >= pol.pool_at
        n = (got_c.size + 1) // 2
        scan_at = pol.pool_at + int(np.flatnonzero(pol.pool[pol.pool_at :] == got_c[n - 1])[0]) + 1
        pol.consumed(got_c[:n])
        assert pol.pool_at == scan_at  # as a scan for the last consumed entry finds it


@pytest.mark.parametrize("kind", ["lru", "lfu", "tinylfu"])
@pytest.mark.parametrize("seed", range(3))
def test_victim_search_kernel_equals_numpy(
    kind: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The victim search's C pass (``search_near``) picks the slots numpy's passes pick, in
    the same order: over many ties, free slots, rows used at or after the tick, protected
    slots (with -1 among them), every ``k`` from one to all, and keys laid out so that the
    strided sample's bound falls short (the pass then takes every candidate); the marks
    are clear after."""
    import cache.policy as policy_mod
    from cache.kernels.victim_pool import search_near

    four, no_marks = np.arange(4, dtype=np.int64), np.zeros(4, dtype=bool)
    # built here: else the comparison below would be numpy's path against itself
    assert search_near(four, -1, 9, None, no_marks, 2) is not None
    rng = np.random.default_rng(seed)
    c, tick = 300_000, 50  # the sample is one key in 4
    pol = policy_mod.EvictionPolicy(c, kind)
    last = rng.integers(0, tick + 3, c)  # some used at or after tick: not evictable
    freq = rng.integers(0, 4, c) if pol.lfu else np.zeros(c, dtype=np.int64)
    row_id = rng.permutation(10 * c)[:c].astype(np.int64)
    protect = np.concatenate([rng.integers(0, c, c // 20), [-1, -1]]).astype(np.int64)
    # Short: the sampled slots (one in 4) hold half the key-1 rows the sample promises.
    short = np.where(np.arange(c) % 8 == 0, 1, np.where(np.arange(c) % 4 == 0, 3, 2))
    layouts = {"random": (freq << 32) + last if pol.lfu else last, "short": short}
    for layout, keys in layouts.items():
        pol.key[:] = keys
        if layout == "random":
            pol.key[rng.integers(0, c, c // 50)] = policy_mod.FREE
        for k in (1, 3, 1000, c // 16, c // 6, c // 5, c // 2, c):
            got_c = pol.victims(k, tick, protect, row_id)
            assert not pol.marked.any()
            monkeypatch.setattr(policy_mod, "search_near", lambda *a: None)
            got_np = pol.victims(k, tick, protect, row_id)
            monkeypatch.undo()
            assert got_c.dtype == got_np.dtype == np.int64, (layout, k)
            assert np.array_equal(got_c, got_np), (layout, k)
            assert not np.isin(got_c, protect).any()


@pytest.mark.parametrize("kind", ["lfu", "tinylfu"])
def test_halving_kernel_equals_numpy(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The halving's C pass (``halve_keys``) writes the keys numpy's path writes: free
    slots stay free, every other key keeps its last use and has its frequency halved
    (odd, even, zero and the largest frequency), and the pool is searched again after."""
    import cache.policy as policy_mod
    from cache.kernels.victim_pool import halve_keys

    assert halve_keys(np.zeros(2, dtype=np.int64), 1, 32)  # built: else numpy against itself
    rng = np.random.default_rng(0)
    c = 100_003  # not a multiple of a vector's width
    freq = rng.integers(0, 9, c)
    freq[:4] = [0, 1, policy_mod.FREQ_MAX, policy_mod.FREQ_MAX - 1]
    keys = (freq << policy_mod.TICK_BITS) + rng.integers(0, 1 << policy_mod.TICK_BITS, c)
    keys[rng.integers(0, c, c // 20)] = policy_mod.FREE
    got = {}
    for path in ("c", "numpy"):
        pol = policy_mod.EvictionPolicy(c, kind)
        pol.key[:] = keys
        pol.pool = np.arange(10, dtype=np.int64)
        if path == "numpy":
            monkeypatch.setattr(policy_mod, "halve_keys", lambda *a: False)
        pol.halve()
        monkeypatch.undo()
        assert pol.pool_at == pol.pool.size  # the pool's keys changed: search again
        got[path] = pol.key.copy()
    assert np.array_equal(got["c"], got["numpy"])
    free = keys == policy_mod.FREE
    assert np.array_equal(got["c"][free], keys[free])
    low = (1 << policy_mod.TICK_BITS) - 1
    assert np.array_equal(got["c"][~free] & low, keys[~free] & low)
    assert np.array_equal(got["c"][~free] >> policy_mod.TICK_BITS, freq[~free] // 2)


@pytest.mark.parametrize("wide", [False, True])
def test_key_then_id_order_equals_lexsort(wide: bool) -> None:
    """The pool's order (``key_then_id_order``: one radix sort of key and id joined, or
    two where they do not fit in 64 bits) is ``np.lexsort((ids, keys))``: by key, ties by
    id, ties of both by the earlier entry."""
    from cache.policy import TICK_BITS, key_then_id_order

    rng = np.random.default_rng(7)
    n = 50_000
    freq_hi = (1 << 30) if wide else 4  # a frequency of 2^30 makes key x id overflow
    keys = (rng.integers(0, freq_hi, n) << TICK_BITS) + rng.integers(0, 30, n)
    ids = rng.integers(0, 3_000_000, n)  # repeats too
    ids[: n // 10] = ids[n // 10 : n // 5]
    got = key_then_id_order(keys, ids)
    assert np.array_equal(got, np.lexsort((ids, keys)))
    assert key_then_id_order(keys[:0], ids[:0]).size == 0


@pytest.mark.parametrize("case", ["sorted", "unsorted", "wide", "negative"])
def test_admission_order_equals_lexsort(case: str) -> None:
    """The admission's candidate order (``key_then_id_order`` of the negated scores:
    highest score first, ties by smaller id) is ``np.lexsort((ids, -scores))`` on the
    int16 path (ids in order, scores spanning less than 2**15, negative ones too) and
    off it (ids out of order, scores spanning more)."""
    from cache.policy import key_then_id_order

    rng = np.random.default_rng(11)
    n = 20_000
    ids = np.sort(rng.choice(5_000_000, n, replace=False)).astype(np.int64)
    scores = rng.integers(0, 40, n)  # many ties
    if case == "unsorted":
        ids = rng.permutation(ids)
    elif case == "wide":
        scores[::7] += 1 << 20
    elif case == "negative":
        scores[::5] -= 100
    got = key_then_id_order(-scores, ids)
    assert np.array_equal(got, np.lexsort((ids, -scores)))
    assert key_then_id_order(-scores[:0], ids[:0]).size == 0


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's bytes (NaN payloads included: bits, not values, are compared)."""
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("q", [0, 1])
@pytest.mark.parametrize("write_bound", [0, 2])
@pytest.mark.parametrize("adagrad", [False, True])
def test_the_passes_on_threads_equal_one_thread(
    kind: int, q: int, write_bound: int, adagrad: bool
) -> None:
    """update_rows and serve_rows split their ids over OpenMP threads (at least 2048 ids
    each): at 2 and 3 threads the records, own8, the push (in id order, evicted sums
    merged before, between and after the ranges) and the served rows equal one thread's
    bit for bit."""
    rng = np.random.default_rng(kind * 8 + q * 4 + write_bound + adagrad)
    d, cap, n = 16, 9000, 3 * 2048 + 17
    rw = records.row_words(d, kind)
    m = rw + d  # the meta words start here: 8 int64
    stat_at, acc_at = m + 16, m + 16 + q
    w = acc_at + 1
    slab = rng.standard_normal((cap, w)).astype(np.float32)
    if kind:  # the row's words hold fp16 values
        slab[:, :rw] = rng.standard_normal((cap, d)).astype(np.float16).view(np.float32)
    meta = slab[:, m : m + 16].view(np.int64)
    meta[:] = 0
    meta[:, 2] = rng.integers(0, write_bound + 1, cap)  # COUNT
    meta[:, 3] = rng.integers(0, 9, cap)  # FREQ
    slab[:, stat_at:w] = np.abs(slab[:, stat_at:w])  # statistic, accumulator >= 0
    ids = np.sort(rng.choice(np.arange(3, 30 * n, 3), n, replace=False)).astype(np.int64)
    slots = rng.choice(cap, n, replace=False).astype(np.int64)
    slots[rng.random(n) < 0.3] = -1  # not cached
    grads = rng.standard_normal((n, d)).astype(np.float32)
    ne = 40
    e_ids = np.sort(rng.choice(np.arange(1, 30 * n, 3), ne, replace=False)).astype(np.int64)
    e_ids[0], e_ids[-1] = 0, 30 * n + 1  # one before and one after every batch id
    evicted = (
        e_ids,
        rng.standard_normal((ne, d)).astype(np.float32),
        rng.integers(1, 4, ne).astype(np.int64),
        rng.random((ne, q)).astype(np.float32) if q else None,
    )
    row_ids = rng.permutation(cap).astype(np.int64)
    kw = dict(
        lr=0.25, write_bound=write_bound, seq=5, stat_dim=q, stat_at=stat_at,
        acc_at=acc_at if adagrad else -1, eps=1e-6, kind=kind, seed=11, row_ids=row_ids,
        ids=ids, evicted=evicted,
    )  # fmt: skip
    old = rng.random(n) < 0.5
    uses = rng.integers(1, 4, n).astype(np.int64)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            s, own8 = slab.copy(), np.zeros(cap, dtype=np.uint8)
            keys = np.zeros(cap, dtype=np.int64)
            pushed = records.update_rows(s, d, slots, own8, grads, **kw)
            served = records.serve_rows(
                s, d, slots, old, uses, lfu=True, tick=3, kind=kind, keys=keys
            )
            assert pushed is not None and served is not None
            rows, clocks, lag, freq, pf_miss, pf_refresh = served
            cached = slots >= 0  # the entries the pass sets
            runs.append(
                [s, own8, keys, *pushed[:4], pushed[4], rows[cached], clocks[cached],
                 lag[cached & old], freq[cached], np.array([pf_miss, pf_refresh])]
            )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    push_ids = runs[0][7]  # every row not cached and every evicted sum, in id order
    assert push_ids.size >= (slots < 0).sum() + ne and np.all(np.diff(push_ids) > 0)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a.shape == b.shape and np.array_equal(_bits(a), _bits(b))
