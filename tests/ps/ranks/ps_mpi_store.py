"""Rank script: the MPI store (server ranks + worker ranks) against independent references.

Run as ``mpirun -n N python ps_mpi_store.py --servers S --phase P --dir D``; the
last ``S`` ranks serve, the others are workers. Phases (each a separate launch):

* ``main`` (4 workers + 2 servers): the table lifecycle with the workers racing to
  create one table (``tests/support/ps_lifecycle.py``); concurrency (every worker pushes 10 000
  known gradient rows with overlapping ids; rows must equal ``-lr * sum`` exactly
  and clocks the number of pushes that touched each row); every optimizer, fixed
  and dynamic tables, conditional pulls and eviction against an InProcessStore
  fed the same requests; bad input (worker-side checks and hand-made bad wire
  messages that only the server can catch); then a save from the 2 servers.
  The in-process references are saved beside it, and the concurrency table's
  expected rows as ``.npy``.
* ``reload`` (1 worker + 3 servers): load the 2-server checkpoint into 3
  servers and into an InProcessStore, compare both with the references; save
  from 3 servers and load that into an InProcessStore; load an in-process
  checkpoint into the MPI store.
* ``single`` (1 worker + 1 server): the table lifecycle, then the one-server path
  (no routing) for every optimizer, conditional pulls and bad input.

Every rank prints ``rank R: ok <role> ...`` at the end; any failed check raises.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import comm
import ps
from ps.mpi import wire
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.ps_batched import check_batched, check_whole_batches
from tests.support.ps_counted import check_counted_pushes
from tests.support.ps_lifecycle import check_lifecycle
from tests.support.ps_reference import WHY as REPLAY
from tests.support.ps_reference import RecordingStore, state_blocks
from tests.support.tolerance import assert_close, assert_same, replay_tol, sum_tol

DIM = 8
NUM_ROWS = 1000

# The MPI servers run the in-process store's kernels, but on each server's share of a
# push: other batch sizes, so an element may fall in a vectorised kernel's body (fused
# multiply-adds) on one side and in its scalar tail on the other. Rows and state are
# therefore compared within a rounding tolerance derived from the pushes (see
# :func:`tolerances`), clocks, positions and counters exactly.
SGD_SUM = (
    "plain SGD: a row is its initial value plus lr times its gradients, one sum; two "
    "evaluations are within sum_tol of its terms (any order, fused or not, restarts at "
    "an eviction included)"
)
EXACT_COPY = "loaded from the same checkpoint: a copy of the same bits"


def optimizers() -> dict[str, ps.Optimizer]:
    return {
        "sgd": ps.SGD(lr=0.1),
        "sgd_momentum": ps.SGD(lr=0.1, momentum=0.9),
        "rowwise_adagrad": ps.RowWiseAdagrad(lr=0.1),
        "adagrad": ps.Adagrad(lr=0.1, initial_accumulator=0.1),
        "adam": ps.Adam(lr=0.01, weight_decay=0.01),
        "ftrl": ps.FTRL(alpha=0.1, l1=0.01, l2=0.01),
    }


def exact(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Integers (clocks, positions) equal, dtype and shape included."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: {got.tolist()[:20]} != {want.tolist()[:20]}"


# A table's tolerances: {"rows": atol, "why": reason, "state": [[name, start, stop, atol]]}
# (atol None: exactly, for Adam's integer step counts). None: bit for bit.
Tolerances = dict[str, object] | None


def _sgd_rows_tol(ref: RecordingStore, table: str, ids: torch.Tensor) -> float:
    """Plain SGD's rows ``ids`` after ``ref``'s pushes, two float32 evaluations: row ``r``
    is ``w0_r - lr * sum_i g_i`` over its gradient rows, evaluated as one sum per push
    (``k - 1`` additions of its ``k`` rows), a product and an addition to the row: at
    most ``2 * count_r`` roundings of terms whose absolute values add up to
    ``|w0_r| + lr * sum_i |g_i|`` (an eviction restarts the row from ``w0_r``, leaving a
    part of that sum)."""
    spec = ref.spec(table)
    pushes = ref.pushes[table]
    pushed = [i for i, _ in pushes]
    key, inverse = torch.unique(torch.cat([ids, *pushed]), return_inverse=True)
    mag = spec.initial_rows(key).double().abs()  # [K, D]
    count = torch.zeros(key.numel(), dtype=torch.int64)
    at = ids.numel()
    for i, g in pushes:
        where = inverse[at : at + i.numel()]
        at += i.numel()
        mag.index_add_(0, where, spec.optimizer.lr * g.double().abs())
        count.index_add_(0, where, torch.ones_like(where))
    mine = inverse[: ids.numel()]
    if mine.numel() == 0:
        return 0.0
    terms = int(count[mine].max())
    return sum_tol(torch.float32, max(2 * terms, 1), float(mag[mine].max()))


def tolerances(ref: RecordingStore, table: str, ids: torch.Tensor | None = None) -> Tolerances:
    """The tolerances of another store's rows ``ids`` (default: every row ``ref``'s
    pushes reached, or every row of a fixed table) and state against ``ref``'s after
    the same pushes. Plain SGD (the only optimizer here whose tables evict, which a
    replay does not model): the closed-form bound of :func:`_sgd_rows_tol`. The others:
    the float64 replay of the pushes (``ps_reference.Replay``), per state block."""
    spec = ref.spec(table)
    if ids is None:
        if spec.num_rows is not None:
            ids = torch.arange(spec.num_rows)
        else:
            pushed = [i for i, _ in ref.pushes[table]]
            ids = torch.cat(pushed).unique() if pushed else torch.zeros(0, dtype=torch.int64)
    opt = spec.optimizer
    if isinstance(opt, ps.SGD) and opt.momentum == 0:
        return {"rows": _sgd_rows_tol(ref, table, ids), "why": SGD_SUM, "state": []}
    replay, index = ref.replay(table, ids)
    state = []
    for name, cols in state_blocks(opt, spec.dim):
        start, stop, _ = cols.indices(opt.state_dim(spec.dim))
        if name == "steps":
            state.append([name, start, stop, None])
            continue
        s32, s64 = replay.state32[index][:, cols], replay.state64[index][:, cols]
        state.append([name, start, stop, replay_tol(s32, s64, floor_terms=replay.floor_terms)])
    return {"rows": replay.rows_tol(index), "why": REPLAY, "state": state}


def close_rows(what: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerances) -> None:
    """Rows (or any float32 values of a table) ``got`` against ``want`` within ``tol``."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if tol is None:
        assert_same(got, want, what=what, why=EXACT_COPY)
    else:
        assert_close(got, want, atol=float(tol["rows"]), what=what, why=str(tol["why"]))


