"""The cache's counted pushes: every row it pushes says how many updates its sum holds,
with the statistic its optimizer needs, through every way a row leaves the cache (due
past the write bound, evicted, flushed, passed through uncached).

Each row ``r`` always gets the same gradient ``g_r`` (multiples of 1/64, so every sum
and square below is exact in float32), so a push of ``k`` updates of ``r`` must carry
exactly ``k g_r`` and ``k mean(g_r ** 2)`` (row-wise Adagrad) or ``k g_r ** 2``
(Adagrad), and the counts of a row's pushes must add up to its updates. The optimizer
math of counted pushes is ``tests/ps/test_ps_counted_push.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import ps
from cache import table_cache
from cache.kernels import records
from capturing_store import Capturing
from tests.support.cache_kernels import force_numpy_paths

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 60, 8


class Uncounting(Capturing):
    """A store that does not take counted pushes (as the MPI and Redis stores)."""

    counted_pushes = False


def _run(
    store: Capturing,
    opt: ps.Optimizer,
    *,
    policy: str = "lru",
    tables: int = 1,
    write_bound: int = 3,
    device: str | None = None,
    counted: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], int]]:
    """Train a few steps through a small cache; the gradients per row and the updates
    each row got."""
    names = [f"t{i}" for i in range(tables)]
    for n in names:
        store.create_table(ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt))
    cfg = cache.CacheConfig(
        capacity_rows=12, policy=policy, read_bound=2, write_bound=write_bound,  # type: ignore[arg-type]
        evict_chunk=2, group_tables=tables > 1, counted_pushes=counted,
    )  # fmt: skip
    cached = cache.CachedStore(store, cfg, device=device)
    gen = torch.Generator().manual_seed(5)
    g = {n: torch.randint(-64, 65, (ROWS, DIM), generator=gen).float() / 64 for n in names}
    updates: dict[tuple[str, int], int] = {}
    rng = np.random.default_rng(3)
    for _ in range(40):
        batch = {n: torch.from_numpy(np.unique((rng.zipf(1.3, 16) - 1) % ROWS)) for n in names}
        cached.pull_many([ps.PullRequest(n, i) for n, i in batch.items()])
        cached.push_many([ps.PushRequest(n, i, g[n][i]) for n, i in batch.items()])
        for n, i in batch.items():
            for r in i.tolist():
                updates[n, r] = updates.get((n, r), 0) + 1
    cached.flush()
    return g, updates


def _check(store: Capturing, opt: ps.Optimizer, g: dict, updates: dict) -> int:
    """Every pushed row against its gradient and count; returns the rows of more than
    one update pushed."""
    q = opt.stat_dim(DIM)
    seen: dict[tuple[str, int], int] = {}
    many = 0
    for r in store.requests:
        assert r.counts is not None and r.stats is not None, r.table
        assert r.stats.shape == (r.ids.numel(), q)
        for i, row, k, stat in zip(r.ids.tolist(), r.grads, r.counts.tolist(), r.stats,
                                   strict=True):  # fmt: skip
            gr = g[r.table][i]
            assert torch.equal(row, k * gr), (r.table, i, k)
            if k > 1:
                many += 1
            if k > 1 and q > 0:
                want = (gr * gr).mean().reshape(1) if q == 1 else gr * gr
                assert torch.equal(stat, k * want), (r.table, i, k, stat, want)
            seen[r.table, i] = seen.get((r.table, i), 0) + k
    assert seen == updates
    return many


@pytest.mark.parametrize("numpy_path", [False, True], ids=["kernels", "numpy"])
@pytest.mark.parametrize(
    ("opt", "policy", "tables", "device"),
    [
        (ps.RowWiseAdagrad(lr=0.1), "lru", 1, None),
        (ps.RowWiseAdagrad(lr=0.1), "tinylfu", 3, None),
        (ps.Adagrad(lr=0.1), "lfu", 1, None),
        (ps.Adam(lr=0.01), "lru", 2, None),
        (ps.RowWiseAdagrad(lr=0.1), "lru", 2, "cpu"),
        (ps.Adagrad(lr=0.1), "tinylfu", 1, "cpu"),
    ],
    ids=[
        "rowwise",
        "rowwise-tinylfu-grouped",
        "adagrad-lfu",
        "adam-grouped",
        "rowwise-device",
        "adagrad-device",
    ],  # fmt: skip
)
def test_every_pushed_row_carries_its_updates(
    opt: ps.Optimizer,
    policy: str,
    tables: int,
    device: str | None,
    numpy_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if numpy_path:
        force_numpy_paths(monkeypatch)
    elif not records.available():
        pytest.skip("no C compiler: numpy path only")
    store = Capturing()
    g, updates = _run(store, opt, policy=policy, tables=tables, device=device)
    assert _check(store, opt, g, updates) > 20  # the hot rows went as sums of several


def test_sgd_pushes_counts_without_a_statistic() -> None:
    store = Capturing()
    g, updates = _run(store, ps.SGD(lr=0.1))
    assert _check(store, ps.SGD(lr=0.1), g, updates) > 20


@pytest.mark.parametrize("why", ["store", "config", "no write bound"])
def test_plain_pushes_where_counts_cannot_go(why: str) -> None:
    """A store without counted pushes, ``counted_pushes=False``, or a write bound of 0
    (every push one update): plain pushes, one optimizer step each, as before."""
    store = Uncounting() if why == "store" else Capturing()
    _run(
        store,
        ps.RowWiseAdagrad(lr=0.1),
        counted=why != "config",
        write_bound=0 if why == "no write bound" else 3,
    )
    assert store.requests and all(r.counts is None and r.stats is None for r in store.requests)


@pytest.mark.parametrize("opt", [ps.SGD(lr=0.1), ps.RowWiseAdagrad(lr=0.1), ps.Adam(lr=0.01)])
@pytest.mark.parametrize("write_bound", [0, 2])
def test_the_memory_plan_counts_the_statistics(opt: ps.Optimizer, write_bound: int) -> None:
    """``cache.cache_bytes`` as the caches allocate: a host record grows by ``D`` floats
    for an element-wise optimizer's statistic (row-wise: the spare metadata word) and by
    the optimizer's ``S`` state floats of the local step, rows on a device by ``Q + S``
    floats."""
    from cache.memory import record_floats, stat_floats, state_floats

    spec = ps.TableSpec(name="t", num_rows=1000, dim=DIM, optimizer=opt)
    cfg = cache.CacheConfig(capacity_rows=10, write_bound=write_bound)
    q, s = stat_floats(cfg, spec), state_floats(cfg, spec)
    assert q == (opt.stat_dim(DIM) if write_bound else 0)
    assert s == (0 if isinstance(opt, ps.SGD) else opt.state_dim(DIM))
    host = table_cache.TableCache(spec, cfg, ps.InProcessStore(), counted=True)
    assert host.width == record_floats(DIM, q, s) and host.stat_dim == q
    on = table_cache.TableCache(
        spec, cfg, ps.InProcessStore(), counted=True, device=torch.device("cpu")
    )
    assert on.data is not None
    assert on.data.nbytes == cache.cache_bytes(cfg, [spec], on_device=True).device
