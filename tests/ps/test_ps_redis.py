"""RedisStore against real redis-server processes, with the in-process store as reference.

Every test talks to a real ``redis-server`` (started on a free loopback port by
``tests/support/redis_server.py`` and always stopped); tests share one server per module
and keep apart by key prefix. The cluster tests start three masters.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

import ps
from ps.redis.conn import RedisLink
from ps.redis.store import RedisAuthError, RedisStore, RedisUnavailableError
from ps_batched import check_batched
from ps_faults import LossyRedisStore
from ps_lifecycle import check_lifecycle
from ps_reference import RecordingStore, assert_matches_reference
from redis_server import (
    RedisCluster,
    RedisServer,
    free_port,
    redis_cluster,
    redis_server,
)
from tolerance import assert_close, assert_same

pytestmark = pytest.mark.timeout(60)

_WORKER = Path(__file__).resolve().parent / "ranks" / "ps_redis_worker.py"
_EXACTLY_ONCE = Path(__file__).resolve().parent / "ranks" / "ps_exactly_once.py"

OPTIMIZERS = [
    ps.SGD(lr=0.1),
    ps.SGD(lr=0.05, momentum=0.9),
    ps.RowWiseAdagrad(lr=0.1, initial_accumulator=0.1),
    ps.Adagrad(lr=0.1, initial_accumulator=0.1),
    ps.Adam(lr=0.01),
    ps.Adam(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
    ps.FTRL(alpha=0.1, beta=1.0, l1=0.01, l2=0.01),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with redis_cluster(3) as c:
        yield c


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    with RedisStore(server.url, prefix=_prefix(), buckets=8) as s:
        yield s


def _pushes(n_rows: int | None, dim: int, steps: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Pushes with repeated ids (fixed: ids in range; dynamic: wide int64 ids)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[torch.Tensor, ...]] = []
    for _ in range(steps):
        if n_rows is None:
            pool = torch.tensor([-(2**62), -5, 0, 3, 2**40, 2**63 - 1, 123456789, -77])
            ids = pool[torch.randint(0, pool.numel(), (12,), generator=gen)]
        else:
            ids = torch.randint(0, n_rows, (3 * n_rows // 2,), generator=gen)
        grads = torch.randn(ids.numel(), dim, generator=gen)
        out.append((ids, grads))
    return out


def _assert_same(redis_store: ps.Store, ref: RecordingStore, table: str, ids: torch.Tensor) -> None:
    """Rows and state of ``redis_store`` within the replay tolerances of ``ref``'s (Redis
    computes in doubles and rounds to float32 once per update, the in-process store
    rounds every operation: two float32 runs of the same pushes); clocks exactly."""
    a, b = redis_store.pull(table, ids), ref.pull(table, ids)
    ref.assert_pull_close(table, ids, a.rows, b.rows, table)
    assert torch.equal(a.clocks, b.clocks)
    ref.assert_state_close(table, ids, redis_store.state(table, ids), table)
    assert torch.equal(redis_store.clocks(table, ids), ref.clocks(table, ids))


# Bit for bit where SGD's lr * g is exact in float32 (lr 1 and g a multiple of 1/2, or
# lr a power of two and g a multiple of 1/8 with exact sums): each update of a row is one
# subtraction of an exact value, rounded once to float32 by both stores (Redis from the
# exact double, the in-process store by its float32 kernel, fused or not), so both give
# the correctly rounded result on any CPU.
REPLAY = "4 x the float32 reference's error against its float64 replay (ps_reference.Replay)"
EXACT_SGD = "SGD with lr * g exact: every update is one correctly rounded subtraction"


def _assert_exact(redis_store: ps.Store, ref: ps.Store, table: str, ids: torch.Tensor) -> None:
    """Bit for bit (see :data:`EXACT_SGD`); clocks exactly."""
    a, b = redis_store.pull(table, ids), ref.pull(table, ids)
    assert_same(a.rows, b.rows, what=f"{table} rows", why=EXACT_SGD)
    assert torch.equal(a.clocks, b.clocks)
    assert torch.equal(redis_store.clocks(table, ids), ref.clocks(table, ids))


# ---------------------------------------------------------------- optimizers and pulls


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: str(o.to_json()))
@pytest.mark.parametrize("dim", [5, 64, 300])
def test_every_optimizer_matches_inprocess(store: RedisStore, opt: ps.Optimizer, dim: int) -> None:
    # dim 5: one chunk of columns; 64: one full chunk (SGD) or two; 300: the chunk loop.
    rows = 40
    spec = ps.TableSpec(name="t", num_rows=rows, dim=dim, optimizer=opt)
    ref = RecordingStore()
    ref.create_table(spec)
    store.create_table(spec)
    for ids, grads in _pushes(rows, dim, steps=4, seed=dim):
        store.push("t", ids, grads)
        ref.push("t", ids, grads)
    _assert_same(store, ref, "t", torch.arange(rows))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: str(o.to_json()))
@pytest.mark.parametrize("dim", [5, 64])
def test_counted_pushes_match_inprocess(store: RedisStore, opt: ps.Optimizer, dim: int) -> None:
    """Counted pushes (counts 1 to 5, repeated ids, plain pushes between) as the in-process
    store applies them (``ps.Optimizer.apply_counted``), within the replay tolerances:
    Redis runs the sub-steps in doubles, rounding every stored value to float32 after each,
    as separate pushes would (row-wise Adagrad: the accumulator so, the row moved once by
    the sum of the steps); rows of one update take the plain script."""
    rows = 40
    spec = ps.TableSpec(name="t", num_rows=rows, dim=dim, optimizer=opt)
    ref = RecordingStore()
    ref.create_table(spec)
    store.create_table(spec)
    gen = torch.Generator().manual_seed(dim)
    q = opt.stat_dim(dim)
    for step, (ids, grads) in enumerate(_pushes(rows, dim, steps=5, seed=dim)):
        req = ps.PushRequest("t", ids, grads)
        if step % 2 == 0:
            counts = torch.randint(1, 6, (ids.numel(),), generator=gen)
            stats = (grads * grads)[:, :q] if q > 1 else grads.square().mean(1, keepdim=True)[:, :q]
            req = ps.PushRequest("t", ids, grads * counts.unsqueeze(1), counts,
                                 stats * counts.unsqueeze(1))  # fmt: skip
        store.push_many([req])
        ref.push_many([req])
    _assert_same(store, ref, "t", torch.arange(rows))


@pytest.mark.parametrize("k", [2, 4, 5])
def test_counted_rowwise_adagrad_moves_once_as_k_pushes_would(store: RedisStore, k: int) -> None:
    """Row-wise Adagrad's counted row: the accumulator takes its ``k`` float32 additions bit
    for bit as ``k`` separate pushes of the same gradient, and the row moves once by the
    sum of the ``k`` steps, off the ``k`` pushes' row only by their roundings of the row in
    between: at most ``k - 1`` half-ulps of the largest row value passed on the way.
    Dyadic gradients keep the statistic's mean exact (``5 m / 5`` too), so the accumulators
    are equal; the row's last rounding may differ once more (``(c / k) G`` in doubles)."""
    dim, rows = 16, 8
    opt = ps.RowWiseAdagrad(lr=0.5, initial_accumulator=0.25)
    for name in ("counted", "pushes"):
        store.create_table(ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=opt))
    ids = torch.arange(rows)
    gen = torch.Generator().manual_seed(k)
    g = torch.randint(-8, 9, (rows, dim), generator=gen).float() / 16  # dyadic
    stat = g.square().mean(1, keepdim=True) * k  # exact: dyadic, dim a power of two
    counts = torch.full((rows,), k, dtype=torch.int64)
    # The tables' initial rows differ (hashed with the name): the step does not depend on
    # the row, so each table's move from its own initial row is compared.
    init = {name: store.pull(name, ids).rows for name in ("counted", "pushes")}
    store.push_many([ps.PushRequest("counted", ids, g * k, counts, stat)])
    for _ in range(k):
        store.push("pushes", ids, g)
    assert torch.equal(store.state("counted", ids), store.state("pushes", ids))
    got, want = store.pull("counted", ids).rows, store.pull("pushes", ids).rows
    values = torch.cat([got, want, *init.values()]).abs().max()
    half_ulp = 2.0 ** (math.floor(math.log2(float(values))) - 24)  # of the largest value
    got, want = got - init["counted"], want - init["pushes"]  # each rounds half an ulp
    why = (
        "the k pushes round the row k - 1 times in between, both sides round their last "
        "value and their subtraction of the initial row: k + 2 <= 2 k half-ulps"
    )
    assert_close(got, want, atol=2 * k * half_ulp, what="row moved by k updates", why=why)


