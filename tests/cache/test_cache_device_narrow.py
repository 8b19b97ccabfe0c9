"""The cache with its rows on a device (``CachedStore(device=...)``) over tables of fp16
and bf16 rows: the device keeps the rows in the table's type.

* The same training sequence (batched pulls with prefetches riding on them, pushes,
  evictions, refreshes, pass-through) through a host-record cache and a device cache on
  CPU tensors serves the same rows, pushes the same rows to the store and leaves the
  same store, bit for bit: both layouts compute each row they write in float32 by the
  same ops on the same widened values and round it with :func:`ps.rounding.round_to`'s
  key (table seed, row id, version ``-1 - seq``), and store the store's rows as they
  are. SGD and the optimizer's local step (row-wise Adagrad, Adam), bounds (4, 4) and
  (0, 0), one cache per table and grouped tables. On a GPU (``gpu`` marker) within a few
  steps of the narrow type (see :func:`_within_steps`).
* A saved device cache of a narrow table (``cache_state``) loads into a new device
  cache and into a host-record cache; both serve the saved rows and then train as the
  saved cache does, bit for bit.
* A narrow table's row takes 2 bytes per element on the device:
  :func:`cache.cache_bytes` and the cache's tensors agree.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import cache
import ps
from cache.kernels import records
from capturing_store import Capturing
from tests.support.cache_kernels import force_numpy_paths
from tolerance import assert_same

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, DIM = 200, 10
NAMES = ("t", "u")
NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "sgd": ps.SGD(lr=0.05),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.05),
    "adam": ps.Adam(lr=0.01),
}
# Why a host-record cache and a device cache on the CPU agree bit for bit on a narrow
# table: both widen the same narrow values exactly, compute a refresh, an SGD step or the
# optimizer's step by the same float32 ops in the same order, round the result with the
# same key (seed, id, -1 - seq), and push the same float32 pending sums.
SAME_ROUNDING = "the same float32 ops on the same widened rows, rounded with the same key"


def _store(dtype: Any, opt: ps.Optimizer) -> Capturing:
    store = Capturing()
    for k, n in enumerate(NAMES):
        init = ps.UniformInit(low=-0.5, high=0.5, seed=17 + k)  # the rounding's key
        spec = ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt, init=init, dtype=dtype)
        store.create_table(spec)
    return store


def _steps(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of ``dtype`` at each of ``x``'s magnitudes."""
    info = torch.finfo(dtype)
    mag = x.abs().clamp(min=info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def _within_steps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """On a GPU the pending sums of repeated ids are atomic additions in any order, so a
    float32 value the cache rounds can differ in its last bit and round to the
    neighbouring narrow value; a copy takes up to some 25 rounded writes between
    refreshes (bounds 4, 4), unbiased differences of a step adding like sqrt(25) = 5
    steps: within 8 steps of the type at the rows' largest magnitude."""
    a, b = a.cpu().float(), b.cpu().float()
    scale = torch.maximum(a.abs(), b.abs()).amax(dim=-1, keepdim=True)
    off = float(((a - b).abs() / _steps(scale, dtype)).max()) if a.numel() else 0.0
    assert off <= 8.0, f"{what}: {off} steps of {dtype} apart"


def _train(
    store: cache.CachedStore, inner: Capturing, device: torch.device, steps: int = 25
) -> tuple[list[torch.Tensor], dict[str, dict[str, object]], list[torch.Tensor]]:
    """A hybrid-table step sequence: prefetch_many, pull_many, push_many (gradients on
    ``device``), and another worker's pushes of hot rows straight to the store (so
    cached rows with pending updates pass the read bound and are refreshed); returns the
    served rows, the statistics and the store after a flush."""
    rng = np.random.default_rng(11)
    other = np.random.default_rng(12)

    def batch() -> dict[str, torch.Tensor]:  # repeats, unsorted, a hot head
        return {n: torch.from_numpy((rng.zipf(1.3, size=48) - 1) % ROWS) for n in NAMES}

    served = []
    ids = batch()
    for step in range(steps):
        nxt = batch()
        store.prefetch_many([ps.PullRequest(n, torch.unique(nxt[n])) for n in NAMES])
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])
        for r in got:
            assert r.rows.device == device and r.rows.dtype == torch.float32
            served.append(r.rows.cpu())
        grads = {
            n: torch.from_numpy(rng.standard_normal((48, DIM)).astype(np.float32)).to(device)
            for n in NAMES
        }
        store.push_many([ps.PushRequest(n, ids[n], grads[n] * (1 + step % 3)) for n in NAMES])
        for n in NAMES:  # the other worker
            hot = torch.from_numpy(np.unique((other.zipf(1.3, size=16) - 1) % ROWS))
            g = other.standard_normal((hot.numel(), DIM)).astype(np.float32)
            inner.push(n, hot, torch.from_numpy(g))  # not captured: not the cache's
        ids = nxt
    stats = store.cache_stats()
    store.flush()
    every = torch.arange(ROWS)
    final = []
    for n in NAMES:
        final += [inner.pull(n, every).rows, inner.clocks(n, every), inner.state(n, every)]
    return served, stats, final


