"""The worker copy stepped by the table's optimizer (``CacheConfig.local_step``), against
the same batches trained on the store without a cache (the independent reference: one
push per update, the store's own kernels).

* With one worker and no write bound every update reaches the PS as the copy takes it,
  so whatever the read bound the copy served IS the PS row: equal up to the rounding of
  the two sides' kernels (the store's C row-wise Adagrad, ATen's vectorised torch ops),
  for every stateful optimizer, per table and with tables sharing one cache.
* Under a write bound the copy is far closer to the uncached run than the SGD step
  HET uses (which moves an Adam row by ``lr g`` where Adam moves it by about ``lr``).
* A cache checkpoint carries the copies' state; one saved without it (SGD step) reads
  the state from the store.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import cache
import ps
from cache.kernels import records
from tests.support.cache_kernels import force_numpy_paths
from tolerance import assert_close, sum_tol

pytestmark = [pytest.mark.timeout(120), pytest.mark.numerics]

ROWS, DIM = 300, 16
NAMES = ("t", "u")

OPTS = {
    "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.05),
    "adagrad": ps.Adagrad(lr=0.05),
    "adam": ps.Adam(lr=0.01),
    "adam_wd": ps.Adam(lr=0.01, weight_decay=0.01),
    "ftrl": ps.FTRL(alpha=0.1),
    "sgd_momentum": ps.SGD(lr=0.05, momentum=0.9),
}


def _store(opt: ps.Optimizer) -> ps.InProcessStore:
    store = ps.InProcessStore()
    for n in NAMES:
        store.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt))
    return store


def _batches(steps: int, seed: int = 3) -> list[tuple[dict[str, torch.Tensor], ...]]:
    """Per step the ids (hot-headed, repeated, unsorted) and gradients of each table."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = {n: torch.from_numpy((rng.zipf(1.2, size=40) - 1) % ROWS) for n in NAMES}
        grads = {
            n: torch.from_numpy(rng.standard_normal((40, DIM)).astype(np.float32)) for n in NAMES
        }
        out.append((ids, grads))
    return out


def _served_vs_reference(
    opt: ps.Optimizer, config: cache.CacheConfig, steps: int = 40
) -> tuple[float, float]:
    """Train the same batches through a cache and on a plain store; returns the largest
    difference of a served row to the plain store's row at that step, and the largest
    tolerance of :func:`sum_tol` for it (every row's updates and moves so far)."""
    inner, ref = _store(opt), _store(opt)
    store = cache.CachedStore(inner, config)
    moved = {n: torch.zeros(ROWS) for n in NAMES}  # per row: the reference's moves summed
    updates = {n: torch.zeros(ROWS, dtype=torch.int64) for n in NAMES}
    worst, worst_tol = 0.0, 0.0
    for ids, grads in _batches(steps):
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])
        for n, r in zip(NAMES, got, strict=True):
            want = ref.pull(n, ids[n]).rows
            worst = max(worst, float((r.rows - want).abs().max()))
            u = torch.unique(ids[n])
            magnitude = float(want.abs().amax(dim=1).max() + moved[n][u].max())
            # Per update both sides round each of the optimizer's few operations once.
            worst_tol = max(worst_tol, sum_tol(torch.float32, 8 * int(updates[n][u].max()) + 8,
                                               magnitude))  # fmt: skip
        store.push_many([ps.PushRequest(n, ids[n], grads[n]) for n in NAMES])
        for n in NAMES:
            u = torch.unique(ids[n])
            before = ref.pull(n, u).rows
            ref.push(n, ids[n], grads[n])
            moved[n][u] += (ref.pull(n, u).rows - before).abs().amax(dim=1)
            updates[n][u] += 1
    return worst, worst_tol