def test_state_many_reads_every_table_in_one_round(store: RedisStore) -> None:
    """``state_many`` (what a cache reads for the rows it installs, all tables at once)
    returns what ``state`` returns table by table: a stateful table with rows written and
    rows never written (the initial state), a stateless table, and no ids."""
    rowwise = ps.RowWiseAdagrad(lr=0.1, initial_accumulator=0.5)
    shapes = {"a": (50, 4, ps.Adam(lr=0.01)), "r": (30, 3, rowwise), "s": (20, 2, ps.SGD(lr=0.1))}
    specs = [
        ps.TableSpec(name=n, num_rows=r, dim=d, optimizer=o) for n, (r, d, o) in shapes.items()
    ]
    for spec in specs:
        store.create_table(spec)
    gen = torch.Generator().manual_seed(2)
    for spec in specs:
        ids = torch.randint(0, int(spec.num_rows or 0), (12,), generator=gen)
        store.push(spec.name, ids, torch.randn(12, spec.dim, generator=gen))
    asks = [("a", torch.tensor([7, 0, 49, 7, 3])), ("r", torch.arange(30)),
            ("s", torch.tensor([1, 2])), ("a", torch.empty(0, dtype=torch.int64))]  # fmt: skip
    got = store.state_many(asks)
    for (name, ids), state in zip(asks, got, strict=True):
        assert torch.equal(state, store.state(name, ids)), name
    assert got[1].shape == (30, 1) and bool((got[1] >= 0.5).all())  # from the initial value
    assert got[2].shape == (2, 0) and got[3].shape == (0, 9)


REF_OPTIMIZERS = [
    *OPTIMIZERS,
    ps.Adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6),
    ps.FTRL(alpha=0.1, beta=0.0, l1=0.0, l2=0.0),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("opt", REF_OPTIMIZERS, ids=lambda o: str(o.to_json()))
def test_every_optimizer_matches_its_reference(
    store: RedisStore, opt: ps.Optimizer, dynamic: bool
) -> None:
    # The independent references of tests/support/ps_reference.py (torch.optim or the published
    # rules), as for the in-process store; row r of the reference is id key[r].
    rows, dim = 12, 5
    key = torch.arange(rows) * 7_919_000_003 - 10**15 if dynamic else torch.arange(rows)
    spec = ps.TableSpec(name="t", num_rows=None if dynamic else rows, dim=dim, optimizer=opt)
    store.create_table(spec)
    w0 = store.pull("t", key).rows.clone()  # [R, D]
    gen = torch.Generator().manual_seed(3)
    pushes = []
    for k in range(5):
        ids = torch.tensor([k % 3, 3, 4 + k % 2, 3, 7, 9 - k % 2, k % 3, 8])
        pushes.append((ids, torch.randn(ids.numel(), dim, generator=gen) * 0.7))
    pushes.append((torch.empty(0, dtype=torch.int64), torch.empty(0, dim)))
    for ids, grads in pushes:
        store.push("t", key[ids], grads)
    assert_matches_reference(store, "t", key, opt, w0, pushes, rows)


def test_sgd_is_bit_identical_with_exact_gradients(store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=50, dim=7, optimizer=ps.SGD(lr=0.25))
    ref = ps.InProcessStore()
    ref.create_table(spec)
    store.create_table(spec)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.randint(0, 50, (80,), generator=gen)
        grads = torch.randint(-8, 9, (80, 7), generator=gen).float() / 8
        store.push("t", ids, grads)
        ref.push("t", ids, grads)
    _assert_exact(store, ref, "t", torch.arange(50))  # lr 1/4, g and its sums in k/8


