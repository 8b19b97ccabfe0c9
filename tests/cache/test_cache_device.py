"""The cache with its rows in device tensors (``CachedStore(device=...)``) against the
cache with rows in host records, against local tables, and against exact sums.

* The same training sequence (batched pulls with prefetches riding on them, pushes,
  evictions, refreshes, pass-through) through a record cache and a device cache serves
  the same rows, keeps the same statistics and leaves the same store: bit for bit with
  tensors on the CPU (with the C record kernels and with their numpy paths), within
  1e-6 on a GPU (``gpu`` marker).
* With bounds 0 an embedding collection on the device cache trains exactly like the
  same tables placed locally on that device.
* Pending sums of evicted rows reach the store exactly: integer gradients and SGD with
  lr 1 from zero rows make every sum exact in any order, so the store must hold minus
  the sum of every gradient pushed (independent dense reference).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import cache
import ps
from cache.kernels import records
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from embedding_reference import Replayed
from tests.support.cache_kernels import force_numpy_paths
from tolerance import assert_close, assert_same

REPLAY = "4 x the float32 reference's error against its float64 replay"

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, DIM = 200, 8
NAMES = ("t", "u")


def _store(opt: ps.Optimizer) -> ps.InProcessStore:
    store = ps.InProcessStore()
    for n in NAMES:
        store.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt))
    return store


# Why a record cache and a device cache on the CPU agree bit for bit: both sum a row's
# pending gradients by float32 additions in push order (no products: nothing to fuse) and
# push the same rows with the same sums when they evict or flush, so the store runs the
# same kernels on the same [U, D] tensors.
SAME_PUSHES = "the same pending sums (additions in push order) pushed as the same rows"


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str, why: str) -> None:
    a, b = a.cpu(), b.cpu()
    if exact:
        assert_same(a, b, what=what, why=why)
    else:
        # On a GPU the pending sums are atomic additions in any order and Adam amplifies
        # their last-bit differences; no float64 replay of the cache exists to measure it.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=what)


def _train(
    store: cache.CachedStore, inner: ps.Store, device: torch.device, steps: int = 25
) -> tuple[list[torch.Tensor], dict[str, dict[str, object]], list[torch.Tensor]]:
    """A hybrid-table step sequence: prefetch_many, pull_many, push_many (gradients on
    ``device``); returns the served rows, the statistics and the store after a flush."""
    rng = np.random.default_rng(11)

    def batch() -> dict[str, torch.Tensor]:  # repeats, unsorted, a hot head
        return {n: torch.from_numpy((rng.zipf(1.3, size=48) - 1) % ROWS) for n in NAMES}

    served = []
    ids = batch()
    for step in range(steps):
        nxt = batch()
        store.prefetch_many([ps.PullRequest(n, torch.unique(nxt[n])) for n in NAMES])
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])
        for r in got:
            assert r.rows.device == device
            served.append(r.rows.cpu())
        grads = {
            n: torch.from_numpy(rng.standard_normal((48, DIM)).astype(np.float32)).to(device)
            for n in NAMES
        }
        store.push_many([ps.PushRequest(n, ids[n], grads[n] * (1 + step % 3)) for n in NAMES])
        ids = nxt
    stats = store.cache_stats()
    store.flush()
    every = torch.arange(ROWS)
    final = []
    for n in NAMES:
        final += [inner.pull(n, every).rows, inner.clocks(n, every), inner.state(n, every)]
    return served, stats, final


CASES = {
    "lru-bounds0": dict(policy="lru", read_bound=0, write_bound=0),
    "lfu-bounds2-3": dict(policy="lfu", read_bound=2, write_bound=3),
    "tinylfu-bounds4-grouped": dict(
        policy="tinylfu", read_bound=4, write_bound=4, group_tables=True
    ),
    "lru-unverified-local-lr0": dict(
        policy="lru", read_bound=3, write_bound=2, verify_prefetched=False, local_lr=0.0
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("record_kernels", ["c", "numpy"])
def test_device_rows_equal_host_records(
    device: str, case: str, record_kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if record_kernels == "c" and not records.available():
        pytest.skip("no C compiler: the numpy record path only")
    if record_kernels == "numpy":
        force_numpy_paths(monkeypatch)
    dev = torch.device(device)
    config = cache.CacheConfig(capacity_rows=30, evict_chunk=4, prefetch="on", **CASES[case])  # type: ignore[arg-type]
    opt = ps.Adam(lr=0.05)
    a_inner, b_inner = _store(opt), _store(opt)
    a = _train(cache.CachedStore(a_inner, config), a_inner, torch.device("cpu"))
    b = _train(cache.CachedStore(b_inner, config, device=dev), b_inner, dev)
    exact = dev.type == "cpu"
    for k, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
        _close(x, y, exact, f"served pull {k}", SAME_PUSHES)
    assert a[1] == b[1]
    st = next(iter(b[1].values()))
    bound = CASES[case]["read_bound"]
    assert st["evictions"] > 0 and st["prefetched"] > 0, st
    assert st["hits"] > 0 or bound == 0, st  # bound 0: every pushed row is refreshed
    assert st["refreshes"] > 0 or bound > 2, st  # one worker's pushes pass a bound > 2 late
    for k, (x, y) in enumerate(zip(a[2], b[2], strict=True)):
        _close(x, y, exact or x.dtype == torch.int64, f"store part {k}", SAME_PUSHES)


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_pending_rows_reach_the_store_exactly(device: str) -> None:
    dev = torch.device(device)
    inner = ps.InProcessStore()
    zero = ps.UniformInit(low=0.0, high=0.0)
    for n in NAMES:
        inner.create_table(
            ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=ps.SGD(lr=1.0), init=zero)
        )
    config = cache.CacheConfig(capacity_rows=12, read_bound=50, write_bound=50, evict_chunk=3)
    store = cache.CachedStore(inner, config, device=dev)
    total = {n: torch.zeros(ROWS, DIM, dtype=torch.float64) for n in NAMES}
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        ids = {n: torch.randint(0, 40, (20,), generator=gen) for n in NAMES}
        store.pull_many([ps.PullRequest(n, i) for n, i in ids.items()])
        grads = {n: torch.randint(-4, 5, (20, DIM), generator=gen).float() for n in NAMES}
        store.push_many([ps.PushRequest(n, ids[n], grads[n].to(dev)) for n in NAMES])
        for n in NAMES:
            total[n].index_add_(0, ids[n], grads[n].double())
    st = store.cache_stats()
    assert all(s["evicted_pending"] > 0 for s in st.values()), st
    before_flush = {n: inner.pull(n, torch.arange(ROWS)).rows.clone() for n in NAMES}
    store.flush()
    for n in NAMES:
        got = inner.pull(n, torch.arange(ROWS)).rows.double()
        assert_same(got, -total[n], what=n, why="integer sums from zero rows: exact in any order")
        assert not torch.equal(before_flush[n].double(), -total[n])  # some were pending


def _tables(opt: ps.Optimizer, placement: str) -> list[TableConfig]:
    tables = [
        TableConfig(name="a", num_rows=50, dim=8, feature_names=["a1", "a2"], pooling="sum"),
        TableConfig(name="b", num_rows=30, dim=8, feature_names=["b"], pooling="mean"),
    ]
    return [dataclasses.replace(t, optimizer=opt, placement=placement) for t in tables]  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "opt", [ps.RowWiseAdagrad(lr=0.1), ps.Adam(lr=0.05), ps.SGD(lr=0.2)], ids=str
)
def test_bounds_zero_equal_local_tables_on_the_device(device: str, opt: ps.Optimizer) -> None:
    """Three collections from the same deterministic rows take the same batches and
    gradients: tables placed locally on the device, hybrid tables behind a device cache
    with bounds 0 (evicting), and hybrid tables without a cache. The cached ones equal
    the uncached ones bit for bit on the CPU (within 1e-6 on a GPU), and the local ones
    within the tolerance of the float32 reference's error against its float64 replay
    (``embedding_reference.Replayed``, on the same batches and loss): the local backward
    sums a two-feature table's row gradients in another order than the hybrid one, with
    or without a cache, and the optimizers amplify that last-bit difference."""
    config = cache.CacheConfig(capacity_rows=10, read_bound=0, write_bound=0, evict_chunk=2)
    cached = cache.CachedStore(ps.InProcessStore(), config, device=device)
    hybrid = EmbeddingCollection(_tables(opt, "hybrid"), store=cached, device=device)
    plain = EmbeddingCollection(_tables(opt, "hybrid"), store=ps.InProcessStore(), device=device)
    local = EmbeddingCollection(_tables(opt, "local"), device=device)
    replay = Replayed(_tables(opt, "local"))
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        lists = {
            f: [torch.randint(0, n, (int(k),), generator=gen).tolist() for k in [3, 0, 2, 5]]
            for f, n in (("a1", 50), ("a2", 50), ("b", 30))
        }
        kjt = KeyedJaggedIds.from_lists(lists)
        nxt = torch.randint(0, 30, (4,), generator=gen)
        hybrid.prefetch(KeyedJaggedIds.from_lists({"b": [nxt.tolist()]}))
        weights = {f: torch.randn(4, 8, generator=gen).to(device) for f in ("a1", "a2", "b")}
        for ec in (hybrid, plain, local):
            out = ec(kjt)
            sum((out[f] * weights[f]).sum() for f in out).backward()  # type: ignore[union-attr]
        out32, out64 = replay.forward(kjt)
        sum((out32[f] * weights[f].cpu()).sum() for f in out32).backward()  # type: ignore[union-attr]
        sum((out64[f] * weights[f].cpu().double()).sum() for f in out64).backward()  # type: ignore[union-attr]
        replay.step(kjt)
    cached.flush()
    assert cached.cache_stats()["a"]["evictions"] > 0
    exact = device == "cpu"
    for name, rows in (("a", 50), ("b", 30)):
        ids = torch.arange(rows)
        for what in ("rows", "state", "clocks"):
            got = getattr(hybrid, what)(name, ids).cpu()
            why = "bounds 0: every push is the uncached push, every reused row refreshed"
            _close(got, getattr(plain, what)(name, ids), exact, f"{name} {what} vs uncached", why)
            want = getattr(local, what)(name, ids).cpu()
            if what == "clocks" or want.numel() == 0:
                assert torch.equal(got, want), f"{name} {what}"
                continue
            tol = replay.rows_tol(name) if what == "rows" else replay.state_tol(name)
            assert_close(got, want, atol=tol, what=f"{name} {what} vs local", why=REPLAY)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_served_on_the_device_and_state_round_trip(device: str) -> None:
    """Pulls return rows on the device; host gradients are moved there; a saved cache
    state loads into a new device cache that then serves the same rows; nan_policy skip
    drops non-finite rows of a device gradient."""
    dev = torch.device(device)
    inner = _store(ps.SGD(lr=0.5))
    config = cache.CacheConfig(capacity_rows=20, read_bound=3, write_bound=3)
    store = cache.CachedStore(inner, config, device=dev)
    assert store.device == dev
    ids = torch.tensor([3, 1, 3, 7])
    first = store.pull("t", ids)
    assert first.rows.device == dev and first.clocks.device.type == "cpu"
    store.push("t", ids, torch.ones(4, DIM))  # host gradients: moved to the device
    saved = store.cache_state()
    again = cache.CachedStore(inner, config, device=dev)
    again.load_cache_state(saved)
    why = "a loaded cache serves the rows it saved"
    _close(again.pull("t", ids).rows, store.pull("t", ids).rows, True, "rows after load", why)
    assert again.cache_stats()["t"]["hits"] == 3

    skip = ps.InProcessStore()
    spec = ps.TableSpec(name="s", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0), nan_policy="skip")
    skip.create_table(spec)
    sk = cache.CachedStore(skip, cache.CacheConfig(capacity_rows=4), device=dev)
    sk.pull("s", torch.tensor([1, 2]))
    before = skip.pull("s", torch.tensor([1, 2])).rows
    grads = torch.tensor([[float("nan"), 0.0], [1.0, 1.0]], device=dev)
    sk.push("s", torch.tensor([1, 2]), grads)
    sk.flush()
    after = skip.pull("s", torch.tensor([1, 2])).rows
    assert_same(after[0], before[0], what="skipped row", why="its gradient was dropped")
    assert_same(after[1], before[1] - 1.0, what="row", why="lr * g = 1: one rounding both ways")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_a_cuda_cache_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="device .cuda:0. asked for, but torch sees no CUDA"):
        cache.CachedStore(ps.InProcessStore(), cache.CacheConfig(capacity_rows=4), device="cuda:0")
