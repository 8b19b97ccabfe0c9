"""The pipelined sparse step (``EmbeddingCollection.set_sparse_pipeline``): the next
batch is pulled on a background thread while this batch's dense step runs.

References: the same model trained without the pipeline. With one worker, a plain store
or a cache at bounds (0, 0), the pipelined run must be bit-exact with it: every row a
batch is pooled from equals the row the unpipelined step pulls (rows pushed after the
pull ahead are pulled again), the same pushes reach the store in the same order, and
both sides run the same kernels on the same tensors. At bounds (4, 4) the cache's exact
staleness histogram shows the read bound still holds. Errors of the background thread
surface in the step that needs them, naming the table, with nothing applied."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import cache
import ps
from multiproc import run_ranks
from redis_server import redis_server
from tiny_hybrid import TinyHybrid, tiny_batch
from tolerance import assert_same

# The one-process comparisons rerun under each ATEN_CPU_CAPABILITY (numerics); the
# mpirun test, exact by dyadic sums whatever the kernels, in the main run only.
pytestmark = [pytest.mark.timeout(120)]

DIM = 8
SAME = (
    "one worker: the pipelined step pools the rows the unpipelined step pulls and pushes "
    "the same sums in the same order, through the same kernels"
)


def _train(model: TinyHybrid, pipelined: bool, steps: int = 24) -> list[torch.Tensor]:
    """The trainer's step order: announce the next batch, forward, backward, step."""
    model.emb.set_sparse_pipeline(pipelined)
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [tiny_batch(g) for _ in range(steps + 1)]
    losses = []
    for step in range(steps):
        kjt, labels = batches[step]
        model.emb.prefetch(batches[step + 1][0])
        logits = model(kjt)
        loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    model.emb.hybrid.flush()  # type: ignore[union-attr]
    return losses


def _tables(store: ps.Store) -> list[torch.Tensor]:
    out = []
    for name, rows in (("user", 300), ("item", 500)):
        every = torch.arange(rows)
        out += [store.pull(name, every).rows, store.clocks(name, every), store.state(name, every)]
    return out


OPTS = {"sgd": ps.SGD(lr=0.1, momentum=0.9), "adam": ps.Adam(lr=0.01)}


def _store(kind: str) -> ps.Store:
    if kind == "plain":
        return ps.InProcessStore()
    cfg = cache.CacheConfig(capacity_fraction=0.1, policy="lfu", sole_writer=kind == "sole")
    return cache.CachedStore(ps.InProcessStore(), cfg)


def _backing(store: ps.Store) -> ps.Store:
    return store.inner if isinstance(store, cache.CachedStore) else store


@pytest.mark.numerics
@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("kind", ["plain", "cache", "sole"])
def test_pipelined_is_bit_exact_with_one_worker(opt: str, kind: str) -> None:
    runs = []
    for pipelined in (False, True):
        store = _store(kind)
        model = TinyHybrid(store, OPTS[opt])
        losses = _train(model, pipelined)
        runs.append((losses, _tables(_backing(store)), model.top.weight.detach().clone()))
        if pipelined:
            assert model.emb.sparse_pipelined
            model.emb.set_sparse_pipeline(False)
    (la, ta, wa), (lb, tb, wb) = runs
    for step, (x, y) in enumerate(zip(lb, la, strict=True)):
        assert_same(x, y, what=f"step {step} loss", why=SAME)
    for x, y in zip(tb, ta, strict=True):
        assert_same(x, y, what="final table", why=SAME)
    assert_same(wb, wa, what="top weight", why=SAME)


@pytest.mark.numerics
def test_pipelined_cache_keeps_the_read_bound() -> None:
    """Bounds (4, 4), exact staleness: no row is served more than 4 updates behind."""
    cfg = cache.CacheConfig(
        capacity_fraction=0.2, read_bound=4, write_bound=4, exact_staleness=True
    )
    store = cache.CachedStore(ps.InProcessStore(), cfg)
    model = TinyHybrid(store, ps.SGD(lr=0.1))
    _train(model, True, steps=40)
    stats = store.cache_stats()
    for name in ("user", "item"):
        served = stats[name]["staleness_served"]
        assert max(served) <= 4 and stats[name]["hits"] > 0, served


def test_background_push_error_surfaces_in_the_next_step_naming_the_table() -> None:
    store = ps.InProcessStore()
    model = TinyHybrid(store, ps.SGD(lr=0.1))
    model.emb.set_sparse_pipeline(True)
    g = torch.Generator().manual_seed(2)
    batches = [tiny_batch(g) for _ in range(3)]
    kjt, labels = batches[0]
    model.emb.prefetch(batches[1][0])
    loss = F.binary_cross_entropy_with_logits(model(kjt), labels)
    model.top.weight.data[0, 0] = float("nan")  # the pooled rows' gradient becomes NaN
    before = _tables(store)
    loss = F.binary_cross_entropy_with_logits(model(kjt), labels)  # not the announced batch
    loss.backward()  # the push goes to the thread and fails there
    with pytest.raises(ValueError, match=r"'(user|item)'.*(NaN|finite)"):
        model.emb.prefetch(batches[2][0])
        model(batches[1][0])
    after = _tables(store)
    for x, y in zip(after, before, strict=True):
        assert torch.equal(x, y)  # nothing of the bad push was applied
    model.emb.set_sparse_pipeline(False)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["store", "cache"])