def test_pull_order_duplicates_and_untouched_rows(store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=30, dim=3, optimizer=ps.SGD(lr=1.0))
    store.create_table(spec)
    store.push("t", torch.tensor([4, 4, 9]), torch.ones(3, 3))
    ids = torch.tensor([9, 0, 4, 9, 29, 4])
    got = store.pull("t", ids)
    want = spec.initial_rows(ids)
    want[[0, 3]] -= 1.0
    want[[2, 5]] -= 2.0
    assert_same(got.rows, want, what="rows", why=EXACT_SGD)
    assert got.clocks.tolist() == [1, 0, 1, 1, 0, 1] and got.positions is None
    empty = store.pull("t", torch.empty(0, dtype=torch.int64))
    assert empty.rows.shape == (0, 3) and empty.clocks.shape == (0,)


@pytest.mark.parametrize("dynamic", [False, True])
def test_conditional_pull_matches_inprocess(store: RedisStore, dynamic: bool) -> None:
    n_rows = None if dynamic else 25
    spec = ps.TableSpec(name="t", num_rows=n_rows, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1))
    ref = RecordingStore()
    ref.create_table(spec)
    store.create_table(spec)
    for ids, grads in _pushes(n_rows, 4, steps=5, seed=11):
        store.push("t", ids, grads)
        ref.push("t", ids, grads)
    if dynamic:
        ids = torch.tensor([2**63 - 1, 3, 999, -5, 3, -(2**62), 0, 2**40, 42])
    else:
        ids = torch.tensor([0, 5, 7, 24, 5, 13, 1, 2, 3, 19])
    gen = torch.Generator().manual_seed(5)
    for bound in (0, 1, 3):
        caller = torch.randint(0, 4, (ids.numel(),), generator=gen)
        a = store.pull("t", ids, clocks=caller, bound=bound)
        b = ref.pull("t", ids, clocks=caller, bound=bound)
        assert a.positions is not None and b.positions is not None
        assert a.positions.tolist() == b.positions.tolist()
        tol = ref.rows_tol("t", ids[b.positions])
        assert_close(a.rows, b.rows, atol=tol, what=f"bound {bound} rows", why=REPLAY)
        assert torch.equal(a.clocks, b.clocks)
    # A caller that holds clock -1 (never seen) gets missing rows too, as initial rows.
    minus = torch.full((ids.numel(),), -1, dtype=torch.int64)
    a = store.pull("t", ids, clocks=minus, bound=0)
    b = ref.pull("t", ids, clocks=minus, bound=0)
    assert a.positions is not None and b.positions is not None
    assert a.positions.tolist() == b.positions.tolist() == list(range(ids.numel()))
    ref.assert_pull_close("t", ids, a.rows, b.rows, "clock -1")
    st = store.stats()["t"]
    assert st["pull_requests"] == 4 and st["rows_skipped_by_bound"] > 0


def test_conditional_pull_moves_only_stale_rows(server: RedisServer, store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=1000, dim=64, optimizer=ps.SGD(lr=0.1))
    store.create_table(spec)
    ids = torch.arange(1000)
    store.push("t", ids, torch.ones(1000, 64))
    store.push("t", ids[:10], torch.ones(10, 64))
    client = server.client()
    before = client.info("stats")["total_net_output_bytes"]
    got = store.pull("t", ids, clocks=torch.ones(1000, dtype=torch.int64), bound=0)
    moved = client.info("stats")["total_net_output_bytes"] - before
    assert got.positions is not None and got.positions.tolist() == list(range(10))
    assert moved < 10 * 264 + 4 * 1000, f"{moved} bytes left Redis for 10 stale rows"


# ---------------------------------------------------------------- dynamic tables, eviction


def test_dynamic_table_rows_match_inprocess(store: RedisStore) -> None:
    spec = ps.TableSpec(name="d", num_rows=None, dim=6, optimizer=ps.Adam(lr=0.01))
    ref = RecordingStore()
    ref.create_table(spec)
    store.create_table(spec)
    probe = torch.tensor([-(2**63), 2**63 - 1, 0, -1, 17])
    # Untouched ids read as the initializer's rows, without creating them.
    _assert_same(store, ref, "d", probe)
    assert store.stats()["d"]["rows"] == 0
    for ids, grads in _pushes(None, 6, steps=6, seed=2):
        store.push("d", ids, grads)
        ref.push("d", ids, grads)
    pool = torch.tensor([-(2**62), -5, 0, 3, 2**40, 2**63 - 1, 123456789, -77])
    _assert_same(store, ref, "d", torch.cat([pool, probe]))
    a, b = store.stats()["d"], ref.stats()["d"]
    assert a["rows"] == b["rows"] and a["rows_created"] == b["rows_created"] == a["rows"]


def test_fixed_table_rejects_ids_dynamic_accepts_any(store: RedisStore) -> None:
    store.create_table(ps.TableSpec(name="f", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0)))
    store.create_table(ps.TableSpec(name="d", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0)))
    with pytest.raises(ValueError, match=r"push table 'f': id -1 at position 1 is out of range"):
        store.push("f", torch.tensor([0, -1]), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"pull table 'f': id 10 at position 0"):
        store.pull("f", torch.tensor([10]))
    store.push("d", torch.tensor([-1, 2**62]), torch.ones(2, 2))
    assert store.stats()["d"]["rows"] == 2 and store.stats()["f"]["rows_stored"] == 0


def _eviction_script(store: ps.Store) -> list[torch.Tensor]:
    """Pushes and pulls on table "e"; returns the clocks after each step."""
    steps = [
        ("push", [1, 2, 3]),
        ("push", [4, 5]),
        ("pull", [1]),
        ("push", [6, 7, 2]),
        ("push", [8]),
        ("pull", [3, 6, 9]),
        ("push", [9, 10, 11, 12]),
        ("push", []),
        ("push", [1, 5, 13]),
    ]
    probe = torch.arange(0, 15)
    seen = []
    for op, ids in steps:
        t = torch.tensor(ids, dtype=torch.int64)
        if op == "push":
            store.push("e", t, torch.full((len(ids), 2), 0.5))
        else:
            store.pull("e", t)
        seen.append(store.clocks("e", probe))
    return seen


