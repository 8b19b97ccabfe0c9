"""A sole writer's cache writes its copies back (``CacheConfig.write_back="values"``).

Reference: the same batches on a plain store, no cache. Row-wise Adagrad steps a cached
copy in the records' C pass with the store kernel's operations in the same order, and a
written row is stored as it is, so with one worker every served row, every final row
and every accumulator equals the uncached run's bit for bit, whatever the bounds (a
counted push, by contrast, approximates a row's ``k`` updates). Without the C pass the
copy steps by the optimizer's torch code: within a few roundings per update. Stores: the
in-process one and a real ``redis-server``. Clocks count the PS's requests of a row, so
they equal those of a cache that pushes gradient sums on the same schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cache
import ps
from cache.kernels import records
from ps.group_requests import GroupWrite, IdSpace
from ps.kernels import message_pass
from redis_server import redis_server
from tests.support.cache_kernels import force_numpy_paths
from tolerance import sum_tol

pytestmark = [pytest.mark.timeout(300), pytest.mark.numerics]

ROWS, DIM, NAMES, LR = 400, 8, ("a", "b"), 0.05
BOUNDS = [(0, 0), (4, 4), (2, 7)]


def _specs() -> list[ps.TableSpec]:
    opt = ps.RowWiseAdagrad(lr=LR)
    return [ps.TableSpec(name=n, num_rows=ROWS, dim=DIM, optimizer=opt) for n in NAMES]


def _train(store: ps.Store, steps: int = 50) -> list[torch.Tensor]:
    """Zipf-like batches (repeats, unsorted) pulled and pushed; the rows served each step."""
    g = torch.Generator().manual_seed(3)
    served = []
    for step in range(steps):
        ids = {n: (torch.rand(120, generator=g) ** 3 * ROWS).long() for n in NAMES}
        got = store.pull_many([ps.PullRequest(n, ids[n]) for n in NAMES])
        served.append(torch.cat([r.rows for r in got]))
        grads = [torch.sin(3 * r.rows + step) for r in got]  # depend on what was served
        store.push_many([ps.PushRequest(n, ids[n], x) for n, x in zip(NAMES, grads, strict=True)])
    if isinstance(store, cache.CachedStore):
        store.flush()
    return served


def _table(store: ps.Store, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    every = torch.arange(ROWS)
    return store.pull(name, every).rows, store.state(name, every), store.clocks(name, every)


def _config(bounds: tuple[int, int], policy: str, grouped: bool, write_back: str):
    return cache.CacheConfig(
        capacity_rows=40, policy=policy, read_bound=bounds[0], write_bound=bounds[1],  # type: ignore[arg-type]
        sole_writer=True, group_tables=grouped, write_back=write_back,  # type: ignore[arg-type]
    )  # fmt: skip


def _run(make: object, config: cache.CacheConfig | None):
    inner = make()  # type: ignore[operator]
    for spec in _specs():
        inner.create_table(spec)
    store = inner if config is None else cache.CachedStore(inner, config)
    return inner, store, _train(store)


@pytest.mark.skipif(not records.available(), reason="no C compiler: the numpy path below")
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
@pytest.mark.parametrize("bounds", BOUNDS)
def test_written_back_is_the_uncached_run(bounds, policy, grouped) -> None:
    ref, _, want = _run(ps.InProcessStore, None)
    inner, store, got = _run(ps.InProcessStore, _config(bounds, policy, grouped, "values"))
    why = "row-wise Adagrad: the records' pass runs the store kernel's operations"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: served rows differ ({why})"
    for n in NAMES:
        rows, state, _ = _table(inner, n)
        want_rows, want_state, _ = _table(ref, n)
        assert torch.equal(rows, want_rows), f"table {n}: final rows differ ({why})"
        assert torch.equal(state, want_state), f"table {n}: accumulators differ ({why})"
    written = sum(int(inner.stats()[n]["rows_written"]) for n in NAMES)
    assert written > 0
    # The same schedule of requests as a cache pushing gradient sums: the same clocks.
    grads, _, _ = _run(ps.InProcessStore, _config(bounds, policy, grouped, "gradients"))
    for n in NAMES:
        assert torch.equal(_table(inner, n)[2], _table(grads, n)[2]), f"table {n}: clocks"
        assert int(grads.stats()[n]["rows_written"]) == 0


def test_a_counted_push_does_not_reach_the_uncached_run() -> None:
    """What the writes fix: under a write bound, gradient sums are counted sub-steps."""
    ref, _, _ = _run(ps.InProcessStore, None)
    inner, _, _ = _run(ps.InProcessStore, _config((4, 4), "tinylfu", True, "gradients"))
    diff = float((_table(inner, "a")[0] - _table(ref, "a")[0]).abs().max())
    assert diff > 1e-3, diff


def test_written_back_without_the_c_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path: the copy steps by the optimizer's torch code, the store by its C
    kernel; both round each of the step's few operations once per update."""
    ref, _, want = _run(ps.InProcessStore, None)
    force_numpy_paths(monkeypatch)
    inner, _, got = _run(ps.InProcessStore, _config((4, 4), "tinylfu", True, "values"))
    worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    magnitude = float(max(x.abs().max() for x in want)) + 50 * LR  # a row moves <= lr a step
    tol = sum_tol(torch.float32, 8 * 50, magnitude)
    assert worst <= tol, f"served rows {worst} from the uncached run's; tolerance {tol}"
    assert int(inner.stats()["a"]["rows_written"]) > 0


