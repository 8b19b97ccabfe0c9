"""The cache over tables of fp16 and bf16 rows: its host records hold the rows in the
table's type.

* Bounds (0, 0): every update is pushed at once and every pushed row refreshed, so the
  cached store serves the uncached narrow store's rows bit for bit at every step (the
  store's rows are narrow values: installing and refreshing them is exact).
* Bounds (4, 4): the cached copies step locally and round stochastically; against the
  same run whose cache keeps float32 copies of the narrow table, the PS rows are the same
  bit for bit (both push the same float32 pending sums) and the served rows are within a
  few steps of the narrow type (each local write rounds once by less than one step, and
  a copy is refreshed from the PS every few writes).
* The C kernels and the numpy path give the same bits on narrow records (served rows,
  the records, the final store).
* A narrow record is smaller: its row takes ``ceil(D / 2)`` floats.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import cache.table_cache as table_cache
import ps
from cache.kernels import records
from cache.memory import cache_bytes, record_floats
from tests.support.cache_kernels import force_numpy_paths

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(120)]

ROWS, DIM = 200, 12
NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "sgd": ps.SGD(lr=0.05),
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.05),
    "adam": ps.Adam(lr=0.01),
}


def _spec(dtype: str, opt: ps.Optimizer, dim: int = DIM) -> ps.TableSpec:
    return ps.TableSpec(name="t", num_rows=ROWS, dim=dim, optimizer=opt, dtype=dtype)  # type: ignore[arg-type]


def _batches(steps: int, seed: int):  # type: ignore[no-untyped-def]
    """``steps`` batches ``(ids [64] with repeats, next ids [64], grads [64, D])``."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=64) - 1) % ROWS
    for step in range(steps):
        nxt = (rng.zipf(1.2, size=64) - 1) % ROWS
        grads = rng.standard_normal((64, DIM)).astype(np.float32) * (1 + step % 3)
        yield torch.from_numpy(ids), torch.from_numpy(nxt), torch.from_numpy(grads)
        ids = nxt


def _numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    force_numpy_paths(monkeypatch)