@pytest.mark.parametrize(
    "age,capacity", [(2, None), (None, 5), (3, 4)], ids=["age", "capacity", "both"]
)
def test_eviction_matches_inprocess(
    store: RedisStore, age: int | None, capacity: int | None
) -> None:
    spec = ps.TableSpec(
        name="e",
        num_rows=None,
        dim=2,
        optimizer=ps.SGD(lr=1.0),
        max_age_steps=age,
        capacity=capacity,
    )
    ref = ps.InProcessStore()
    ref.create_table(spec)
    store.create_table(spec)
    got, want = _eviction_script(store), _eviction_script(ref)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.tolist() == b.tolist(), f"after step {step}"
    probe = torch.arange(0, 15)
    _assert_exact(store, ref, "e", probe)  # lr 1, g 1/2
    sa, sb = store.stats()["e"], ref.stats()["e"]
    assert sa["rows"] == sb["rows"] and sa["rows_evicted"] == sb["rows_evicted"] > 0


# ---------------------------------------------------------------- concurrency


def _load_worker_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ps_redis_worker", _WORKER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_four_workers_lose_no_update(server: RedisServer) -> None:
    """Four clients (own connections; threads started together) push 10 000 gradient rows
    each, all in flight at once, into one table: the rows are the exact sum of every
    gradient and the clocks the pushes per row, so no update was lost or applied twice."""
    w = _load_worker_module()
    prefix = _prefix()
    with RedisStore(server.url, prefix=prefix) as store:
        store.create_table(w.table_spec(), exist_ok=True)
        gate = threading.Barrier(4, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(w.push_worker, server.url, prefix, k, gate.wait) for k in range(4)]
            for job in jobs:
                job.result()
        # Reference: the sum of every gradient in float64 (exact), clocks = pushes per row.
        total = np.zeros((w.ROWS, w.DIM))
        clocks = np.zeros(w.ROWS, dtype=np.int64)
        for k in range(4):
            for ids, grads in w.worker_pushes(k):
                np.add.at(total, ids.numpy(), grads.numpy().astype(np.float64))
                clocks[np.unique(ids.numpy())] += 1
        spec = w.table_spec()
        all_ids = torch.arange(w.ROWS)
        want = spec.initial_rows(all_ids).double().numpy() - w.LR * total
        got = store.pull(w.TABLE, all_ids)
        # Bit for bit: with lr 2**-8 and gradients in k/8 every update is exact in float32.
        assert np.array_equal(got.rows.double().numpy(), want), "lost or changed updates"
        assert got.clocks.tolist() == clocks.tolist()
        assert int(clocks.sum()) > 4 * w.PUSHES * w.ROWS // 2  # rows were shared


# ---------------------------------------------------------------- checkpoints


def _fill(store: ps.Store) -> None:
    specs = [
        ps.TableSpec(name="fixed", num_rows=60, dim=5, optimizer=ps.Adam(lr=0.01)),
        ps.TableSpec(name="dyn", num_rows=None, dim=3, optimizer=ps.FTRL(alpha=0.1, l1=0.01)),
        ps.TableSpec(name="plain", num_rows=20, dim=2, optimizer=ps.SGD(lr=0.5)),
    ]
    for spec in specs:
        store.create_table(spec)
        for ids, grads in _pushes(spec.num_rows, spec.dim, steps=3, seed=len(spec.name)):
            store.push(spec.name, ids, grads)


def _assert_tables_equal(a: ps.Store, b: RecordingStore) -> None:
    assert sorted(a.tables()) == sorted(b.tables())
    for name in a.tables():
        spec = a.spec(name)
        assert spec.to_json() == b.spec(name).to_json()
        if spec.num_rows is not None:
            ids = torch.arange(spec.num_rows)
        else:
            ids = torch.tensor([-(2**62), -5, 0, 3, 2**40, 2**63 - 1, 123456789, -77, 8])
        _assert_same(a, b, name, ids)
        if spec.num_rows is None:
            assert a.stats()[name]["rows"] == b.stats()[name]["rows"]


def test_save_load_round_trips_with_inprocess(server: RedisServer, tmp_path: Path) -> None:
    ref = RecordingStore()
    _fill(ref)
    with RedisStore(server.url, prefix=_prefix(), buckets=4) as rs:
        _fill(rs)
        _assert_tables_equal(rs, ref)
        rs.save(tmp_path / "from_redis")
        ref.save(tmp_path / "from_local")
        # Redis -> in-process
        back = ps.InProcessStore()
        back.load(tmp_path / "from_redis")
        _assert_tables_equal(back, ref)
    # in-process -> Redis (another prefix, another bucket count: resharding by id)
    with RedisStore(server.url, prefix=_prefix(), buckets=3) as rs2:
        rs2.create_table(ps.TableSpec(name="plain", num_rows=5, dim=1, optimizer=ps.SGD(lr=1.0)))
        rs2.load(tmp_path / "from_local")  # replaces "plain", creates the others
        _assert_tables_equal(rs2, ref)
        # and pushes after a load continue from the loaded state on both
        for s in (rs2, ref):
            s.push("dyn", torch.tensor([3, 77]), torch.ones(2, 3))
        _assert_tables_equal(rs2, ref)


def test_load_applies_capacity_and_resets_ages(server: RedisServer, tmp_path: Path) -> None:
    spec = ps.TableSpec(name="e", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0), capacity=3)
    big = ps.TableSpec(name="e", num_rows=None, dim=2, optimizer=ps.SGD(lr=1.0))
    src = ps.InProcessStore()
    src.create_table(big)
    src.push("e", torch.tensor([5, -3, 9, 1, 7]), torch.ones(5, 2))
    src.save(tmp_path / "c")
    # Rewrite the spec with a capacity by loading into stores whose table has one.
    ckpt = ps.checkpoint.read_checkpoint(tmp_path / "c")
    part = ckpt.read_table("e")
    ps.checkpoint.write_checkpoint(tmp_path / "cap", [(spec, [part])])
    ref = ps.InProcessStore()
    ref.load(tmp_path / "cap")
    with RedisStore(server.url, prefix=_prefix()) as rs:
        rs.load(tmp_path / "cap")
        probe = torch.tensor([-3, 1, 5, 7, 9])
        assert rs.clocks("e", probe).tolist() == ref.clocks("e", probe).tolist()
        assert rs.stats()["e"]["rows"] == ref.stats()["e"]["rows"] == 3


# ---------------------------------------------------------------- bad input, errors


