"""InProcessStore: validation before mutation, clocks, duplicate ids, optimizer math."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import comm
import ps
from cache import CacheConfig, CachedStore
from ps_lifecycle import check_lifecycle
from tolerance import assert_close, assert_same, replay_tol
from wrapped_store import WrappedStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.numerics]

ROWS, DIM = 20, 4


def _store(optimizer: ps.Optimizer | None = None) -> ps.InProcessStore:
    store = ps.InProcessStore()
    opt = ps.RowWiseAdagrad(lr=0.1) if optimizer is None else optimizer
    store.create_table(ps.TableSpec(name="t", num_rows=ROWS, dim=DIM, optimizer=opt))
    return store


def _snapshot(store: ps.Store) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    all_ids = torch.arange(ROWS)
    got = store.pull("t", all_ids)
    return got.rows.clone(), store.state("t", all_ids).clone(), got.clocks.clone()


def _assert_unchanged(store: ps.Store, before: tuple[torch.Tensor, ...]) -> None:
    after = _snapshot(store)
    for a, b in zip(before, after, strict=True):
        assert_same(a, b, what="rows, state, clocks", why="a refused request writes nothing")


def _touch(store: ps.Store) -> None:
    # Some history, so "unchanged" is not just "still initial".
    store.push("t", torch.tensor([1, 2, 3]), torch.randn(3, DIM))


GOOD_IDS = torch.tensor([0, 5])
GOOD_GRADS = torch.ones(2, DIM)

BAD_PUSHES = [
    # (ids, grads, error type, regex the message must match)
    (GOOD_IDS.int(), GOOD_GRADS, TypeError, r"table 't': ids must be int64, got torch.int32"),
    (GOOD_IDS.float(), GOOD_GRADS, TypeError, r"table 't': ids must be int64, got torch.float32"),
    ([0, 5], GOOD_GRADS, TypeError, r"table 't': ids must be a torch.Tensor"),
    (GOOD_IDS.view(2, 1), GOOD_GRADS, ValueError, r"table 't': ids must be 1-D, got shape"),
    (
        torch.tensor([0, -3]),
        GOOD_GRADS,
        ValueError,
        r"table 't': id -3 at position 1 is out of range; valid ids are \[0, 20\)",
    ),
    (
        torch.tensor([0, 20]),
        GOOD_GRADS,
        ValueError,
        r"table 't': id 20 at position 1 is out of range; valid ids are \[0, 20\)",
    ),
    (GOOD_IDS, GOOD_GRADS.double(), TypeError, r"table 't': grads must be float32, got"),
    (
        GOOD_IDS,
        torch.ones(3, DIM),
        ValueError,
        r"table 't': grads have shape \(3, 4\), expected \(2, 4\)",
    ),
    (
        GOOD_IDS,
        torch.ones(2, DIM + 1),
        ValueError,
        r"table 't': grads have shape \(2, 5\), expected \(2, 4\)",
    ),
    (
        GOOD_IDS,
        torch.tensor([[1.0] * DIM, [1.0, math.nan, 1.0, 1.0]]),
        ValueError,
        r"table 't': gradient of row id 5 \(position 1\) contains NaN or Inf",
    ),
    (
        torch.tensor([7, 9]),
        torch.tensor([[math.inf] + [0.0] * (DIM - 1), [1.0] * DIM]),
        ValueError,
        r"table 't': gradient of row id 7 \(position 0\) contains NaN or Inf",
    ),
]


@pytest.mark.parametrize("ids,grads,exc,msg", BAD_PUSHES)
def test_bad_push_raises_and_changes_nothing(ids, grads, exc, msg) -> None:  # type: ignore[no-untyped-def]
    store = _store()
    _touch(store)
    before = _snapshot(store)
    with pytest.raises(exc, match=msg):
        store.push("t", ids, grads)
    with pytest.raises(exc, match=msg):
        store.push_async("t", ids, grads)
    _assert_unchanged(store, before)


def test_bad_pull_and_unknown_table() -> None:
    store = _store()
    _touch(store)
    before = _snapshot(store)
    with pytest.raises(ValueError, match=r"unknown table 'nope'; known tables: \['t'\]"):
        store.pull("nope", GOOD_IDS)
    with pytest.raises(ValueError, match=r"unknown table 'nope'; known tables: \['t'\]"):
        store.push("nope", GOOD_IDS, GOOD_GRADS)
    with pytest.raises(ValueError, match=r"pull table 't': id 99 at position 0"):
        store.pull("t", torch.tensor([99]))
    with pytest.raises(TypeError, match=r"pull table 't': ids must be int64"):
        store.pull("t", torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"clocks table 't': id -1"):
        store.clocks("t", torch.tensor([-1]))
    _assert_unchanged(store, before)


def test_duplicate_create_table() -> None:
    store = _store()
    _touch(store)
    before = _snapshot(store)
    spec = ps.TableSpec(name="t", num_rows=5, dim=2, optimizer=ps.SGD(lr=1.0))
    with pytest.raises(ValueError, match="table 't' already exists"):
        store.create_table(spec)
    _assert_unchanged(store, before)
    assert store.num_rows("t") == ROWS and store.tables() == ["t"]


def test_clocks_count_updates_and_duplicates_count_once() -> None:
    store = _store()
    ids = torch.arange(ROWS)
    assert store.clocks("t", ids).tolist() == [0] * ROWS
    store.push("t", torch.tensor([3, 3, 3, 4]), torch.ones(4, DIM))
    store.push("t", torch.tensor([4, 5]), torch.ones(2, DIM))
    store.push("t", torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))
    want = [0] * ROWS
    want[3], want[4], want[5] = 1, 2, 1
    assert store.clocks("t", ids).tolist() == want
    assert store.pull("t", torch.tensor([4, 3])).clocks.tolist() == [2, 1]


@pytest.mark.parametrize("optimizer", [ps.SGD(lr=0.5), ps.RowWiseAdagrad(lr=0.3, eps=1e-6)])
def test_duplicate_ids_are_summed_before_one_update(optimizer: ps.Optimizer) -> None:
    # One push of ids [2, 2, 2] equals one push of [2] with the summed gradient;
    # it is not three successive updates.
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(3, DIM, generator=gen)
    a, b = _store(optimizer), _store(optimizer)
    a.push("t", torch.tensor([2, 2, 2]), grads)
    b.push("t", torch.tensor([2]), grads.sum(0, keepdim=True))
    # The store sums the three rows in the order given, as sum(0) does over the outer dim,
    # then both run the same update kernel on one [1, D] row.
    why = "the same three-term sum in the same order, then the same kernel on the same row"
    every = torch.arange(ROWS)
    assert_same(a.pull("t", every).rows, b.pull("t", every).rows, what="rows", why=why)
    assert_same(a.state("t", every), b.state("t", every), what="state", why=why)


def test_rowwise_adagrad_matches_formula() -> None:
    lr, eps, acc0 = 0.2, 1e-3, 0.5
    store = _store(ps.RowWiseAdagrad(lr=lr, eps=eps, initial_accumulator=acc0))
    ids = torch.tensor([4, 1])
    w0 = store.pull("t", torch.arange(ROWS)).rows
    assert store.state("t", torch.arange(ROWS)).squeeze(1).tolist() == [acc0] * ROWS
    gen = torch.Generator().manual_seed(1)
    pushes = [torch.randn(2, DIM, generator=gen) for _ in range(3)]
    for g in pushes:
        store.push("t", ids, g)

    def formula(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = w0.to(dtype)
        s = torch.full((ROWS,), acc0, dtype=dtype)
        for g in pushes:
            for row, gi in zip(ids.tolist(), g.to(dtype), strict=True):
                s[row] += (gi**2).mean()
                w[row] -= lr * gi / (s[row].sqrt() + eps)
        return w, s

    (w32, s32), (w64, s64) = formula(torch.float32), formula(torch.float64)
    # Three pushes of the formula in float32 against its float64 replay; the floor: the
    # last push's roundings (a mean of DIM squares, a square root, a sum, a quotient, a
    # product and a difference).
    terms = DIM + 6
    why = "4 x the float32 formula's error against its float64 replay"
    got = store.pull("t", torch.arange(ROWS)).rows
    assert_close(got, w32, atol=replay_tol(w32, w64, floor_terms=terms), what="rows", why=why)
    acc = store.state("t", torch.arange(ROWS)).squeeze(1)
    assert_close(acc, s32, atol=replay_tol(s32, s64, floor_terms=terms), what="acc", why=why)


def test_sgd_matches_formula_and_has_no_state() -> None:
    store = _store(ps.SGD(lr=0.25))
    w0 = store.pull("t", torch.arange(ROWS)).rows
    g = torch.randn(2, DIM)
    store.push("t", torch.tensor([0, 7]), g)
    w1 = store.pull("t", torch.arange(ROWS)).rows
    want = w0.clone()
    want[[0, 7]] -= 0.25 * g
    # 0.25 * g is exact: one correctly rounded subtraction on both sides, fused or not.
    assert_same(w1, want, what="rows", why="lr * g exact, one rounding per element")
    assert store.state("t", torch.arange(ROWS)).shape == (ROWS, 0)


def test_pull_returns_copies_and_async_handles() -> None:
    store = _store()
    h = store.pull_async("t", torch.tensor([1, 1]))
    assert isinstance(h, comm.Handle) and h.is_completed()
    got = h.wait()
    assert isinstance(got, ps.PullResult)
    assert got.rows.shape == (2, DIM) and got.rows.dtype == torch.float32
    assert got.clocks.dtype == torch.int64
    got.rows.add_(100.0)  # must not write through to the table
    assert float(store.pull("t", torch.tensor([1])).rows.abs().max()) < 1.0
    assert store.push_async("t", torch.tensor([1]), torch.ones(1, DIM)).wait() is None
    assert store.clocks("t", torch.tensor([1])).tolist() == [1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_initial_rows_on_a_device_are_the_host_rows_bit_for_bit(device: str) -> None:
    """The torch hash (how a GPU initialises tables in HBM) equals the numpy one."""
    ids = torch.cat([torch.arange(3000), torch.tensor([2**62, 2**63 - 1, 123456789012345])])
    for seed in (0, 7, 2**63 - 5):
        init = ps.UniformInit(low=-0.3, high=0.7, seed=seed)
        want = init.rows(ids, 9)  # numpy on the host
        got = init.rows_torch(ids.to(device), 9)
        assert got.device.type == device
        assert torch.equal(got.cpu(), want)
        assert torch.equal(init.rows(ids.to(device), 9).cpu(), want)


def test_initial_rows_deterministic_and_in_bounds() -> None:
    spec = ps.TableSpec(name="emb", num_rows=1000, dim=8, optimizer=ps.SGD(lr=1.0))
    bound = math.sqrt(1.0 / 1000)
    assert spec.init == ps.UniformInit(low=-bound, high=bound, seed=spec.init.seed)  # type: ignore[union-attr]
    a, b = ps.InProcessStore(), ps.InProcessStore()
    a.create_table(spec)
    b.create_table(spec)
    rows = a.pull("emb", torch.arange(1000)).rows
    assert torch.equal(rows, b.pull("emb", torch.arange(1000)).rows)
    assert float(rows.min()) >= -bound and float(rows.max()) < bound
    # Roughly uniform: mean near 0, variance near bound^2 / 3.
    assert abs(float(rows.mean())) < 0.05 * bound
    assert abs(float(rows.var()) / (bound**2 / 3) - 1.0) < 0.05
    # A row's value does not depend on which other rows are initialised with it.
    some = spec.initial_rows(torch.tensor([999, 3]))
    assert torch.equal(some, rows[[999, 3]])
    # Different names give different default seeds; an explicit seed is honoured.
    other = ps.TableSpec(name="emb2", num_rows=1000, dim=8, optimizer=ps.SGD(lr=1.0))
    assert not torch.equal(other.initial_rows(torch.arange(4)), rows[:4])
    init = ps.UniformInit(low=0.0, high=2.0, seed=7)
    x = ps.TableSpec(name="x", num_rows=10, dim=3, optimizer=ps.SGD(lr=1.0), init=init)
    assert x.init is init and float(x.initial_rows(torch.arange(10)).min()) >= 0.0
    # low == high: a constant row (zero-started tables), the same through a store's pull.
    zero = ps.TableSpec(name="z", num_rows=None, dim=3, optimizer=ps.SGD(lr=1.0),
                        init=ps.UniformInit(low=0.0, high=0.0))  # fmt: skip
    assert torch.equal(zero.initial_rows(torch.tensor([5, 2**62])), torch.zeros(2, 3))
    store = ps.InProcessStore()
    store.create_table(zero)
    assert torch.equal(store.pull("z", torch.tensor([7])).rows, torch.zeros(1, 3))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="SGD: lr must be a finite number > 0, got 0"):
        ps.SGD(lr=0)
    with pytest.raises(ValueError, match="RowWiseAdagrad: eps must be a finite number > 0"):
        ps.RowWiseAdagrad(lr=0.1, eps=-1.0)
    with pytest.raises(ValueError, match="initial_accumulator must be a finite number >= 0"):
        ps.RowWiseAdagrad(lr=0.1, initial_accumulator=-0.5)
    with pytest.raises(ValueError, match=r"table 'q': num_rows must be an int > 0, got 0"):
        ps.TableSpec(name="q", num_rows=0, dim=2, optimizer=ps.SGD(lr=1.0))
    with pytest.raises(ValueError, match=r"table 'q': dim must be an int > 0, got -2"):
        ps.TableSpec(name="q", num_rows=3, dim=-2, optimizer=ps.SGD(lr=1.0))
    with pytest.raises(TypeError, match=r"table 'q': optimizer must be a ps optimizer"):
        ps.TableSpec(name="q", num_rows=3, dim=2, optimizer=torch.optim.SGD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need low <= high, got low=1.0 high=0.5"):
        ps.UniformInit(low=1.0, high=0.5)


# ------------------------------------------------------------ bad input, stats, threads, lifecycle


def _dyn_store(**kw: object) -> ps.InProcessStore:
    store = ps.InProcessStore()
    spec = ps.TableSpec(name="d", num_rows=None, dim=DIM, optimizer=ps.Adagrad(lr=0.1), **kw)  # type: ignore[arg-type]
    store.create_table(spec)
    store.push(
        "d", torch.tensor([-4, 9]), torch.randn(2, DIM, generator=torch.Generator().manual_seed(5))
    )
    return store


def _dyn_snapshot(store: ps.Store) -> tuple[object, ...]:
    ids = torch.tensor([-4, 9, 0, 5, 7])
    got = store.pull("d", ids)
    stats = {
        k: v for k, v in store.stats()["d"].items() if k not in ("pull_requests", "rows_pulled")
    }
    return got.rows.clone(), got.clocks.clone(), store.state("d", ids).clone(), stats


DYN_BAD_PUSHES = [
    (GOOD_IDS.int(), GOOD_GRADS, TypeError, r"push table 'd': ids must be int64, got torch.int32"),
    (GOOD_IDS.view(2, 1), GOOD_GRADS, ValueError, r"push table 'd': ids must be 1-D"),
    (GOOD_IDS, GOOD_GRADS.half(), TypeError, r"push table 'd': grads must be float32"),
    (GOOD_IDS, torch.ones(2, DIM + 2), ValueError, r"grads have shape \(2, 6\), expected \(2, 4\)"),
    (
        torch.tensor([5, 7]),  # ids without rows: a rejected push must not create them
        torch.tensor([[1.0] * DIM, [math.inf] * DIM]),
        ValueError,
        r"push table 'd': gradient of row id 7 \(position 1\) contains NaN or Inf",
    ),
]


@pytest.mark.parametrize("ids,grads,exc,msg", DYN_BAD_PUSHES)
def test_bad_push_on_dynamic_table_changes_nothing(ids, grads, exc, msg) -> None:  # type: ignore[no-untyped-def]
    store = _dyn_store()
    before = _dyn_snapshot(store)
    with pytest.raises(exc, match=msg):
        store.push("d", ids, grads)
    after = _dyn_snapshot(store)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_nan_policy_skip_drops_only_bad_rows() -> None:
    store = _dyn_store(nan_policy="skip")
    ref = _dyn_store()
    g = torch.randn(5, DIM)
    bad = g.clone()
    bad[1, 2] = math.nan  # id 5
    bad[3, 0] = math.inf  # id 7, first of two entries: the sum is not finite either
    ids = torch.tensor([-4, 5, 9, 7, 7])
    store.push("d", ids, bad)
    ref.push("d", ids[[0, 2]], g[[0, 2]])  # what should have happened
    got, want = _dyn_snapshot(store), _dyn_snapshot(ref)
    for a, b in zip(got[:3], want[:3], strict=True):
        # Both apply the same kernel to rows -4 and 9 in one sorted [2, D] push.
        assert_same(a, b, what="rows, state, clocks", why="the same update of the same rows")
    st = store.stats()["d"]
    assert st["rows_skipped_nan"] == 2 and st["rows"] == 2  # 5 and 7 were not created
    # A fixed table with "skip": the same, and the clock of a skipped row stays.
    fixed = ps.InProcessStore()
    fixed.create_table(
        ps.TableSpec(name="t", num_rows=ROWS, dim=DIM, optimizer=ps.SGD(lr=1.0), nan_policy="skip")
    )
    fixed.push("t", torch.tensor([1, 2]), torch.tensor([[math.nan] * DIM, [1.0] * DIM]))
    assert fixed.clocks("t", torch.tensor([1, 2])).tolist() == [0, 1]


def test_stats_keys_and_counts() -> None:
    store = _store()
    store.push("t", torch.tensor([1, 1, 2]), torch.ones(3, DIM))
    store.pull("t", torch.tensor([1, 2, 3]))
    st = store.stats()["t"]
    assert set(ps.STAT_KEYS) <= set(st)
    row_bytes = 4 * (DIM + 1) + 8  # weights, the row-wise Adagrad accumulator, the clock
    assert st["rows"] == ROWS and st["bytes"] == ROWS * row_bytes
    assert (st["push_requests"], st["rows_pushed"]) == (1, 2)
    assert (st["pull_requests"], st["rows_pulled"], st["rows_skipped_by_bound"]) == (1, 3, 0)


def test_pull_result_positional_and_num_rows() -> None:
    r = ps.PullResult(torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64))
    assert r.positions is None
    assert _store().num_rows("t") == ROWS and _dyn_store().num_rows("d") is None


@pytest.mark.timeout(60)
def test_concurrent_pushes_from_threads_lose_nothing() -> None:
    import threading

    store = ps.InProcessStore()
    store.create_table(ps.TableSpec(name="t", num_rows=50, dim=2, optimizer=ps.SGD(lr=1.0)))
    store.create_table(ps.TableSpec(name="d", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0)))
    w0 = {n: store.pull(n, torch.arange(50)).rows.clone() for n in ("t", "d")}
    ids = torch.arange(50).repeat(4)  # every row 4 times per push

    def work() -> None:
        for _ in range(25):
            for n in ("t", "d"):
                store.push(n, ids, torch.ones(ids.numel(), 2) * 0.25)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in ("t", "d"):  # 4 threads x 25 pushes x summed gradient 1.0, exact in float32
        got = store.pull(n, torch.arange(50))
        want = w0[n].clone()
        for _ in range(100):
            want -= 1.0
        why = "each push subtracts exactly 1.0 (one correctly rounded step), in any order"
        assert_same(got.rows, want, what=f"{n} rows", why=why)
        assert got.clocks.tolist() == [100] * 50


def test_summed_gradient_overflow_is_rejected_before_any_change() -> None:
    store = _store(ps.SGD(lr=1.0))
    _touch(store)
    before = _snapshot(store)
    huge = torch.full((2, DIM), 3e38)  # each finite, their sum is not
    with pytest.raises(ValueError, match=r"table 't': the summed gradient of row id 4 overflows"):
        store.push("t", torch.tensor([4, 4]), huge)
    _assert_unchanged(store, before)
    assert store.stats()["t"]["push_requests"] == 1  # only _touch's push counted


def _run_workers(size: int, work: Callable[[int, Callable[[], None]], object]) -> None:
    """``work(rank, barrier)`` on ``size`` threads at once; re-raises a thread's error."""
    gate = threading.Barrier(size, timeout=30)
    with ThreadPoolExecutor(size) as pool:
        for f in [pool.submit(work, r, gate.wait) for r in range(size)]:
            f.result()


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_table_lifecycle_with_racing_workers(workers: int) -> None:
    """create_table(exist_ok) from several threads at once, TableExistsError,
    TableSpecMismatch, drop_table: on one store, and through a CachedStore per worker
    over the shared store (the cache passes both calls through)."""
    shared = ps.InProcessStore()
    _run_workers(workers, lambda r, b: check_lifecycle(shared, r, workers, b, "plain"))
    cached = [CachedStore(shared, CacheConfig(capacity_rows=16)) for _ in range(workers)]
    _run_workers(workers, lambda r, b: check_lifecycle(cached[r], r, workers, b, "cached"))
    assert shared.tables() == []