def same_table(
    what: str, store: ps.Store, ref: ps.Store, table: str, ids: torch.Tensor, tol: Tolerances
) -> None:
    """Rows and optimizer state of ``ids`` agree between ``store`` and ``ref`` within
    ``tol`` (see :func:`tolerances`); clocks exactly."""
    a, b = store.pull(table, ids), ref.pull(table, ids)
    close_rows(f"{what}: rows", a.rows, b.rows, tol)
    exact(f"{what}: clocks", a.clocks, b.clocks)
    exact(f"{what}: clocks()", store.clocks(table, ids), ref.clocks(table, ids))
    got, want = store.state(table, ids), ref.state(table, ids)
    assert got.shape == want.shape, f"{what}: state {tuple(got.shape)} != {tuple(want.shape)}"
    if tol is None:
        assert_same(got, want, what=f"{what}: state", why=EXACT_COPY)
        return
    for name, start, stop, atol in tol["state"]:  # type: ignore[union-attr]
        g, w = got[:, start:stop], want[:, start:stop]
        if atol is None:
            assert_same(g, w, what=f"{what}: {name}", why="integer step counts, exact in float32")
        else:
            assert_close(g, w, atol=float(atol), what=f"{what}: {name}", why=str(tol["why"]))


def expect_error(what: str, exc: type[Exception], fn: Callable[[], object], *needles: str) -> None:
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"{what}: message lacks {missing}: {e}"
    else:
        raise AssertionError(f"{what}: no {exc.__name__} raised")


# ---------------------------------------------------------------- concurrency

EXACT_CONC = "SGD lr 1/2 from 0 on multiples of 1/8: every sum exact in float32, in any order"