def test_bad_requests_name_the_table_and_write_nothing(
    server: RedisServer, store: RedisStore
) -> None:
    store.create_table(ps.TableSpec(name="t", num_rows=20, dim=4, optimizer=ps.SGD(lr=1.0)))
    store.push("t", torch.tensor([1, 2]), torch.ones(2, 4))
    client = server.client()
    keys_before = sorted(client.keys(f"*{store.prefix}*"))
    before = store.pull("t", torch.arange(20))
    ids = torch.tensor([0, 5])
    bad = [
        (ids.int(), torch.ones(2, 4), TypeError, r"push table 't': ids must be int64"),
        (ids, torch.ones(2, 4).double(), TypeError, r"push table 't': grads must be float32"),
        (ids, torch.ones(3, 4), ValueError, r"grads have shape \(3, 4\), expected \(2, 4\)"),
        (torch.tensor([0, 20]), torch.ones(2, 4), ValueError, r"id 20 at position 1"),
        (
            ids,
            torch.tensor([[1.0] * 4, [1.0, math.nan, 1.0, 1.0]]),
            ValueError,
            r"push table 't': gradient of row id 5 \(position 1\) contains NaN",
        ),
    ]
    for bad_ids, grads, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            store.push_async("t", bad_ids, grads)
    with pytest.raises(ValueError, match=r"unknown table 'nope'; known tables: \['t'\]"):
        store.push("nope", ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="conditional pull needs both clocks and bound"):
        store.pull("t", ids, bound=1)
    with pytest.raises(ValueError, match=r"table 't' already exists on Redis"):
        store.create_table(ps.TableSpec(name="t", num_rows=20, dim=5, optimizer=ps.SGD(lr=1.0)))
    with pytest.raises(ValueError, match=r"contains '\{'"):
        store.create_table(ps.TableSpec(name="a{b}", num_rows=2, dim=1, optimizer=ps.SGD(lr=1.0)))
    after = store.pull("t", torch.arange(20))
    assert_same(after.rows, before.rows, what="rows", why="refused requests write nothing")
    assert torch.equal(before.clocks, after.clocks)
    assert sorted(client.keys(f"*{store.prefix}*")) == keys_before


def test_nan_policy_skip_drops_only_bad_rows(store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0), nan_policy="skip")
    ref = RecordingStore()
    ref.create_table(spec)
    store.create_table(spec)
    ids = torch.tensor([1, 2, 2, 3])
    grads = torch.tensor([[1.0, 1.0], [math.inf, 0.0], [1.0, 1.0], [0.5, 0.5]])
    store.push("t", ids, grads)
    ref.push("t", ids, grads)
    _assert_same(store, ref, "t", torch.arange(10))
    assert store.stats()["t"]["rows_skipped_nan"] == ref.stats()["t"]["rows_skipped_nan"] == 1


def test_tables_are_shared_between_clients(server: RedisServer) -> None:
    prefix = _prefix()
    spec = ps.TableSpec(name="t", num_rows=10, dim=2, optimizer=ps.SGD(lr=1.0))
    with RedisStore(server.url, prefix=prefix) as a, RedisStore(server.url, prefix=prefix) as b:
        a.create_table(spec)
        b.create_table(spec, exist_ok=True)
        assert b.tables() == ["t"]
        a.push("t", torch.tensor([3]), torch.ones(1, 2))
        assert b.pull("t", torch.tensor([3])).clocks.tolist() == [1]
        other = ps.TableSpec(name="t", num_rows=10, dim=2, optimizer=ps.SGD(lr=0.5))
        shapes = r"10 x 2 sgd\(lr=1, .*asks for 10 x 2 sgd\(lr=0.5, "
        with pytest.raises(ps.TableSpecMismatch, match=shapes):
            b.create_table(other, exist_ok=True)
        with RedisStore(server.url, prefix=prefix) as c:  # a third client finds it by name
            assert c.spec("t").to_json() == spec.to_json()
            assert c.clocks("t", torch.tensor([3])).tolist() == [1]
        with RedisStore(server.url, prefix=_prefix()) as d:  # another prefix: another job
            assert d.tables() == []


def _lifecycle(workers: int, **open_kw: object) -> None:
    """:func:`check_lifecycle` by ``workers`` clients (threads) of one Redis at once."""
    prefix = _prefix()
    stores = [RedisStore(prefix=prefix, **open_kw) for _ in range(workers)]  # type: ignore[arg-type]
    gate = threading.Barrier(workers, timeout=30)
    try:
        with ThreadPoolExecutor(workers) as pool:
            jobs = [
                pool.submit(check_lifecycle, s, r, workers, gate.wait, "race")
                for r, s in enumerate(stores)
            ]
            for job in jobs:
                job.result()
        assert stores[0].tables() == []
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_table_lifecycle_with_racing_clients(server: RedisServer, workers: int) -> None:
    """Clients race to create one table (SET NX of its meta): all succeed on one table;
    TableExistsError, TableSpecMismatch (naming both shapes), drop_table, re-create."""
    _lifecycle(workers, host=server.host, port=server.port)


def test_async_requests_in_flight_and_script_cache_flush(
    server: RedisServer, store: RedisStore
) -> None:
    spec = ps.TableSpec(name="t", num_rows=100, dim=3, optimizer=ps.SGD(lr=1.0))
    store.create_table(spec)
    ref = RecordingStore()
    ref.create_table(spec)
    handles = []
    for ids, grads in _pushes(100, 3, steps=4, seed=9):
        handles.append(store.push_async("t", ids, grads))
        ref.push("t", ids, grads)
    pulls = [store.pull_async("t", torch.arange(100)) for _ in range(3)]
    for h in handles + pulls:
        h.wait()
    _assert_same(store, ref, "t", torch.arange(100))
    server.client().script_flush()  # e.g. a Redis restart: scripts reload on NOSCRIPT
    store.push("t", torch.tensor([1]), torch.ones(1, 3))
    ref.push("t", torch.tensor([1]), torch.ones(1, 3))
    _assert_same(store, ref, "t", torch.arange(100))