def test_written_back_over_redis() -> None:
    """Over a real redis-server the written copies are stored as they are (HSET of their
    float32 bytes; :func:`test_a_bad_write_changes_nothing` reads them back bit for bit),
    but the rows the cache passes through are stepped by Redis's push script in doubles:
    so the run stays within a few roundings per update of the uncached in-process run."""
    ref, _, want = _run(ps.InProcessStore, None)
    with redis_server() as srv:
        redis = ps.RedisStore(srv.url)
        try:
            _, _, got = _run(lambda: redis, _config((4, 4), "tinylfu", True, "values"))
            worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
            magnitude = float(max(x.abs().max() for x in want)) + 50 * LR  # <= lr a step
            tol = sum_tol(torch.float32, 8 * 50, magnitude)
            assert worst <= tol, f"served rows {worst} from the uncached run's; tolerance {tol}"
            for n in NAMES:
                rows, state, _ = _table(redis, n)
                want_rows, want_state, _ = _table(ref, n)
                assert float((rows - want_rows).abs().max()) <= tol, f"table {n}: rows"
                rel = float(((state - want_state).abs() / want_state.clamp_min(1e-30)).max())
                assert rel <= 8 * 50 * 2**-23, f"table {n}: accumulators, relative {rel}"
            assert int(redis.stats()["a"]["rows_written"]) > 0
        finally:
            redis.close()


def test_auto_writes_back_only_where_it_can() -> None:
    """``auto``: a sole writer of row-wise Adagrad rows writes back; several writers, or
    another optimizer, push gradient sums; ``values`` where it cannot says why."""
    inner = ps.InProcessStore()
    adagrad = ps.TableSpec(name="r", num_rows=ROWS, dim=DIM, optimizer=ps.RowWiseAdagrad(lr=LR))
    adam = ps.TableSpec(name="m", num_rows=ROWS, dim=DIM, optimizer=ps.Adam(lr=LR))
    for spec in (adagrad, adam):
        inner.create_table(spec)

    def writes(spec: ps.TableSpec, **kw: object) -> bool:
        config = cache.CacheConfig(capacity_rows=10, write_bound=2, **kw)  # type: ignore[arg-type]
        store = cache.CachedStore(inner, config)
        store.pull(spec.name, torch.arange(4))
        return store._cache(spec.name).values

    assert writes(adagrad, sole_writer=True)
    assert not writes(adagrad, sole_writer=False)
    assert not writes(adagrad, sole_writer=True, write_back="gradients")
    assert not writes(adam, sole_writer=True)
    for spec, kw, why in (
        (adagrad, {"sole_writer": False}, "only writer"),
        (adam, {"sole_writer": True}, "adam"),
    ):
        with pytest.raises(ValueError, match=why) as e:
            writes(spec, write_back="values", **kw)
        assert repr(spec.name) in str(e.value)
    with pytest.raises(ValueError, match="write_back must be one of"):
        cache.CacheConfig(capacity_rows=1, write_back="rows")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["inprocess", "redis"])