def concurrency_pushes(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``rank``'s 50 pushes of 200 rows (10 000 gradient rows), multiples of 1/8."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(50):
        ids = torch.randint(0, NUM_ROWS, (200,), generator=g)
        grads = torch.randint(-8, 9, (200, DIM), generator=g).to(torch.float32) / 8
        out.append((ids, grads))
    return out


def concurrency(store: MPIStore, workers: comm.ProcessGroup, out: Path | None) -> None:
    """All workers push at once (4 in flight each); no update may be lost.

    SGD with lr 0.5 on gradients that are multiples of 1/8: every partial sum is
    exactly representable, so the result is exact in any order. The table is
    first zeroed by one push of ``2 * rows`` (exact too), so it starts from 0.
    """
    lr, everything = 0.5, torch.arange(NUM_ROWS)
    if workers.rank == 0:
        spec = ps.TableSpec(name="conc", num_rows=NUM_ROWS, dim=DIM, optimizer=ps.SGD(lr=lr))
        store.create_table(spec)
        store.push("conc", everything, 2 * store.pull("conc", everything).rows)
        assert float(store.pull("conc", everything).rows.abs().max()) == 0.0
    workers.barrier()
    inflight: deque[comm.Handle] = deque()
    for ids, grads in concurrency_pushes(workers.rank):
        if len(inflight) == 4:
            inflight.popleft().wait()
        inflight.append(store.push_async("conc", ids, grads))
    while inflight:
        inflight.popleft().wait()
    workers.barrier()
    if workers.rank != 0:
        return
    total = np.zeros((NUM_ROWS, DIM), dtype=np.float64)
    clocks = np.ones(NUM_ROWS, dtype=np.int64)  # the zeroing push
    for r in range(workers.size):
        for ids, grads in concurrency_pushes(r):
            np.add.at(total, ids.numpy(), grads.numpy().astype(np.float64))
            clocks[np.unique(ids.numpy())] += 1
    want_rows = torch.from_numpy((-lr * total).astype(np.float32))
    got = store.pull("conc", everything)
    assert_same(got.rows, want_rows, what="concurrency: rows (lost updates?)", why=EXACT_CONC)
    assert torch.equal(got.clocks, torch.from_numpy(clocks)), "concurrency: clocks differ"
    pushed = store.stats()["conc"]["rows_pushed"]
    assert pushed == int(clocks.sum()), f"concurrency: stats rows_pushed {pushed} != {clocks.sum()}"
    if out is not None:
        np.save(out / "conc_rows.npy", want_rows.numpy(), allow_pickle=False)
        np.save(out / "conc_clocks.npy", clocks, allow_pickle=False)


# ---------------------------------------------------------------- optimizers


def push_sequence(
    seed: int, dynamic: bool, steps: int = 12
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pushes with repeated ids; dynamic tables get negative and huge ids too."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if dynamic:
            pool = torch.tensor([-(2**62), -7, -1, 0, 5, 2**40, 2**62 + 3, 123456789])
            ids = torch.cat(
                [
                    pool[torch.randint(0, 8, (10,), generator=g)],
                    torch.randint(-50, 50, (30,), generator=g),
                ]
            )
        else:
            ids = torch.randint(0, NUM_ROWS // 10, (40,), generator=g)
        out.append((ids, torch.randn(ids.numel(), DIM, generator=g)))
    return out


def equivalence(store: MPIStore, ref: RecordingStore, spec: ps.TableSpec, seed: int) -> None:
    """The same pushes on both stores give the same rows, state, clocks; conditional pulls too."""
    store.create_table(spec)
    ref.create_table(spec)
    name = spec.name
    pushes = push_sequence(seed, spec.num_rows is None)
    probe = torch.unique(torch.cat([ids for ids, _ in pushes]))
    if spec.num_rows is not None:
        probe = torch.arange(NUM_ROWS // 10 + 5)
    else:
        probe = torch.cat([probe, torch.tensor([999_999, -999_999])])  # never pushed
    same_table(f"{name} before", store, ref, name, probe, tolerances(ref, name, probe))
    old = ref.clocks(name, probe)
    handles = []
    for step, (ids, grads) in enumerate(pushes):
        handles.append(store.push_async(name, ids, grads))  # several in flight
        ref.push(name, ids, grads)
        if step % 4 == 3:
            for h in handles:
                assert h.wait() is None
            handles = []
            tol = tolerances(ref, name, probe)
            same_table(f"{name} step {step}", store, ref, name, probe, tol)
    for h in handles:
        h.wait()
    same_table(f"{name} end", store, ref, name, probe, tolerances(ref, name, probe))
    for bound in (0, 1, 3):
        a = store.pull(name, probe, clocks=old, bound=bound)
        b = ref.pull(name, probe, clocks=old, bound=bound)
        assert a.positions is not None and b.positions is not None
        what = f"{name} conditional bound {bound}"
        exact(f"{what}: positions", a.positions, b.positions)
        tol = tolerances(ref, name, probe[b.positions])
        close_rows(f"{what}: rows", a.rows, b.rows, tol)
        exact(f"{what}: clocks", a.clocks, b.clocks)
        past = (ref.clocks(name, probe) > old + bound).nonzero().squeeze(1)
        exact(f"{what}: the rows past the bound", a.positions, past)
    # Every id goes to exactly one server, so the summed row counters must agree.
    sa, sb = store.stats()[name], ref.stats()[name]
    for key in ("rows", "rows_pushed", "rows_pulled", "rows_skipped_by_bound", "rows_evicted"):
        assert sa[key] == sb[key], f"{name}: stats {key} {sa[key]} != {sb[key]}"


def optimizer_checks(store: MPIStore, ref: RecordingStore, mine: Callable[[int], bool]) -> int:
    """Every optimizer on a fixed and a dynamic table; ``mine(k)`` picks this worker's share."""
    done = 0
    for k, (name, opt) in enumerate(optimizers().items()):
        for dynamic in (False, True):
            if not mine(2 * k + int(dynamic)):
                continue
            spec = ps.TableSpec(
                name=f"{name}_{'dyn' if dynamic else 'fixed'}",
                num_rows=None if dynamic else NUM_ROWS,
                dim=DIM,
                optimizer=opt,
            )
            equivalence(store, ref, spec, seed=17 * k + int(dynamic))
            done += 1
    return done


def eviction_checks(store: MPIStore, ref: RecordingStore, num_servers: int) -> None:
    """max_age_steps evicts exactly like the in-process store; capacity bounds each shard."""
    spec = ps.TableSpec(
        name="aged", num_rows=None, dim=DIM, optimizer=ps.SGD(lr=0.1), max_age_steps=3
    )
    equivalence(store, ref, spec, seed=5)
    a, b = store.stats()["aged"], ref.stats()["aged"]
    assert a["rows"] == b["rows"] and a["rows_evicted"] == b["rows_evicted"] > 0, (a, b)
    cap = 10
    spec = ps.TableSpec(
        name="capped", num_rows=None, dim=DIM, optimizer=ps.SGD(lr=0.1), capacity=cap
    )
    store.create_table(spec)
    for ids, grads in push_sequence(6, True):
        store.push("capped", ids, grads)
    st = store.stats()["capped"]
    per_shard = -(-cap // num_servers)
    assert 0 < st["rows"] <= per_shard * num_servers and st["rows_evicted"] > 0, st


def nan_skip_checks(store: MPIStore, ref: RecordingStore) -> None:
    spec = ps.TableSpec(
        name="skipnan", num_rows=100, dim=DIM, optimizer=ps.SGD(lr=0.1), nan_policy="skip"
    )
    store.create_table(spec)
    ref.create_table(spec)
    ids = torch.tensor([1, 2, 3, 50, 2])
    grads = torch.ones(5, DIM)
    grads[1, 3] = float("nan")
    grads[3, 0] = float("inf")
    store.push("skipnan", ids, grads)
    ref.push("skipnan", ids, grads)
    every = torch.arange(100)
    same_table("nan skip", store, ref, "skipnan", every, tolerances(ref, "skipnan", every))
    a, b = store.stats()["skipnan"], ref.stats()["skipnan"]
    assert a["rows_skipped_nan"] == b["rows_skipped_nan"] == 2, (a, b)


# ---------------------------------------------------------------- bad input


def bad_input_checks(store: MPIStore, ref: RecordingStore) -> int:
    """Each bad request raises with the table and value named and changes nothing."""
    spec = ps.TableSpec(name="guarded", num_rows=100, dim=DIM, optimizer=ps.Adam(lr=0.1))
    store.create_table(spec)
    ref.create_table(spec)
    every = torch.arange(100)
    ids, ok = torch.tensor([1, 2, 99]), torch.ones(3, DIM)
    store.push("guarded", ids, ok)
    ref.push("guarded", ids, ok)
    tol = tolerances(ref, "guarded", every)  # what the good push leaves; nothing else may
    nan = torch.ones(3, DIM)
    nan[2, 1] = float("nan")
    cases: list[tuple[str, type[Exception], Callable[[], object], tuple[str, ...]]] = [
        ("unknown table", ValueError, lambda: store.pull("nope", ids), ("'nope'",)),
        ("unknown table push", ValueError, lambda: store.push("nope", ids, ok), ("'nope'",)),
        (
            "id too big",
            ValueError,
            lambda: store.pull("guarded", torch.tensor([0, 100])),
            ("'guarded'", "100"),
        ),
        (
            "negative id",
            ValueError,
            lambda: store.push("guarded", torch.tensor([-3, 1, 2]), ok),
            ("'guarded'", "-3"),
        ),
        ("int32 ids", TypeError, lambda: store.pull("guarded", ids.int()), ("'guarded'", "int32")),
        (
            "2-D ids",
            ValueError,
            lambda: store.pull("guarded", ids.view(3, 1)),
            ("'guarded'", "(3, 1)"),
        ),
        (
            "grads shape",
            ValueError,
            lambda: store.push("guarded", ids, torch.ones(3, DIM + 1)),
            ("'guarded'", "(3, 9)"),
        ),
        (
            "grads dtype",
            TypeError,
            lambda: store.push("guarded", ids, ok.double()),
            ("'guarded'", "float64"),
        ),
        ("nan grads", ValueError, lambda: store.push("guarded", ids, nan), ("'guarded'", "99")),
        (
            "clocks without bound",
            ValueError,
            lambda: store.pull("guarded", ids, clocks=torch.zeros(3, dtype=torch.int64)),
            ("'guarded'",),
        ),
        (
            "negative bound",
            ValueError,
            lambda: store.pull("guarded", ids, clocks=torch.zeros(3, dtype=torch.int64), bound=-1),
            ("'guarded'", "-1"),
        ),
        ("create twice", ValueError, lambda: store.create_table(spec), ("'guarded'", "exists")),
    ]
    for what, exc, fn, needles in cases:
        expect_error(what, exc, fn, *needles)
        same_table(f"after {what}", store, ref, "guarded", every, tol)
    # Requests only a server can refuse: made by hand, bypassing the worker's checks.
    index = store._table("guarded").index  # private: a test of the wire protocol
    home = int(torch.nonzero(ps.shard_of(every, len(index)) == 0)[0, 0])  # an id of server 0
    raw_cases = [
        (
            "bad table index",
            wire.Op.PULL,
            dict(table=77, n=1),
            (np.array([1]),),
            None,
            ("table index 77",),
        ),
        (
            "id out of range at the server",
            wire.Op.PULL,
            dict(table=index[0], n=1, dim=DIM),
            (np.array([100]),),
            None,
            ("'guarded'", "100"),
        ),
        (
            "sizes disagree",
            wire.Op.PUSH,
            dict(table=index[0], n=2, dim=DIM),
            (np.array([1, 2]),),
            np.ones(DIM, np.float32),
            ("sizes",),
        ),
        (
            "nan at the server",
            wire.Op.PUSH,
            dict(table=index[0], n=1, dim=DIM),
            (np.array([home]),),
            np.full(DIM, np.nan, np.float32),
            ("'guarded'", "NaN"),
        ),
        (
            "stale width",
            wire.Op.PULL,
            dict(table=index[0], n=1, dim=DIM + 1),
            (np.array([home]),),
            None,
            ("'guarded'", "width 9"),
        ),
        ("unknown op", 99, dict(), (), None, ("unknown request op 99",)),
        (
            "batch with a bad second part",  # the first part's rows must not change
            wire.Op.PUSH_MANY,
            dict(table=2, n=2),
            (np.array([[index[0], 1, DIM], [index[0], 1, DIM + 1]]), np.array([home, home])),
            np.ones(2 * DIM + 1, np.float32),
            ("'guarded'", "width 9"),
        ),
        (
            "batch of no tables",
            wire.Op.PULL_MANY,
            dict(table=0, n=0),
            (),
            None,
            ("0 tables",),
        ),
        (
            "batch toc larger than the message",
            wire.Op.PULL_MANY,
            dict(table=3, n=1),
            (np.array([index[0], 1, DIM, -1]),),
            None,
            ("table of contents",),
        ),
        (
            "batch sizes disagree",
            wire.Op.PULL_MANY,
            dict(table=1, n=2),
            (np.array([index[0], 2, DIM, -1]), np.array([home])),
            None,
            ("sizes",),
        ),
    ]
    if len(index) > 1:  # an id of shard 1 sent to server 0
        other = int(torch.nonzero(ps.shard_of(every, len(index)) == 1)[0, 0])
        raw_cases.append(
            (
                "id on the wrong server",
                wire.Op.PUSH,
                dict(table=index[0], n=1, dim=DIM),
                (np.array([other]),),
                np.ones(DIM, np.float32),
                ("'guarded'", f"id {other}", "shard 1"),
            )
        )
    for what, op, head, payload, data, needles in raw_cases:
        kw: dict[str, object] = dict(payload=payload, **head)
        if data is not None:
            kw["data"] = data

        def send(op: int = op, kw: dict[str, object] = kw, what: str = what) -> None:
            call = store._start(0, op, **kw)  # type: ignore[arg-type]
            store._handle([call], lambda: None, what).wait()

        expect_error(what, ValueError, send, *needles)
        same_table(f"after {what}", store, ref, "guarded", every, tol)
    return len(cases) + len(raw_cases)


# ---------------------------------------------------------------- checkpoints


def all_ids(ckpt_dir: Path, table: str, spec: ps.TableSpec) -> torch.Tensor:
    """Ids to compare: every row of a fixed table; a dynamic table's saved ids plus two absent."""
    if spec.num_rows is not None:
        return torch.arange(spec.num_rows)
    saved = ps.checkpoint.read_checkpoint(ckpt_dir).read_table(table).ids
    return torch.cat([saved, torch.tensor([31337, -31337])])


def tolerance_file(ref_dir: Path) -> Path:
    """Where the tolerances of the reference checkpoint ``ref_dir`` are saved."""
    return ref_dir.parent / (ref_dir.name.replace("ref-", "tol-", 1) + ".json")


def compare_with_refs(what: str, store: ps.Store, refs: list[Path], copies: bool = False) -> int:
    """``store``'s tables against the reference checkpoints ``refs``: within the tolerances
    saved with each (the MPI store's run of the same pushes), or bit for bit where
    ``copies`` (``store`` loaded those very checkpoints)."""
    n = 0
    for path in refs:
        ref = ps.InProcessStore()
        ref.load(path)
        saved = json.loads(tolerance_file(path).read_text())
        for table in ref.tables():
            spec = ref.spec(table)
            assert store.spec(table) == spec, f"{what}: spec of {table!r} differs"
            tol = None if copies else saved[table]
            same_table(f"{what} {table}", store, ref, table, all_ids(path, table, spec), tol)
            if spec.num_rows is None:
                a, b = store.stats()[table]["rows"], ref.stats()[table]["rows"]
                assert a == b, f"{what} {table}: {a} rows, reference has {b}"
            n += 1
    return n


def compare_conc(what: str, store: ps.Store, folder: Path) -> None:
    got = store.pull("conc", torch.arange(NUM_ROWS))
    want = torch.from_numpy(np.load(folder / "conc_rows.npy"))
    assert_same(got.rows, want, what=f"{what}: conc rows", why=EXACT_CONC)
    assert torch.equal(got.clocks, torch.from_numpy(np.load(folder / "conc_clocks.npy"))), what


def whole_batch_checks(store: MPIStore, prefix: str, num_servers: int, alone: bool) -> None:
    """:func:`tests.support.ps_batched.check_whole_batches` on this worker's own tables; when it
    is the only worker talking (``alone``) with a save and load too, and every batched
    request must have been served whole in C (``ps.mpi.batched_pass``) by every server."""

    def whole() -> float:
        return sum(s.get("batched_pass_messages", 0.0) for s in store.server_busy())

    before = whole()
    with tempfile.TemporaryDirectory() as tmp:
        sent = check_whole_batches(store, prefix, str(Path(tmp) / "ckpt") if alone else None)
    if alone:  # 60 random ids or 30 consecutive ones per table reach every server
        served = whole() - before
        assert served == sent * num_servers, (served, sent, num_servers)


# ---------------------------------------------------------------- phases


def phase_main(store: MPIStore, workers: comm.ProcessGroup, folder: Path, num_servers: int) -> str:
    n = check_lifecycle(store, workers.rank, workers.size, workers.barrier, "race")
    concurrency(store, workers, folder)
    ref = RecordingStore()  # remembers its pushes, for the tolerances
    n += optimizer_checks(store, ref, lambda k: k % workers.size == workers.rank)
    if workers.rank == workers.size - 1:
        eviction_checks(store, ref, num_servers)
        nan_skip_checks(store, ref)
    if workers.rank == 1 % workers.size:
        n += bad_input_checks(store, ref)
    whole_batch_checks(store, f"whole{workers.rank}_", num_servers, alone=False)
    n += check_counted_pushes(store, f"counted{workers.rank}_")
    workers.barrier()  # the others are idle: request counts are this worker's alone
    if workers.rank == 0:
        check_batched(store, "batch_", servers=num_servers)
        whole_batch_checks(store, "whole_", num_servers, alone=True)
        n += 3
    workers.barrier()
    ref.save(folder / f"ref-{workers.rank}")
    tols = {table: tolerances(ref, table) for table in ref.tables()}
    tolerance_file(folder / f"ref-{workers.rank}").write_text(json.dumps(tols))
    workers.barrier()  # nobody pushes from here on
    if workers.rank == 0:
        store.save(folder / "mpi2")
        names = sorted(store.tables())
        assert names == sorted(ps.checkpoint.read_checkpoint(folder / "mpi2").tables()), names
        (folder / "tables.json").write_text(json.dumps(names))
    workers.barrier()
    return f"{n} checks"


def phase_reload(store: MPIStore, folder: Path) -> str:
    refs = sorted(folder.glob("ref-*"))
    assert len(refs) == 4, refs
    store.load(folder / "mpi2")  # 2 servers -> 3 servers
    assert sorted(store.tables()) == json.loads((folder / "tables.json").read_text())
    n = compare_with_refs("mpi2 into 3 servers", store, refs)
    compare_conc("mpi2 into 3 servers", store, folder)
    local = ps.InProcessStore()
    local.load(folder / "mpi2")  # 2 servers -> in-process
    n += compare_with_refs("mpi2 into in-process", local, refs)
    compare_conc("mpi2 into in-process", local, folder)
    store.save(folder / "mpi3")
    again = ps.InProcessStore()
    again.load(folder / "mpi3")  # 3 servers -> in-process
    n += compare_with_refs("mpi3 into in-process", again, refs)
    compare_conc("mpi3 into in-process", again, folder)
    whole_batch_checks(store, "whole_", 3, alone=False)  # its own tables, no save: refs above
    store.push("conc", torch.arange(5), torch.ones(5, DIM))  # changed, then replaced by a load
    store.load(refs[0])  # in-process -> 3 servers (replaces the tables it names)
    n += compare_with_refs("in-process into 3 servers", store, refs[:1], copies=True)
    expect_error(
        "load missing", FileNotFoundError, lambda: store.load(folder / "missing"), "missing"
    )
    return f"{n} table comparisons"


def phase_single(store: MPIStore) -> str:
    n = check_lifecycle(store, 0, 1, lambda: None, "race")
    ref = RecordingStore()  # remembers its pushes, for the tolerances
    n += optimizer_checks(store, ref, lambda k: True)
    eviction_checks(store, ref, 1)
    nan_skip_checks(store, ref)
    n += bad_input_checks(store, ref)
    check_batched(store, "batch_", servers=1)
    whole_batch_checks(store, "whole_", 1, alone=True)
    n += check_counted_pushes(store, "counted_")
    # A worker of an older protocol asking this server: a clear error naming both.
    new = wire.PROTOCOL, wire.MAGIC_VERSION
    old = new[0] - 1
    wire.PROTOCOL, wire.MAGIC_VERSION = old, (wire.MAGIC << 16) | old
    try:
        expect_error(
            "old protocol", ValueError, store.tables, f"protocol {new[0]}", f"protocol {old}"
        )
    finally:
        wire.PROTOCOL, wire.MAGIC_VERSION = new
    assert store.tables(), "the server serves on after a request of another version"
    return f"{n + 3} checks"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--phase", choices=("main", "reload", "single"), required=True)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=args.servers)
    mates = topology.role_group(group)  # collective: the workers' (or servers') sub-group
    if topology.role(group.rank) is comm.Role.SERVER:
        stats = serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server tables={len(stats)}", flush=True)
        return
    with MPIStore(group, topology, request_timeout_s=60.0) as store:
        if args.phase == "main":
            summary = phase_main(store, mates, args.dir, args.servers)
        elif args.phase == "reload":
            summary = phase_reload(store, args.dir)
        else:
            summary = phase_single(store)
    print(f"rank {group.rank}: ok worker {summary}", flush=True)


if __name__ == "__main__":
    main()