def test_requests_apply_in_issue_order_whatever_the_wait_order(store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=50, dim=4, optimizer=ps.Adam(lr=0.1))
    store.create_table(spec)
    ref = RecordingStore()
    ref.create_table(spec)
    ids = torch.arange(50)
    store.push("t", ids, torch.ones(50, 4))  # rows exist: later pushes take one round trip
    ref.push("t", ids, torch.ones(50, 4))
    handles = []
    for k, (p_ids, grads) in enumerate(_pushes(50, 4, steps=6, seed=4)):
        handles.append(store.push_async("t", p_ids, grads))
        ref.push("t", p_ids, grads)
        if k == 2:
            mid = store.pull_async("t", ids)  # must see exactly the first three pushes
            want_mid = ref.pull("t", ids)
            tol_mid = ref.rows_tol("t", ids)
    last = store.pull_async("t", ids)
    got_last = last.wait()  # waited first: reads the replies of everything before it
    got_mid = mid.wait()
    for h in reversed(handles):
        h.wait()
    assert torch.equal(got_mid.clocks, want_mid.clocks)
    assert_close(got_mid.rows, want_mid.rows, atol=tol_mid, what="mid rows", why=REPLAY)
    want = ref.pull("t", ids)
    assert torch.equal(got_last.clocks, want.clocks)
    ref.assert_pull_close("t", ids, got_last.rows, want.rows, "last")
    _assert_same(store, ref, "t", ids)


def test_password_and_acl_user() -> None:
    spec = ps.TableSpec(name="t", num_rows=4, dim=2, optimizer=ps.SGD(lr=1.0))
    with redis_server(password="s3cret", acl_user=("alice", "wonder")) as srv:
        with pytest.raises(RedisAuthError, match=rf"Redis at 127.0.0.1:{srv.port} refused"):
            RedisStore(srv.url)
        with pytest.raises(RedisAuthError, match="username/password"):
            RedisStore(srv.url, password="wrong")
        with RedisStore(srv.url, password="s3cret") as s:
            s.create_table(spec)
            s.push("t", torch.tensor([1]), torch.ones(1, 2))
        with RedisStore(srv.url, username="alice", password="wonder") as s:
            assert s.clocks("t", torch.tensor([1])).tolist() == [1]
        url = f"redis://alice:wonder@127.0.0.1:{srv.port}/0"
        with RedisStore(url) as s:
            assert s.tables() == ["t"]


def test_tls_options_reach_redis_py(server: RedisServer, tmp_path: Path) -> None:
    # No TLS-enabled redis-server here: check what redis-py was given, and that a TLS
    # client against a plain server fails fast with the address.
    ca = tmp_path / "ca.pem"
    link = RedisLink(
        url=None,
        host="127.0.0.1",
        port=server.port,
        db=0,
        username="u",
        password="p",
        ssl=True,
        ssl_ca_certs=str(ca),
        ssl_certfile="/certs/client.pem",
        ssl_keyfile="/certs/client.key",
        ssl_cert_reqs="required",
        cluster=False,
        socket_timeout=1.0,
        connect_timeout=1.0,
    )
    pool = link.client_of(link.address).connection_pool
    assert pool.connection_class is redis.SSLConnection
    kw = pool.connection_kwargs
    assert kw["ssl_ca_certs"] == str(ca)
    assert kw["ssl_certfile"] == "/certs/client.pem" and kw["ssl_keyfile"] == "/certs/client.key"
    assert kw["username"] == "u" and kw["password"] == "p"
    link.close()
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailableError, match=rf"127.0.0.1:{server.port}"):
        RedisStore(server.url, ssl=True, ssl_cert_reqs="none", socket_timeout=1.0)
    assert time.monotonic() - t0 < 10


def test_dead_or_hung_redis_fails_fast_with_the_address() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailableError, match=rf"cannot reach Redis at 127.0.0.1:{port}"):
        RedisStore(f"redis://127.0.0.1:{port}/0", connect_timeout=1.0)
    assert time.monotonic() - t0 < 5
    spec = ps.TableSpec(name="t", num_rows=4, dim=2, optimizer=ps.SGD(lr=1.0))
    with redis_server() as srv:
        store = RedisStore(srv.url, socket_timeout=1.0, connect_timeout=1.0)
        store.create_table(spec)
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)  # hung: accepts nothing, answers nothing
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailableError, match=rf"127.0.0.1:{srv.port}"):
                store.pull("t", torch.tensor([1]))
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        srv.proc.terminate()
        srv.proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailableError, match=rf"127.0.0.1:{srv.port}"):
            store.push("t", torch.tensor([1]), torch.ones(1, 2))
        assert time.monotonic() - t0 < 5
        store.close()


def test_bucket_hashes_are_hash_tables_when_created_and_loaded(
    server: RedisServer, tmp_path: Path
) -> None:
    """Every bucket's rows and state hash is a Redis hash table from its creation and
    after a load (never the compact list Redis keeps small hashes of short values in,
    where each id is found by a scan): dim 4 rows (24 bytes) and row-wise Adagrad's
    4-byte state would both be lists. The wide field is not a row: stats, save and
    load see only the rows. A store on one server makes 8 buckets per table."""
    spec = ps.TableSpec(name="t", num_rows=1000, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1))
    ids = torch.arange(0, 1000, 7)
    with RedisStore(server.url, prefix=_prefix()) as store:
        store.create_table(spec)
        client = server.client()
        t = store._tables["t"]  # the layout under test: its bucket keys
        assert t.buckets == 8

        def encodings() -> set[bytes]:
            return {client.object("encoding", k) for k in t.w_keys + t.s_keys}

        assert encodings() == {b"hashtable"}
        store.push("t", ids, torch.ones(ids.numel(), 4))
        assert store.stats()["t"]["rows_stored"] == ids.numel()
        before = store.pull("t", ids), store.state("t", ids)
        store.save(tmp_path / "ck")
        store.load(tmp_path / "ck")
        t = store._tables["t"]
        assert encodings() == {b"hashtable"}
        assert store.stats()["t"]["rows_stored"] == ids.numel()
        after = store.pull("t", ids), store.state("t", ids)
        assert torch.equal(before[0].rows, after[0].rows)
        assert torch.equal(before[0].clocks, after[0].clocks)
        assert torch.equal(before[1], after[1])