def test_batched_requests_equal_per_table_requests_and_count_one_message() -> None:
    from ps_batched import check_batched

    check_batched(ps.InProcessStore(), "batch_", servers=1)


class _OneTableAtATime(WrappedStore):
    """A store that speaks only the per-table requests (the base class batches for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def pull_async(self, table, ids, *, clocks=None, bound=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner.pull_async(table, ids, clocks=clocks, bound=bound)

    def push_async(self, table, ids, grads):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner.push_async(table, ids, grads)


def test_the_base_class_batches_any_store_one_table_at_a_time() -> None:
    store = _OneTableAtATime()
    spec = ps.TableSpec(name="t", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0))
    store.create_table(spec)
    store.create_table(dataclasses.replace(spec, name="u"))
    ids = torch.tensor([1, 2, 1])
    got = store.pull_many([ps.PullRequest("t", ids), ps.PullRequest("u", ids[:1])])
    assert [r.rows.shape[0] for r in got] == [3, 1] and store.calls == 2
    store.push_many(
        [ps.PushRequest("t", ids, torch.ones(3, 2)), ps.PushRequest("u", ids, torch.ones(3, 2))]
    )
    assert store.calls == 4
    assert torch.equal(store.clocks("t", torch.tensor([1, 2])), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="request 1 is a tuple"):
        store.pull_many([ps.PullRequest("t", ids), ("u", ids)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="'nope'"):
        store.push_many([ps.PushRequest("nope", ids, torch.ones(3, 2))])
    with pytest.raises(NotImplementedError, match="_OneTableAtATime"):
        store.request_counts()