def test_a_bad_write_changes_nothing(kind: str) -> None:
    """Every request of a write is checked before any row changes, with the table and
    the value named."""
    with redis_server() as srv:
        store = ps.InProcessStore() if kind == "inprocess" else ps.RedisStore(srv.url)
        try:
            for spec in _specs():
                store.create_table(spec)
            before = _table(store, "a")
            ids = torch.tensor([3, 7])
            g = torch.Generator().manual_seed(0)
            values, acc = torch.randn(2, DIM, generator=g), torch.rand(2, 1, generator=g)
            good = ps.WriteRequest("a", ids, values, acc, torch.tensor([5, 6]))
            bad = [
                (ps.WriteRequest("b", torch.tensor([1, 1]), torch.ones(2, DIM), torch.ones(2, 1),
                                 torch.tensor([1, 1])), "distinct"),
                (ps.WriteRequest("b", ids, torch.full((2, DIM), float("nan")), torch.ones(2, 1),
                                 torch.tensor([1, 1])), "row id 3 .* NaN"),
                (ps.WriteRequest("b", torch.tensor([1, ROWS]), torch.ones(2, DIM),
                                 torch.ones(2, 1), torch.tensor([1, 1])), f"id {ROWS} "),
                (ps.WriteRequest("b", ids, torch.ones(2, DIM), torch.ones(2, 1),
                                 torch.tensor([1, -1])), "clock -1 for row id 7"),
                (ps.WriteRequest("b", ids, torch.ones(2, DIM + 1), torch.ones(2, 1),
                                 torch.tensor([1, 1])), r"expected \(2, 8\)"),
                (ps.WriteRequest("zz", ids, torch.ones(2, DIM), torch.ones(2, 1),
                                 torch.tensor([1, 1])), "unknown table"),
            ]  # fmt: skip
            for request, match in bad:
                with pytest.raises((ValueError, TypeError), match=match) as e:
                    store.write_many([good, request])
                if request.table != "zz":
                    assert "'b'" in str(e.value)
                for x, y in zip(_table(store, "a"), before, strict=True):
                    assert torch.equal(x, y), "a refused write changed the table"
            store.write_many([good])
            rows, state, clocks = _table(store, "a")
            assert torch.equal(rows[ids], values), "written rows are stored as they are"
            assert torch.equal(state[ids], acc)
            assert clocks[ids].tolist() == [5, 6]
        finally:
            store.close()


def test_a_group_write_is_one_c_pass() -> None:
    """The in-process store applies a shared cache's write (every table of its id space)
    in one checked C pass; a write the pass's checks refuse goes the per-table way,
    which says what is wrong and changes nothing."""
    if not records.available():
        pytest.skip("no C compiler")
    assert message_pass.available(), "the records' kernels build but the message passes do not"
    store = ps.InProcessStore()
    for spec in _specs():
        store.create_table(spec)
    space = IdSpace(NAMES, np.array([0, ROWS, 2 * ROWS], dtype=np.int64))
    packed = torch.tensor([3, 50, ROWS + 7, 2 * ROWS - 1])  # two rows of each table
    g = torch.Generator().manual_seed(1)
    rows, acc = torch.randn(4, DIM, generator=g), torch.rand(4, 1, generator=g)
    served = store._batched.served
    store.write_groups_async([GroupWrite(space, packed, rows, acc, torch.tensor([4, 5, 6, 7]))])
    assert store._batched.served == served + 1, "the group write did not take the C pass"
    got = store.pull("b", torch.tensor([7, ROWS - 1]))
    assert torch.equal(got.rows, rows[2:]) and got.clocks.tolist() == [6, 7]
    assert torch.equal(store.state("a", torch.tensor([3, 50])), acc[:2])
    before = _table(store, "a")
    nan = rows.clone()
    nan[1, 0] = float("nan")
    with pytest.raises(ValueError, match="write table 'a': rows of row id 50"):
        store.write_groups_async([GroupWrite(space, packed, nan, acc, torch.tensor([1, 1, 1, 1]))])
    for x, y in zip(_table(store, "a"), before, strict=True):
        assert torch.equal(x, y)