def test_stats_counts_rows_and_requests(store: RedisStore) -> None:
    spec = ps.TableSpec(name="t", num_rows=100, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1))
    store.create_table(spec)
    store.push("t", torch.tensor([1, 1, 2, 3]), torch.ones(4, 4))
    store.pull("t", torch.tensor([1, 50]))
    st = store.stats()["t"]
    assert st["rows"] == 100 and st["rows_stored"] == 3 and st["bytes"] == 3 * (4 * 5 + 8)
    assert st["push_requests"] == 1 and st["rows_pushed"] == 3 and st["rows_created"] == 3
    assert st["pull_requests"] == 1 and st["rows_pulled"] == 2
    assert set(ps.STAT_KEYS) <= set(st)


# ---------------------------------------------------------------- batched requests


def test_batched_requests_match_per_table_ones(server: RedisServer) -> None:
    with RedisStore(server.url, prefix=_prefix(), buckets=8) as s:
        check_batched(s, "batch-", servers=1)


def _counts(store: RedisStore) -> tuple[int, int]:
    c = store.request_counts()
    return c["pull_messages"], c["push_messages"]


def test_request_counts_are_round_trips(store: RedisStore) -> None:
    """One round trip per request or batch (one node); the extra ones are where the module
    docstring says: rows a push must create without having read them first (second round),
    the step of a table with eviction."""
    fixed = ps.TableSpec(name="f", num_rows=100, dim=3, optimizer=ps.Adam(lr=0.1))
    aged = ps.TableSpec(name="e", num_rows=None, dim=3, optimizer=ps.SGD(lr=1.0), max_age_steps=50)
    for spec in (fixed, aged):
        store.create_table(spec)
    assert store.request_counts() == {"pull_messages": 0, "push_messages": 0, "servers": 1}
    ids = torch.arange(0, 40)
    store.push("f", ids, torch.ones(40, 3))  # rows never read: created in a second round
    assert _counts(store) == (0, 2)
    assert store.stats()["f"]["rows_created"] == 40
    new = torch.arange(40, 60)
    store.pull("f", new)  # read as missing: the push brings their initial rows along
    store.push("f", new, torch.ones(20, 3))
    assert _counts(store) == (1, 3)
    assert store.stats()["f"]["rows_created"] == 60
    store.clocks("f", ids), store.state("f", ids)  # neither a pull nor a push
    assert _counts(store) == (1, 3)
    many = [ps.PullRequest("f", ids), ps.PullRequest("e", ids)]
    store.pull_many(many)  # the step of "e" (one round trip), then the batch
    store.push_many([ps.PushRequest(r.table, r.ids, torch.ones(40, 3)) for r in many])
    assert _counts(store) == (3, 5)  # the push: INCR of the step, the batch
    store.push_many([])
    store.pull_many([])
    assert _counts(store) == (3, 5)
    # Hints are kept per id across reads, since a cache pushes a row when its updates are
    # due or it is evicted, often many reads later (bounded: tests/ps/test_redis_hints.py).
    g = ps.TableSpec(name="g", num_rows=None, dim=3, optimizer=ps.SGD(lr=1.0))
    store.create_table(g)
    reads = [torch.arange(10) + 100 * k for k in range(9)]
    for r in reads:
        store.pull("g", r)
    store.push("g", reads[-1], torch.ones(10, 3))  # hinted: one round trip
    store.push("g", reads[0], torch.ones(10, 3))  # read 9 reads ago, still hinted: one
    store.push("g", torch.arange(10) + 5000, torch.ones(10, 3))  # never read: two
    assert _counts(store) == (3 + len(reads), 5 + 1 + 1 + 2)
    assert store.stats()["g"]["rows_created"] == 30


def test_batches_in_flight_apply_in_issue_order(store: RedisStore) -> None:
    """Unwaited batches and per-table requests on several tables apply in issue order,
    whatever the wait order (Adam is order-sensitive): reads see exactly the pushes
    issued before them (rows exist: no second rounds), and pushes creating new rows
    (second rounds pending) end equal to the reference."""
    specs = [
        ps.TableSpec(name="a", num_rows=30, dim=4, optimizer=ps.Adam(lr=0.1)),
        ps.TableSpec(name="d", num_rows=None, dim=4, optimizer=ps.Adam(lr=0.1)),
    ]
    ref = RecordingStore()
    ids = torch.arange(30)
    for spec in specs:
        for s in (store, ref):
            s.create_table(spec)
            s.push(spec.name, ids, torch.ones(30, 4))
    gen = torch.Generator().manual_seed(11)

    def steps(new: int, read: bool) -> None:
        """Four steps; table "d" gets ids from ``new`` on (new rows unless 0)."""
        handles, reads = [], []
        for k in range(4):
            batch = [
                ps.PushRequest(
                    s.name,
                    torch.randint(0, 30, (20,), generator=gen) + (new if s.name == "d" else 0),
                    torch.randn(20, 4, generator=gen),
                )
                for s in specs
            ]
            handles.append(store.push_many_async(batch))
            one, g = (
                torch.randint(0, 30, (8,), generator=gen) + new,
                torch.randn(8, 4, generator=gen),
            )
            handles.append(store.push_async("d", one, g))
            for r in [*batch, ps.PushRequest("d", one, g)]:
                ref.push(r.table, r.ids, r.grads)
            if read and k in (1, 3):
                pulls = [ps.PullRequest(s.name, ids) for s in specs]
                tols = [ref.rows_tol(s.name, ids) for s in specs]
                reads.append((store.pull_many_async(pulls), ref.pull_many(pulls), tols))
        for h, want, tols in reversed(reads):  # the later read first
            for g, w, tol in zip(h.wait(), want, tols, strict=True):
                assert_close(g.rows, w.rows, atol=tol, what="read rows", why=REPLAY)
                assert torch.equal(g.clocks, w.clocks)
        for h in reversed(handles):
            h.wait()

    steps(0, read=True)
    # New rows are created in second rounds when the pushes settle, so a read waited
    # after later pushes were applied would see them too (see docs/ps_protocol.md): no
    # reads here, the final state must still be the reference's.
    steps(100, read=False)
    _assert_same(store, ref, "a", ids)
    _assert_same(store, ref, "d", torch.arange(0, 130))