@pytest.mark.parametrize("dtype", sorted(NARROW))
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("path", ["kernels", "numpy"])
def test_bounds_zero_serve_the_narrow_store_s_rows_every_step(
    dtype: str, opt: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "numpy":
        _numpy_path(monkeypatch)
    plain, behind = ps.InProcessStore(), ps.InProcessStore()
    for s in (plain, behind):
        s.create_table(_spec(dtype, OPTIMIZERS[opt]))
    cfg = cache.CacheConfig(capacity_rows=60, read_bound=0, write_bound=0)
    cached = cache.CachedStore(behind, cfg)
    for ids, nxt, grads in _batches(12, seed=3):
        a, b = plain.pull("t", ids), cached.pull("t", ids)
        assert torch.equal(a.rows, b.rows)
        assert cached._caches["t"].kind == records.ROW_KINDS[dtype]  # narrow records
        cached.prefetch("t", nxt)
        plain.push("t", ids, grads)
        cached.push("t", ids, grads)
    cached.flush()
    every = torch.arange(ROWS)
    assert torch.equal(cached.pull("t", every).rows, plain.pull("t", every).rows)


def _run_bounded(dtype: str, opt: str, *, float32_copies: bool, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A run at bounds (4, 4): the served rows of every step and the final PS rows."""
    with monkeypatch.context() as m:
        if float32_copies:  # the cache keeps float32 copies of the narrow table
            m.setattr(table_cache, "ROW_KINDS", dict.fromkeys(records.ROW_KINDS, 0))
        behind = ps.InProcessStore()
        behind.create_table(_spec(dtype, OPTIMIZERS[opt]))
        cfg = cache.CacheConfig(capacity_rows=60, read_bound=4, write_bound=4)
        cached = cache.CachedStore(behind, cfg)
        cached.pull("t", torch.arange(0))  # the table's cache is made now
        assert cached._caches["t"].kind == (0 if float32_copies else records.ROW_KINDS[dtype])
    served = []
    for ids, nxt, grads in _batches(30, seed=5):
        served.append(cached.pull("t", ids).rows.clone())
        cached.prefetch("t", nxt)
        cached.push("t", ids, grads)
    cached.flush()
    return served, behind.pull("t", torch.arange(ROWS)).rows


def _steps(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of ``dtype`` at each of ``x``'s magnitudes ``[N, D]``."""
    info = torch.finfo(dtype)
    mag = x.abs().clamp(min=info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


@pytest.mark.parametrize("dtype", sorted(NARROW))
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_bounded_narrow_copies_follow_float32_copies(
    dtype: str, opt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = _run_bounded(dtype, opt, float32_copies=False, monkeypatch=monkeypatch)
    wide = _run_bounded(dtype, opt, float32_copies=True, monkeypatch=monkeypatch)
    assert torch.equal(narrow[1], wide[1])  # the PS took the same pending sums
    worst = 0.0
    for a, b in zip(narrow[0], wide[0], strict=True):
        # each local write errs by less than a step at the values it wrote, no larger than
        # the row's largest magnitude: measured in steps there
        scale = torch.maximum(a.abs(), b.abs()).amax(dim=1, keepdim=True)  # [N, 1]
        off = (a - b).abs() / _steps(scale, NARROW[dtype])
        worst = max(worst, float(off.max()))
    # A copy is refreshed (exactly: PS row minus the pending sum, rounded once) when it
    # is more than 4 pushes behind, each of up to 5 updates: some 25 rounded writes at
    # most, unbiased errors of less than a step each adding like sqrt(25) = 5 steps.
    assert worst <= 8.0, worst


@pytest.mark.skipif(not records.available(), reason="no C compiler: numpy path only")
@pytest.mark.parametrize("dtype", sorted(NARROW))
# Not row-wise Adagrad: its local step in the C pass sums the accumulator in another
# order than the numpy path's torch step, for float32 tables alike.
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("write_bound", [0, 3])
def test_kernels_equal_numpy_path_on_narrow_records(
    dtype: str, opt: str, write_bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(numpy_path: bool):  # type: ignore[no-untyped-def]
        with monkeypatch.context() as m:
            if numpy_path:
                force_numpy_paths(m)
            behind = ps.InProcessStore()
            behind.create_table(_spec(dtype, OPTIMIZERS[opt]))
            cfg = cache.CacheConfig(capacity_rows=40, read_bound=2, write_bound=write_bound)
            cached = cache.CachedStore(behind, cfg)
            served = []
            for ids, nxt, grads in _batches(25, seed=7):
                served.append(cached.pull("t", ids).rows.clone())
                cached.prefetch("t", nxt)
                cached.push("t", ids, grads)
            slab = cached._caches["t"].slab.copy()
            cached.flush()
        return served, slab, behind.pull("t", torch.arange(ROWS)).rows

    a, b = run(False), run(True)
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert np.array_equal(a[1].view(np.int32), b[1].view(np.int32))  # bits, NaN-safe
    assert torch.equal(a[2], b[2])


def test_kernel_rounds_a_narrow_step_as_ps_rounding() -> None:
    """One SGD step of a fp16 record by the C pass: the float32 step of the widened row,
    rounded by :func:`ps.rounding.round_to` with ``(seed, id, -1 - seq)``."""
    if not records.available():
        pytest.skip("no C compiler: numpy path only")
    d, kind = 10, records.ROW_KINDS["fp16"]
    w = record_floats(d, row_words=records.row_words(d, kind))
    slab = np.zeros((3, w), dtype=np.float32)
    rng = np.random.default_rng(1)
    start = torch.from_numpy(rng.standard_normal((3, d)).astype(np.float32)).half()
    slab.view(np.uint16)[:, :d] = start.view(torch.int16).numpy().view(np.uint16)
    row_ids = np.array([17, 4, 9], dtype=np.int64)
    grads = rng.standard_normal((2, d)).astype(np.float32)
    slots = np.array([2, 0], dtype=np.int64)
    own8 = np.zeros(3, dtype=np.uint8)
    got = records.update_rows(
        slab, d, slots, own8, grads, lr=0.1, write_bound=0, seq=5, kind=kind, seed=3,
        row_ids=row_ids,
    )  # fmt: skip
    assert got is not None
    step = start.float()[torch.from_numpy(slots)] - np.float32(0.1) * torch.from_numpy(grads)
    want = ps.rounding.round_to(
        step,
        torch.float16,
        seed=3,
        ids=torch.from_numpy(row_ids[slots]),
        versions=torch.full((2,), -6, dtype=torch.int64),
    )
    bits = slab.view(np.uint16)[slots, :d]
    assert np.array_equal(bits, want.view(torch.int16).numpy().view(np.uint16))
    untouched = start[1].view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(slab.view(np.uint16)[1, :d], untouched)


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_a_narrow_record_is_smaller(dtype: str) -> None:
    """At dim 64: float32 rows 64 + pending 64 + meta 16 = 144 floats (576 bytes); a
    narrow row 32 words: 112 floats (448 bytes); the cache's slab and
    :func:`cache.memory.cache_bytes` agree."""
    cfg = cache.CacheConfig(capacity_rows=100, read_bound=4, write_bound=4, local_step="sgd")
    sizes = {}
    for dt in ("fp32", dtype):
        spec = _spec(dt, ps.SGD(lr=0.1), dim=64)
        store = ps.InProcessStore()
        store.create_table(spec)
        cs = cache.CachedStore(store, cfg)
        cs.pull("t", torch.arange(0))
        tc = cs._caches["t"]
        sizes[dt] = tc.width * 4
        host = cache_bytes(cfg, [spec], on_device=False).host
        fp32_host = cache_bytes(cfg, [_spec("fp32", ps.SGD(lr=0.1), dim=64)], on_device=False).host
        assert host - fp32_host == 100 * (sizes[dt] - 576)
    assert sizes == {"fp32": 576, dtype: 448}


def test_grouped_tables_of_different_row_types_get_caches_of_their_own() -> None:
    """``group_tables``: an fp32, an fp16 and a bf16 table of one dim and optimizer,
    requested together, are cached apart (a cache's records hold one row type); at bounds
    (0, 0) each serves its uncached twin's rows bit for bit."""
    cfg = cache.CacheConfig(
        capacity_rows=50, read_bound=0, write_bound=0, local_step="sgd", group_tables=True
    )
    names = {"a": "fp32", "b": "fp16", "c": "bf16", "d": "fp16"}
    cached_store, plain = ps.InProcessStore(), ps.InProcessStore()
    for name, dt in names.items():
        spec = ps.TableSpec(name=name, num_rows=ROWS, dim=DIM, optimizer=ps.SGD(lr=0.05), dtype=dt)  # type: ignore[arg-type]
        cached_store.create_table(spec)
        plain.create_table(spec)
    cs = cache.CachedStore(cached_store, cfg)
    for ids, _, grads in _batches(6, seed=4):
        got = cs.pull_many([ps.PullRequest(n, ids) for n in names])
        want = plain.pull_many([ps.PullRequest(n, ids) for n in names])
        for n, g, w in zip(names, got, want, strict=True):
            assert torch.equal(g.rows, w.rows), f"table {n}: served rows"
        cs.push_many([ps.PushRequest(n, ids, grads) for n in names])
        plain.push_many([ps.PushRequest(n, ids, grads) for n in names])
    kinds = {n: cs._caches[cs._members[n]].spec.dtype for n in names}
    assert kinds == names, "each cache holds its tables' row type"
    assert cs._members["b"] == cs._members["d"] != cs._members["c"], "fp16 tables share one"