def test_pipelined_workers_over_mpi_lose_nothing(workers: int, cached: bool) -> None:
    """``tests/embedding/ranks/sparse_pipeline_mpi.py``: exact sums after the background pushes of
    1, 2 and 4 workers over a real MPI server rank; replicas refused."""
    args = ["--cache"] if cached else []
    outs = run_ranks("sparse_pipeline_mpi.py", workers + 1, "mpi", args, timeout=130)
    text = "\n".join(outs)
    assert sorted(int(r) for r in re.findall(r"rank (\d+): ok worker", text)) == list(
        range(workers)
    ), outs
    assert f"rank {workers}: ok server" in text, outs


@pytest.mark.numerics
def test_load_while_a_batch_is_pulled_ahead_serves_the_loaded_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A load replaces the rows a pull ahead read: the next forward must pool the loaded
    rows (the same as a model that never pipelined loading the same checkpoint)."""
    g = torch.Generator().manual_seed(3)
    batches = [tiny_batch(g) for _ in range(6)]
    model = TinyHybrid(ps.InProcessStore(), ps.SGD(lr=0.1))
    model.emb.set_sparse_pipeline(True)
    for step in range(5):
        kjt, labels = batches[step]
        model.emb.prefetch(batches[step + 1][0])
        F.binary_cross_entropy_with_logits(model(kjt), labels).backward()
        if step == 1:
            model.emb.save(tmp_path / "ckpt")
    model.emb.load(tmp_path / "ckpt")  # batch 5 was pulled ahead before this
    got = model.emb(batches[5][0])
    ref = TinyHybrid(ps.InProcessStore(), ps.SGD(lr=0.1))
    ref.emb.load(tmp_path / "ckpt")
    want = ref.emb(batches[5][0])
    for key in want:
        assert_same(got[key], want[key], what=f"pooled {key}", why="the same loaded rows")
    model.emb.set_sparse_pipeline(False)


@pytest.mark.parametrize("cached", [False, True], ids=["store", "cache"])
def test_pipelined_over_redis_is_bit_exact_with_one_worker(cached: bool) -> None:
    """A real redis-server: the pipeline's thread is the only one talking to Redis, and
    one worker's pipelined run equals the unpipelined one (bounds (0, 0) through a cache)."""
    runs = []
    with redis_server() as srv:
        for k, pipelined in enumerate((False, True)):
            redis = ps.RedisStore(srv.url, prefix=f"run{k}")
            store: ps.Store = redis
            if cached:
                cfg = cache.CacheConfig(capacity_fraction=0.1, sole_writer=True)
                store = cache.CachedStore(redis, cfg)
            model = TinyHybrid(store, ps.SGD(lr=0.1, momentum=0.9))
            losses = _train(model, pipelined, steps=12)
            runs.append((losses, _tables(redis)))
            model.emb.set_sparse_pipeline(False)
            redis.close()
    (la, ta), (lb, tb) = runs
    for step, (x, y) in enumerate(zip(lb, la, strict=True)):
        assert_same(x, y, what=f"step {step} loss", why=SAME)
    for x, y in zip(tb, ta, strict=True):
        assert_same(x, y, what="final table", why=SAME)


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [False, True], ids=["host-store", "device-cache"])
def test_pipelined_on_a_gpu_follows_the_unpipelined_run(cached: bool) -> None:
    """Pooling on the GPU, batches announced on the host (deduplicated on the GPU by the
    pipeline's thread); through a cache its rows in GPU memory, bounds (0, 0)."""
    runs = []
    for pipelined in (False, True):
        inner = ps.InProcessStore()
        store: ps.Store = inner
        if cached:
            cfg = cache.CacheConfig(capacity_fraction=0.1, sole_writer=True)
            store = cache.CachedStore(inner, cfg, device=torch.device("cuda"))
        model = TinyHybrid(store, ps.SGD(lr=0.1), device="cuda")
        losses = _train(model, pipelined, steps=12)
        runs.append((torch.stack(losses), _tables(inner)))
        model.emb.set_sparse_pipeline(False)
    (la, ta), (lb, tb) = runs
    # Both runs make the same CUDA calls, but the row-gradient sums use atomics whose order
    # varies: a few float32 ulps per step on O(1) values over 12 steps.
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    for x, y in zip(tb, ta, strict=True):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(x, y)