def test_hints_from_a_read_older_than_a_push_are_not_used(store: RedisStore) -> None:
    """A pull issued before a push of the same new rows must not let a later push create
    them (with its own update) before the first push's second round (Adam: order shows)."""
    spec = ps.TableSpec(name="d", num_rows=None, dim=4, optimizer=ps.Adam(lr=0.1))
    ref = RecordingStore()
    for s in (store, ref):
        s.create_table(spec)
    ids = torch.tensor([5, 7, 2**40])
    g1, g2 = torch.ones(3, 4), -2 * torch.ones(3, 4)
    read = store.pull_async("d", ids)  # finds the rows missing
    first = store.push_async("d", ids, g1)  # creates them when settled
    read.wait()
    second = store.push_async("d", ids, g2)
    second.wait()
    first.wait()
    for g in (g1, g2):
        ref.push("d", ids, g)
    _assert_same(store, ref, "d", ids)


def _exactly_once_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ps_exactly_once", _EXACTLY_ONCE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _push_batches_losing_replies(store: LossyRedisStore) -> tuple[str, dict[str, int]]:
    """The exactly-once sequences of tests/ps/ranks/ps_exactly_once.py, both tables of a step
    in one push_many; ``(comparison with the references, summed push counters)``."""
    eo = _exactly_once_module()
    with store:
        for spec in (eo.shared_spec(), eo.own_spec(0)):
            store.create_table(spec)
        eo.zero_shared(store)
        steps = zip(eo.shared_pushes(0), eo.own_pushes(0), strict=True)
        for (si, sg), (oi, og) in steps:
            store.push_many([ps.PushRequest("shared", si, sg), ps.PushRequest("own0", oi, og)])
        result = eo.compare(store, 1)
        st = store.stats()
    keys = ("push_calls", "push_calls_applied", "push_calls_repeated")
    counters = {k: sum(int(v[k]) for v in st.values()) for k in keys}
    counters["min_retries"] = min(int(v["push_retries"]) for v in st.values())
    return result, counters


@pytest.mark.parametrize("dedup", [True, False], ids=["exactly_once", "control"])
def test_batched_pushes_with_lost_replies_apply_once(server: RedisServer, dedup: bool) -> None:
    """Every third batch's replies are lost after the scripts ran (first rounds and second
    rounds alike), so whole batches are resent: with sequence numbers every resent call
    is a repeat; without (the control) resends are applied twice and the sums differ."""
    store = LossyRedisStore(
        server.url,
        prefix=_prefix(),
        buckets=4,
        retry_backoff_s=0.01,
        drop_reply_every=3,
        exactly_once=dedup,
    )
    result, c = _push_batches_losing_replies(store)
    assert c["min_retries"] > 0, c
    if dedup:
        assert result == "match", result
        assert c["push_calls_applied"] == c["push_calls"] and c["push_calls_repeated"] > 0, c
    else:
        assert result.startswith("mismatch") and "shared rows" in result, result
        assert c["push_calls_applied"] > c["push_calls"] and c["push_calls_repeated"] == 0, c


# ---------------------------------------------------------------- cluster


@pytest.mark.timeout(120)
def test_cluster_table_lifecycle_with_racing_clients(cluster: RedisCluster) -> None:
    _lifecycle(2, host=cluster.host, port=cluster.port, cluster=True)


@pytest.mark.timeout(120)
def test_cluster_matches_inprocess(cluster: RedisCluster, tmp_path: Path) -> None:
    ref = RecordingStore()
    with RedisStore(host=cluster.host, port=cluster.port, cluster=True, prefix=_prefix()) as rs:
        for s in (rs, ref):
            _fill(s)
        _assert_tables_equal(rs, ref)
        # The buckets really are spread over the masters.
        holders = {
            n.port
            for n in cluster.nodes
            for _ in n.client().scan_iter(match=f"{{{rs.prefix}:fixed:*", count=1000)
        }
        assert len(holders) == 3, f"bucket keys on nodes {holders}"
        ids = torch.arange(60)
        caller = torch.randint(0, 3, (60,), generator=torch.Generator().manual_seed(1))
        a = rs.pull("fixed", ids, clocks=caller, bound=1)
        b = ref.pull("fixed", ids, clocks=caller, bound=1)
        assert a.positions is not None and b.positions is not None
        assert a.positions.tolist() == b.positions.tolist()
        tol = ref.rows_tol("fixed", ids[b.positions])
        assert_close(a.rows, b.rows, atol=tol, what="fixed rows", why=REPLAY)
        rs.save(tmp_path / "c")
        back = ps.InProcessStore()
        back.load(tmp_path / "c")
        _assert_tables_equal(back, ref)
        rs.load(tmp_path / "c")
        _assert_tables_equal(rs, ref)


@pytest.mark.timeout(120)
def test_cluster_batched_requests_one_round_trip_per_node(cluster: RedisCluster) -> None:
    with RedisStore(host=cluster.host, port=cluster.port, cluster=True, prefix=_prefix()) as rs:
        check_batched(rs, "batch-", servers=3)


def test_cluster_batched_pushes_with_lost_replies_apply_once(cluster: RedisCluster) -> None:
    """A batch spread over three masters, its replies lost on every second batch: resent
    whole, every call that ran is a repeat."""
    store = LossyRedisStore(
        host=cluster.host,
        port=cluster.port,
        cluster=True,
        prefix=_prefix(),
        buckets=8,
        retry_backoff_s=0.01,
        drop_reply_every=2,
    )
    result, c = _push_batches_losing_replies(store)
    assert result == "match", result
    assert c["min_retries"] > 0 and c["push_calls_repeated"] > 0, c
    assert c["push_calls_applied"] == c["push_calls"], c


def test_benchmark_module_runs_small(server: RedisServer) -> None:
    from benchmarks._ps_bench_redis import bench_redis

    res = bench_redis(
        rows=2000, dim=8, batch=200, repeats=1, n_batches=1, url=server.url, step_tables=3
    )
    assert set(res["ratios"]) == {
        "redis_pull_vs_mget",
        "redis_push_vs_lua",
        "redis_push_vs_lua_copy",
    }
    assert all(v > 0 for v in res["figures"].values())
    assert set(res["counted_k1_vs_plain"]) == {"counted_rowwise", "counted_adam"}
    # A step of 3 tables: a pull and a push round trip per table, or one of each.
    assert res["steps"]["requests_per_server_step"] == {"per_table": 6.0, "batched": 2.0}
    assert all(v > 0 for v in res["steps"]["steps_per_s"].values())