@pytest.mark.parametrize("record_kernels", ["c", "numpy"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("read_bound", [2, 6])
@pytest.mark.parametrize("opt", list(OPTS))
def test_the_copy_is_the_ps_row_without_a_write_bound(
    opt: str, read_bound: int, grouped: bool, record_kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row-wise Adagrad's copy steps in the C record pass (or, without it, by the
    optimizer's torch code); the others by the optimizer's torch code either way."""
    if record_kernels == "c" and not records.available():
        pytest.skip("no C compiler: the numpy record path only")
    if record_kernels == "numpy":
        force_numpy_paths(monkeypatch)
    config = cache.CacheConfig(
        capacity_rows=60,
        policy="tinylfu",
        read_bound=read_bound,
        write_bound=0,
        sole_writer=True,
        group_tables=grouped,
    )
    worst, tol = _served_vs_reference(OPTS[opt], config)
    why = "the same optimizer steps on both sides, each rounding a few times per update"
    assert worst <= tol, f"served rows {worst} from the PS rows; tolerance {tol} ({why})"
    # The SGD step of the copy is far off: what the optimizer's step fixes.
    sgd = cache.CacheConfig(
        capacity_rows=60, policy="tinylfu", read_bound=read_bound, sole_writer=True,
        group_tables=grouped, local_step="sgd",
    )  # fmt: skip
    off, _ = _served_vs_reference(OPTS[opt], sgd)
    assert off > 100 * max(worst, tol), (off, worst)


@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam", "adagrad"])
def test_under_a_write_bound_the_copy_stays_close(opt: str) -> None:
    """Bounds (4, 4): each copy's own steps are the uncached run's; only a refreshed row's
    counted sub-steps (docs/cache.md) differ from its updates one by one."""

    def config(step: str) -> cache.CacheConfig:
        return cache.CacheConfig(
            capacity_rows=60, policy="tinylfu", read_bound=4, write_bound=4,
            sole_writer=True, local_step=step,  # type: ignore[arg-type]
        )  # fmt: skip

    by_opt, _ = _served_vs_reference(OPTS[opt], config("optimizer"))
    by_sgd, _ = _served_vs_reference(OPTS[opt], config("sgd"))
    assert by_opt < 0.25 * by_sgd, (by_opt, by_sgd)


def test_the_refreshed_copy_keeps_its_pending_updates() -> None:
    """A cached row with pending updates, refreshed after another writer pushed it: the
    PS row and state advanced by the pending updates exactly as the PS then applies
    them (bit for bit: the same counted step on the same values, here plain torch on
    both sides: Adam)."""
    opt = ps.Adam(lr=0.01)
    inner = _store(opt)
    config = cache.CacheConfig(capacity_rows=50, read_bound=0, write_bound=3)
    store = cache.CachedStore(inner, config)
    ids = torch.arange(5)
    gen = torch.Generator().manual_seed(1)
    store.pull("t", ids)
    for _ in range(2):  # two pending updates per row (write bound 3: none pushed)
        store.push("t", ids, torch.randn(5, DIM, generator=gen))
    inner.push("t", ids, torch.randn(5, DIM, generator=gen))  # another writer: stale now
    served = store.pull("t", ids).rows  # refreshed: PS row + its 2 pending updates
    store.flush()  # the pending updates reach the PS as one counted push
    assert torch.equal(served, inner.pull("t", ids).rows)
    assert store.cache_stats()["t"]["refreshes"] == 5


def test_a_checkpoint_carries_the_state_of_the_copies(tmp_path: Path) -> None:
    opt = ps.RowWiseAdagrad(lr=0.05)
    batches = _batches(30)

    def run(
        store: cache.CachedStore, part: list[tuple[dict[str, torch.Tensor], ...]]
    ) -> list[torch.Tensor]:
        out = []
        for ids, grads in part:
            out += [r.rows for r in store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])]
            store.push_many([ps.PushRequest(n, ids[n], grads[n]) for n in NAMES])
        return out

    config = cache.CacheConfig(capacity_rows=60, read_bound=5, write_bound=0, sole_writer=True)
    inner = _store(opt)
    a = cache.CachedStore(inner, config)
    run(a, batches[:15])
    saved = a.cache_state()
    assert all(s["opt_state"].shape[1] == 1 for s in saved.values())
    # Two caches on copies of the store: one going on, one loaded from the checkpoint.
    inner.save(tmp_path / "ps")
    other = _store(opt)
    other.load(tmp_path / "ps")
    b = cache.CachedStore(other, config)
    b.load_cache_state(saved)
    for x, y in zip(run(a, batches[15:]), run(b, batches[15:]), strict=True):
        assert torch.equal(x, y)
    # A checkpoint of copies stepped by SGD holds no state: it is read from the store.
    sgd = cache.CachedStore(_store(opt), cache.CacheConfig(capacity_rows=60, local_step="sgd"))
    run(sgd, batches[:3])
    no_state = sgd.cache_state()
    assert all("opt_state" not in s for s in no_state.values())
    c = cache.CachedStore(inner, config)
    c.load_cache_state(no_state)
    name = next(iter(no_state))
    got = c._caches[name]  # noqa: SLF001 - the loaded records' state is what is checked
    slots = np.flatnonzero(got.row_id >= 0)
    ids = torch.from_numpy(got.row_id[slots].copy())
    held = torch.from_numpy(got.slab[slots, got.state_at : got.state_at + 1].copy())
    assert_close(held, inner.state(name, ids), atol=0.0, what="loaded state",
                 why="read from the store, unchanged")  # fmt: skip