def _pushes(store: Capturing) -> list[tuple[str, torch.Tensor, Any, Any, Any]]:
    """The push requests the store applied, with their tensors on the host, each in id
    order: a push's ids are distinct and a store applies them in id order, so the order
    they came in carries nothing (host records send them sorted, device rows need not)."""
    out = []
    for r in store.requests:
        order = torch.argsort(r.ids.cpu())
        counted = [None if x is None else x.cpu()[order] for x in (r.counts, r.stats)]
        out.append((r.table, r.ids.cpu()[order], r.grads.cpu()[order], *counted))
    return out


def _case(opt: str, **settings: Any) -> tuple[dict[str, Any], str]:
    return settings, opt


# (cache settings, table optimizer): the copies step by SGD (local_step "sgd"; plain
# SGD's step is that step) or by the table's optimizer (the default for row-wise Adagrad
# and Adam).
CASES = {
    "sgd-step-bounds4-4": _case("adam", read_bound=4, write_bound=4, local_step="sgd"),
    "sgd-step-bounds0-0": _case("adam", read_bound=0, write_bound=0, local_step="sgd"),
    "sgd-lfu-unverified-bounds2-3": _case(
        "sgd", policy="lfu", read_bound=2, write_bound=3, verify_prefetched=False
    ),
    "rowwise-adagrad-step-bounds4-4": _case("rowwise_adagrad", read_bound=4, write_bound=4),
    "adam-step-bounds4-4": _case("adam", read_bound=4, write_bound=4),
    "adam-step-bounds0-0": _case("adam", read_bound=0, write_bound=0),
    "adam-step-uncounted-bounds2-3": _case(
        "adam", read_bound=2, write_bound=3, counted_pushes=False
    ),
    "grouped-tinylfu-sgd-step-bounds4-4": _case(
        "adam", policy="tinylfu", read_bound=4, write_bound=4, local_step="sgd", group_tables=True
    ),
    "grouped-rowwise-adagrad-step-bounds2-3": _case(
        "rowwise_adagrad", read_bound=2, write_bound=3, group_tables=True
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", sorted(NARROW))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("record_kernels", ["c", "numpy"])
def test_narrow_device_rows_equal_host_records(
    device: str, dtype: str, case: str, record_kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, opt_name = CASES[case]
    if record_kernels == "c" and not records.available():
        pytest.skip("no C compiler: the numpy record path only")
    if record_kernels == "c" and opt_name == "rowwise_adagrad":
        # The C pass takes row-wise Adagrad's local step itself, summing the accumulator
        # in another order than the torch step the device runs (float32 tables alike).
        pytest.skip("row-wise Adagrad's local step: the numpy record path is the torch step")
    if record_kernels == "numpy":
        force_numpy_paths(monkeypatch)
    dev = torch.device(device)
    config = cache.CacheConfig(capacity_rows=30, evict_chunk=4, prefetch="on", **settings)
    a_inner, b_inner = _store(dtype, OPTIMIZERS[opt_name]), _store(dtype, OPTIMIZERS[opt_name])
    host = cache.CachedStore(a_inner, config)
    on_device = cache.CachedStore(b_inner, config, device=dev)
    a = _train(host, a_inner, torch.device("cpu"))
    b = _train(on_device, b_inner, dev)
    for tc in on_device._caches.values():  # the device holds the rows in the table's type
        assert tc.data is not None and tc.data.rows.dtype == NARROW[dtype]
    for tc in host._caches.values():
        assert tc.kind == records.ROW_KINDS[dtype]  # the reference keeps narrow records
    exact = dev.type == "cpu"
    for k, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
        if exact:
            assert_same(y, x, what=f"served pull {k}", why=SAME_ROUNDING)
        else:
            _within_steps(y, x, NARROW[dtype], f"served pull {k}")
        assert torch.equal(y.to(NARROW[dtype]).float(), y), "served rows are narrow values"
    assert a[1] == b[1]
    st = next(iter(b[1].values()))
    bound = settings["read_bound"]
    assert st["evictions"] > 0 and st["prefetched"] > 0, st
    assert st["refreshes"] > 0 and (st["hits"] > 0 or bound == 0), st
    pa, pb = _pushes(a_inner), _pushes(b_inner)
    assert len(pa) == len(pb) > 0
    for k, (x, y) in enumerate(zip(pa, pb, strict=True)):
        assert x[0] == y[0] and torch.equal(x[1], y[1]), f"push {k}: tables or ids"
        for part, (xp, yp) in enumerate(zip(x[2:], y[2:], strict=True)):
            if xp is None or yp is None:
                assert xp is None and yp is None, f"push {k} part {part}"
            elif exact or xp.dtype == torch.int64:
                assert_same(yp, xp, what=f"push {k} part {part}", why=SAME_ROUNDING)
            else:  # float32 pending sums, summed in another order on a GPU
                torch.testing.assert_close(yp, xp, rtol=1e-5, atol=1e-5)
    for k, (x, y) in enumerate(zip(a[2], b[2], strict=True)):
        if exact or x.dtype == torch.int64:
            assert_same(y, x, what=f"store part {k}", why=SAME_ROUNDING)
        elif k % 3 == 0:  # rows
            _within_steps(y, x, NARROW[dtype], f"store rows {k}")
        else:  # float32 optimizer state of pushes summed in another order
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)


def _run_steps(store: cache.CachedStore, seed: int, steps: int) -> list[torch.Tensor]:
    """``steps`` pull/prefetch/push steps on table ``t``; the served rows (host)."""
    rng = np.random.default_rng(seed)
    served = []
    for step in range(steps):
        ids = torch.from_numpy((rng.zipf(1.3, size=32) - 1) % 40)
        nxt = torch.from_numpy((rng.zipf(1.3, size=32) - 1) % 40)
        served.append(store.pull("t", ids).rows.cpu())
        store.prefetch("t", nxt)
        grads = rng.standard_normal((32, DIM)).astype(np.float32) * (1 + step % 3)
        store.push("t", ids, torch.from_numpy(grads))
    return served


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", sorted(NARROW))
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_narrow_device_cache_state_round_trip(device: str, dtype: str, opt: str) -> None:
    """A device cache of a narrow table saved after some steps holds narrow values
    widened (float32 rows). Three identical runs save at the same step (the same store
    each): the state of one loads into a new device cache, that of another into a
    host-record cache, and the third goes on without loading. All three serve the same
    rows and leave the same store, bit for bit on the CPU (the loaded rows are exact
    narrow values, every later write rounded with the same key and request numbers)."""
    dev = torch.device(device)
    config = cache.CacheConfig(capacity_rows=16, read_bound=3, write_bound=3, evict_chunk=2)
    runs = []
    for _ in range(3):  # identical runs up to the save
        inner = _store(dtype, OPTIMIZERS[opt])
        store = cache.CachedStore(inner, config, device=dev)
        _run_steps(store, seed=1, steps=8)
        runs.append((inner, store, store.cache_state()))
    saved = runs[0][2]["t"]
    rows = saved["rows"]
    assert rows.dtype == torch.float32 and rows.shape[0] > 0
    assert torch.equal(rows.to(NARROW[dtype]).float(), rows), "saved rows are narrow values"
    assert ("opt_state" in saved) == (opt == "adam")  # the optimizer's local step
    for k in range(1, 3):
        for key, value in runs[k][2]["t"].items():
            assert torch.equal(value, saved[key]), f"run {k}: {key} (identical runs)"
    loaded = []
    for (inner, _, state), where in zip(runs[:2], (dev, None), strict=True):
        again = cache.CachedStore(inner, config, device=where)
        again.load_cache_state(state)
        loaded.append((inner, again))
    loaded.append(runs[2][:2])  # the saved cache itself, going on
    ids = saved["ids"][:5]
    for what, (_, s) in zip(("device cache", "host cache", "saved cache"), loaded, strict=True):
        assert_same(s.pull("t", ids).rows.cpu(), rows[:5], what=what, why="the rows it saved")
    served = [_run_steps(s, seed=2, steps=10) for _, s in loaded]
    for _, s in loaded:
        s.flush()
    every = torch.arange(ROWS)
    want = loaded[2][0].pull("t", every).rows
    for k, (inner, _) in enumerate(loaded[:2]):
        got = inner.pull("t", every).rows
        if dev.type == "cpu":
            for step, (x, y) in enumerate(zip(served[k], served[2], strict=True)):
                assert_same(x, y, what=f"loaded cache {k}: step {step}", why=SAME_ROUNDING)
            assert_same(got, want, what=f"loaded cache {k}: store", why=SAME_ROUNDING)
        else:
            for step, (x, y) in enumerate(zip(served[k], served[2], strict=True)):
                _within_steps(x, y, NARROW[dtype], f"loaded cache {k}: step {step}")
            _within_steps(got, want, NARROW[dtype], f"loaded cache {k}: store")


@pytest.mark.parametrize("dtype", sorted(NARROW))
@pytest.mark.parametrize("local_step", ["sgd", "optimizer"])
def test_narrow_device_rows_take_half_the_row_bytes(dtype: str, local_step: str) -> None:
    """At dim 64 with Adam: a float32 cached row on the device takes 64 x 4 row bytes,
    64 x 4 pending, 64 x 4 statistics of counted pushes (sums of g^2) and, with the
    optimizer's step, 129 x 4 state (m, v, the step count); a narrow row 64 x 2 row
    bytes, the rest alike. The cache's tensors and :func:`cache.cache_bytes` (and
    :func:`cache.rows_fitting`) agree."""
    cfg = cache.CacheConfig(capacity_rows=100, read_bound=4, write_bound=4, local_step=local_step)  # type: ignore[arg-type]
    taken, counted = {}, {}
    for dt in ("fp32", dtype):
        spec = ps.TableSpec(name="t", num_rows=ROWS, dim=64, optimizer=ps.Adam(lr=0.1), dtype=dt)  # type: ignore[arg-type]
        store = ps.InProcessStore()
        store.create_table(spec)
        cs = cache.CachedStore(store, cfg, device="cpu")
        cs.pull("t", torch.arange(0))  # the table's cache is made now
        data = cs._caches["t"].data
        assert data is not None
        assert data.rows.dtype == (torch.float32 if dt == "fp32" else NARROW[dtype])
        taken[dt] = data.nbytes
        counted[dt] = cache.cache_bytes(cfg, [spec], on_device=True).device
        assert cache.rows_fitting([spec], counted[dt], cfg) == 100
    state = 129 if local_step == "optimizer" else 0
    fp32 = 100 * (64 + 64 + 64 + state) * 4
    assert taken == counted == {"fp32": fp32, dtype: fp32 - 100 * 64 * 2}
