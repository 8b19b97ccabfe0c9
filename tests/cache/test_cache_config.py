"""CacheConfig validation, capacities, and the CachedStore's Store plumbing (save/load/close)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cache
import ps

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("kw", "exc", "pattern"),
    [
        ({}, ValueError, "exactly one of capacity_rows and capacity_fraction"),
        (dict(capacity_rows=5, capacity_fraction=0.1), ValueError, "exactly one of"),
        (dict(capacity_rows=-1), ValueError, "capacity_rows must be >= 0, got -1"),
        (dict(capacity_rows=2.5), TypeError, "capacity_rows must be an int, got float"),
        (
            dict(capacity_fraction=1.5),
            ValueError,
            r"capacity_fraction must be in \(0, 1\], got 1.5",
        ),
        (dict(capacity_rows=5, policy="fifo"), ValueError, "policy must be one of .*'fifo'"),
        (dict(capacity_rows=5, read_bound=-2), ValueError, "read_bound must be >= 0, got -2"),
        (dict(capacity_rows=5, write_bound=True), TypeError, "write_bound must be an int"),
        (dict(capacity_rows=5, local_lr=-0.1), ValueError, "local_lr must be .* >= 0, got -0.1"),
        (dict(capacity_rows=5, evict_chunk=0), ValueError, "evict_chunk must be >= 1, got 0"),
        (dict(capacity_rows=5, exact_staleness=1), TypeError, "exact_staleness must be a bool"),
        (dict(capacity_rows=5, counted_pushes="yes"), TypeError, "counted_pushes must be a bool"),
    ],
)
def test_bad_config(kw: dict[str, object], exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        cache.CacheConfig(**kw)  # type: ignore[arg-type]


def test_capacity_and_local_lr() -> None:
    fixed = ps.TableSpec(name="f", num_rows=1001, dim=2, optimizer=ps.Adam(lr=0.003))
    dyn = ps.TableSpec(name="d", num_rows=None, dim=2, optimizer=ps.FTRL(alpha=0.1))
    cfg = cache.CacheConfig(capacity_fraction=0.1)
    assert cfg.capacity(fixed) == 101 and cfg.chunk(101) == 6
    # The default local step is the table's optimizer (no SGD step size), but for plain
    # SGD, whose optimizer step is the SGD step.
    assert cfg.local_step == "optimizer" and cfg.local_optimizer(fixed) == fixed.optimizer
    assert cfg.lr_for(fixed) == 0.0 and cfg.lr_for(dyn) == 0.0
    sgd = ps.TableSpec(name="s", num_rows=10, dim=2, optimizer=ps.SGD(lr=0.25))
    assert cfg.local_optimizer(sgd) is None and cfg.lr_for(sgd) == 0.25
    with pytest.raises(ValueError, match="table 'd' is dynamic .* use capacity_rows"):
        cfg.capacity(dyn)
    by_sgd = cache.CacheConfig(capacity_fraction=0.1, local_step="sgd")
    assert by_sgd.local_optimizer(fixed) is None and by_sgd.lr_for(fixed) == 0.003
    assert by_sgd.lr_for(dyn) == 0.0
    given = cache.CacheConfig(capacity_rows=7, local_lr=0.5)  # an SGD step size: "sgd"
    assert given.local_step == "sgd" and given.lr_for(fixed) == 0.5
    with pytest.raises(ValueError, match="local_lr=0.5 sets the step of local_step='sgd'"):
        cache.CacheConfig(capacity_rows=7, local_lr=0.5, local_step="optimizer")
    with pytest.raises(ValueError, match="local_step must be one of"):
        cache.CacheConfig(capacity_rows=7, local_step="adam")  # type: ignore[arg-type]


def _cached(**kw: object) -> tuple[cache.CachedStore, ps.InProcessStore]:
    inner = ps.InProcessStore()
    inner.create_table(ps.TableSpec(name="t", num_rows=20, dim=3, optimizer=ps.SGD(lr=0.5)))
    cfg = cache.CacheConfig(capacity_rows=10, read_bound=5, write_bound=5)
    return cache.CachedStore(inner, cfg, **kw), inner  # type: ignore[arg-type]


def test_store_plumbing_and_errors() -> None:
    store, inner = _cached()
    assert store.tables() == ["t"] and store.spec("t") == inner.spec("t")
    with pytest.raises(ValueError, match="unknown table 'x'"):
        store.pull("x", torch.tensor([1]))
    with pytest.raises(ValueError, match="pull table 't': id 20 at position 1 is out of range"):
        store.pull("t", torch.tensor([1, 20]))
    with pytest.raises(TypeError, match="push table 't': grads must be float32"):
        store.push("t", torch.tensor([1]), torch.ones(1, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="already a CachedStore"):
        cache.CachedStore(store, store.config)
    with pytest.raises(TypeError, match="config must be a cache.CacheConfig"):
        cache.CachedStore(inner, {"capacity_rows": 3})  # type: ignore[arg-type]
    # A conditional pull through the cache is the PS's.
    got = store.pull("t", torch.tensor([1, 2]), clocks=torch.tensor([-1, 0]), bound=0)
    assert got.positions is not None and got.positions.tolist() == [0]


def test_save_flushes_load_invalidates(tmp_path: Path) -> None:
    store, inner = _cached()
    ids = torch.tensor([1, 2])
    before = store.pull("t", ids).rows
    store.push("t", ids, torch.ones(2, 3))  # pending (write bound 5): not on the PS yet
    assert torch.equal(inner.pull("t", ids).rows, before)
    store.save(tmp_path / "ck")
    assert torch.equal(inner.pull("t", ids).rows, before - 0.5)  # flushed before saving
    store.push("t", ids, torch.ones(2, 3))
    store.load(tmp_path / "ck")  # flushes (pushes the second update), then loads
    assert store.cached_ids("t").tolist() == []
    assert torch.equal(store.pull("t", ids).rows, before - 0.5)


def test_close_flushes_and_owns() -> None:
    class Closing(ps.InProcessStore):
        closed = 0

        def close(self) -> None:
            Closing.closed += 1

    for owns, closed in ((False, 0), (True, 1)):
        Closing.closed = 0
        inner = Closing()
        inner.create_table(ps.TableSpec(name="t", num_rows=5, dim=2, optimizer=ps.SGD(lr=1.0)))
        with cache.CachedStore(
            inner, cache.CacheConfig(capacity_rows=5, write_bound=9), owns_store=owns
        ) as store:
            store.pull("t", torch.tensor([0]))
            store.push("t", torch.tensor([0]), torch.ones(1, 2))
            assert inner.clocks("t", torch.tensor([0])).tolist() == [0]
        assert inner.clocks("t", torch.tensor([0])).tolist() == [1]  # flushed by close
        assert Closing.closed == closed
