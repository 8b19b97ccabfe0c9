"""The MPI server's C pass over whole batched messages, against the table engine.

:class:`ps.mpi.batched_pass.BatchedPass` serves a ``PULL_MANY`` / ``PUSH_MANY`` of
fixed tables in C; the reference is the same tables served part by part by the
engine the Python path calls (``LocalTable`` / ``FixedShard`` ``pull`` and ``push``).
Both run the same row step on the same layout (the row-wise Adagrad of
``rowwise_adagrad.c``) and gathers are copies, so rows, state, clocks, positions and
counters must be bit-exact. No MPI here: the messages are built with ``ps.mpi.wire``
as a worker builds them; the MPI jobs in ``test_ps_mpi.py`` run the pass in a server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import ps
from ps.kernels import message_pass
from ps.local.table import LocalTable
from ps.mpi import wire
from ps.mpi.batched_pass import BatchedPass, Shard
from ps.mpi.fixed_shard import FixedShard
from ps.routing import shard_of
from tolerance import assert_same

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.numerics,
    pytest.mark.skipif(not message_pass.available(), reason="needs a C compiler"),
]


_DIMS = [4, 16, 33]  # of the three tables
SAME = "gathers copy rows; both sides run the same C row step on the same layout"


def _spec(name: str, rows: int, dim: int, opt: ps.Optimizer | None = None) -> ps.TableSpec:
    """A fixed table of ``rows`` rows (0: a dynamic table), row-wise Adagrad by default."""
    return ps.TableSpec(
        name=name, num_rows=rows or None, dim=dim, optimizer=opt or ps.RowWiseAdagrad(lr=0.05)
    )


@dataclass
class Tables:
    """The same tables twice: ``mine`` served by the pass, ``ref`` by the engine."""

    mine: list[Shard | None]
    ref: list[Shard | None]
    ids: list[torch.Tensor]  # per table, the ids that route to this server

    def pass_over_mine(self, threads: int = 1) -> BatchedPass:
        p = BatchedPass(threads=threads)
        p.rebuild(self.mine)
        return p


def _tables(shards: int = 1, shard: int = 0) -> Tables:
    """Three fixed tables (dims 4, 16, 33) as one server of ``shards`` holds them, twice
    (their initial rows are hashed from the ids, so both copies start equal)."""

    def build() -> list[Shard | None]:
        out: list[Shard | None] = []
        for i, (rows, dim) in enumerate(zip([300, 500, 200], _DIMS, strict=True)):
            spec = _spec(f"t{i}", rows, dim)
            out.append(FixedShard(spec, shard, shards) if shards > 1 else LocalTable(spec))
        return out

    ids = []
    for rows in [300, 500, 200]:
        every = torch.arange(rows)
        ids.append(every[shard_of(every, shards) == shard] if shards > 1 else every)
    return Tables(build(), build(), ids)


def _pick(gen: torch.Generator, ids: torch.Tensor, n: int, *, unique: bool) -> torch.Tensor:
    if unique:
        return ids[torch.randperm(ids.numel(), generator=gen)[:n]].sort().values
    return ids[torch.randint(0, ids.numel(), (n,), generator=gen)]


def _pull_request(
    parts: list[tuple[int, torch.Tensor, torch.Tensor | None, int]], dims: list[int] = _DIMS
) -> np.ndarray:
    """A PULL_MANY payload: toc [k, 4], then each part's ids (and caller clocks);
    ``dims``: the tables' widths by index."""
    toc = [
        [i, ids.numel(), dims[i], -1 if clocks is None else bound]
        for i, ids, clocks, bound in parts
    ]
    words = [np.asarray(toc, dtype=np.int64).reshape(-1)]
    for _, ids, clocks, _bound in parts:
        words.append(ids.numpy())
        if clocks is not None:
            words.append(clocks.numpy())
    return np.concatenate(words)


def _push_request(
    parts: list[tuple[int, torch.Tensor, torch.Tensor]], session: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A PUSH_MANY payload (toc [k, 3], all ids, the session word) and its gradients."""
    toc = np.asarray([[i, ids.numel(), g.shape[1]] for i, ids, g in parts], dtype=np.int64)
    words = [toc.reshape(-1)] + [ids.numpy() for _, ids, _ in parts]
    if session is not None:
        words.append(np.asarray([session], dtype=np.int64))
    grads = np.concatenate([g.numpy().reshape(-1) for _, _, g in parts]).astype(np.float32)
    return np.concatenate(words), grads


def _split_pull_reply(
    meta: np.ndarray, rows: np.ndarray, tables: list[int]
) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """A PULL_MANY reply cut into (clocks, positions, rows) per part, as a worker does."""
    k = len(tables)
    body = meta[wire.HEADER_LEN :]
    toc = body[: 2 * k].reshape(k, 2)
    at, fat, out = 2 * k, 0, []
    for p, (m, flags) in enumerate(toc.tolist()):
        clk = body[at : at + m]
        at += m
        pos = None
        if flags & wire.FLAG_POSITIONS:
            pos = body[at : at + m]
            at += m
        d = _DIMS[tables[p]]
        out.append((clk, pos, rows[fat : fat + m * d].reshape(m, d)))
        fat += m * d
    assert at == body.size and fat == rows.size, "the reply carries exactly its parts"
    return out


def _same_tables(t: Tables) -> None:
    for a, b in zip(t.mine, t.ref, strict=True):
        assert a is not None and b is not None
        ea = a.table if isinstance(a, FixedShard) else a
        eb = b.table if isinstance(b, FixedShard) else b
        assert_same(ea.weights, eb.weights, what=f"{a.spec.name} rows", why=SAME)
        assert_same(ea.state, eb.state, what=f"{a.spec.name} state", why=SAME)
        assert torch.equal(ea.clocks, eb.clocks), a.spec.name


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("shards", "shard"), [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_pull_and_push_messages_equal_the_engine_part_by_part(
    shards: int, shard: int, threads: int
) -> None:
    """Plain and conditional pulls, pushes of sorted distinct ids: bit for bit what the
    engine gives, the counters included, on one thread or with the parts of different
    tables on two at once (a message naming a table twice runs its parts in order)."""
    t = _tables(shards, shard)
    batched = t.pass_over_mine(threads)
    gen = torch.Generator().manual_seed(shards * 10 + shard)
    for step in range(6):
        # pulls: tables out of order, on odd steps one twice; conditional parts with
        # bounds 0 and 1
        parts: list[tuple[int, torch.Tensor, torch.Tensor | None, int]] = []
        for index in [2, 0, 1, 0] if step % 2 else [2, 0, 1]:
            ids = _pick(gen, t.ids[index], 40, unique=False)
            if (step + index) % 2:
                behind = torch.randint(0, 3, (ids.numel(),), generator=gen)
                clocks = _ref(t, index).read_clocks(ids) - behind
                parts.append((index, ids, clocks, step % 2))
            else:
                parts.append((index, ids, None, -1))
        got = batched.pull_many(len(parts), 9, _pull_request(parts))
        assert got is not None, "the pass serves a pull of fixed tables"
        meta, rows = got
        assert meta[wire.W_OP] == wire.Op.PULL_MANY and meta[wire.W_ID] == 9
        assert meta[wire.W_N] == len(parts)
        for (index, ids, clocks, bound), (clk, pos, r) in zip(
            parts, _split_pull_reply(meta, rows, [p[0] for p in parts]), strict=True
        ):
            want = _ref(t, index).pull(ids, clocks, None if clocks is None else bound)
            assert np.array_equal(clk, want.clocks.numpy())
            assert (pos is None) == (want.positions is None)
            if pos is not None and want.positions is not None:
                assert np.array_equal(pos, want.positions.numpy())
            assert_same(torch.from_numpy(r.copy()), want.rows, what=f"step {step} rows", why=SAME)
        # pushes: distinct sorted ids, every table once
        pushes = []
        for i in range(3):
            ids = _pick(gen, t.ids[i], 30, unique=True)
            pushes.append((i, ids, torch.randn(ids.numel(), _DIMS[i], generator=gen)))
        payload, grads = _push_request(pushes, session=5)
        whole = batched.checked_push(3, payload, grads, sequenced=True)
        assert whole is not None
        batched.push(whole)
        for i, ids, g in pushes:
            _ref(t, i).push(ids, g, checked=True)
        _same_tables(t)
    batched.fold()
    assert _counts(t.mine) == _counts(t.ref)
    assert batched.served == 12


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("shards", "shard"), [(1, 0), (2, 1)])
def test_pulls_with_state_carry_each_rows_state_after_it(
    shards: int, shard: int, threads: int
) -> None:
    """A ``PULL_MANY`` with ``FLAG_STATE`` (a cache stepping its copies by the table's
    optimizer): each returned row ``[dim + state_dim]`` is the engine's row, then its
    state as ``read_state`` gives it, for plain and conditional parts."""
    t = _tables(shards, shard)
    gen = torch.Generator().manual_seed(7)
    for i in range(3):  # some history, so the accumulators differ between rows
        ids = _pick(gen, t.ids[i], 20, unique=True)
        g = torch.randn(ids.numel(), _DIMS[i], generator=gen)
        for side in (t.mine, t.ref):
            engine = side[i]
            assert engine is not None
            engine.push(ids, g, checked=True)
    batched = t.pass_over_mine(threads)
    parts: list[tuple[int, torch.Tensor, torch.Tensor | None, int]] = []
    for index in (1, 0, 2):
        ids = _pick(gen, t.ids[index], 25, unique=False)
        if index == 0:  # conditional: rows more than 0 behind come back
            behind = torch.randint(0, 2, (ids.numel(),), generator=gen)
            parts.append((index, ids, _ref(t, index).read_clocks(ids) - behind, 0))
        else:
            parts.append((index, ids, None, -1))
    got = batched.pull_many(len(parts), 3, _pull_request(parts), with_state=True)
    assert got is not None
    meta, rows = got
    state_dim = 1  # row-wise Adagrad's accumulator
    wide = [d + state_dim for d in _DIMS]
    body = meta[wire.HEADER_LEN :]
    at, fat = 2 * len(parts), 0
    for p, (index, ids, clocks, bound) in enumerate(parts):
        m, flags = body[2 * p : 2 * p + 2].tolist()
        want = _ref(t, index).pull(ids, clocks, None if clocks is None else bound)
        at += m * (2 if flags & wire.FLAG_POSITIONS else 1)
        back = ids if want.positions is None else ids[want.positions]
        mine = torch.from_numpy(rows[fat : fat + m * wide[index]].reshape(m, wide[index]).copy())
        assert_same(mine[:, : _DIMS[index]], want.rows, what="rows", why=SAME)
        assert_same(mine[:, _DIMS[index] :], _ref(t, index).read_state(back), what="state",
                    why="the state gathered, a copy")  # fmt: skip
        fat += m * wide[index]
    assert at == body.size and fat == rows.size


def _counted_push(
    parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[np.ndarray, np.ndarray, bool]:
    """A counted PUSH_MANY as a worker's cache sends it: the payload (toc, ids, the packed
    counts), the data (gradients, then one statistic per row) and whether the counts are
    wide. ``parts``: (index, ids, grads, counts, stats [n])."""
    payload, grads = _push_request([(i, ids, g) for i, ids, g, _, _ in parts])
    counts, wide = wire.pack_counts(torch.cat([c for *_, c, _ in parts]).numpy())
    stats = torch.cat([s for *_, s in parts]).numpy().astype(np.float32)
    return np.concatenate([payload, counts]), np.concatenate([grads, stats]), wide


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("shards", "shard", "most"), [(1, 0, 5), (2, 1, 5), (1, 0, 300)])
def test_counted_pushes_equal_the_engine_part_by_part(
    shards: int, shard: int, most: int, threads: int
) -> None:
    """A cache's counted PUSH_MANY (rows of one update and rows of several, counts in
    bytes or, above 255, in words) applied by the pass: bit for bit the engine's counted
    push of each part, counters included."""
    t = _tables(shards, shard)
    batched = t.pass_over_mine(threads)
    gen = torch.Generator().manual_seed(most + shard)
    for _ in range(3):
        parts = []
        for i in range(3):
            ids = _pick(gen, t.ids[i], 30, unique=True)
            g = torch.randn(ids.numel(), _DIMS[i], generator=gen)
            counts = torch.randint(1, most + 1, (ids.numel(),), generator=gen)
            counts[0] = 1  # a plain row in every part
            stats = g.square().mean(dim=1) * counts  # as if k equal updates
            parts.append((i, ids, g, counts, stats))
        payload, data, wide = _counted_push(parts)
        assert wide == (most > 255)
        how = {"counted": True, "wide": wide}
        whole = batched.checked_push(3, payload, data, sequenced=False, **how)
        assert whole is not None
        batched.push(whole)
        for i, ids, g, counts, stats in parts:
            _ref(t, i).push(ids, g, checked=True, counted=(counts, stats.unsqueeze(1)))
        _same_tables(t)
    batched.fold()
    assert _counts(t.mine) == _counts(t.ref)


def test_the_pass_declines_counted_pushes_the_checks_refuse() -> None:
    """Counts below 1, statistics negative or not finite, sizes that do not add up: left
    to the Python path (which names the problem), with nothing changed."""
    t = _tables()
    batched = t.pass_over_mine()
    ids, g = torch.tensor([1, 4, 9]), torch.ones(3, 4)
    before = _engine(t.mine[0]).weights.clone()

    def can(counts: list[int], stats: list[float], cut: int = 0) -> bool:
        part = (0, ids, g, torch.tensor(counts), torch.tensor(stats))
        payload, data, wide = _counted_push([part])
        whole = batched.checked_push(
            1, payload, data[: data.size - cut], sequenced=False, counted=True, wide=wide
        )
        return whole is not None

    assert can([1, 2, 3], [1.0, 2.0, 3.0])
    assert not can([0, 2, 3], [1.0, 2.0, 3.0])
    assert not can([1, 2, 3], [1.0, -2.0, 3.0])
    assert not can([1, 2, 3], [1.0, float("nan"), 3.0])
    assert not can([1, 2, 3], [1.0, float("inf"), 3.0])
    assert not can([1, 2, 3], [1.0, 2.0, 3.0], cut=1)  # a statistic short
    assert torch.equal(_engine(t.mine[0]).weights, before)


def _ref(t: Tables, index: int) -> Shard:
    shard = t.ref[index]
    assert shard is not None
    return shard


def _engine(shard: Shard | None) -> LocalTable:
    assert shard is not None
    return shard.table if isinstance(shard, FixedShard) else shard


def _counts(tables: list[Shard | None]) -> list[dict[str, int]]:
    return [dict(_engine(s).counters) for s in tables]


def test_the_pass_declines_what_only_the_python_path_serves() -> None:
    """Anything but fixed tables (and, for a push, row-wise Adagrad on sorted distinct
    ids with finite gradients) is left to the Python path, with nothing changed."""
    adagrad = LocalTable(_spec("t0", 300, 4))
    sgd = LocalTable(_spec("t1", 500, 16, ps.SGD(lr=0.1)))
    dynamic = LocalTable(_spec("t2", 0, 33))
    shard = FixedShard(_spec("t3", 200, 4), 0, 2)  # index 3: shard 0 of 2
    batched = BatchedPass(threads=1)
    # index 4: a dropped table (None); 5: never existed
    batched.rebuild([adagrad, sgd, dynamic, shard, None])
    dims = [4, 16, 33, 4, 4, 4]
    routes = shard_of(torch.arange(200), 2)
    mine = torch.arange(200)[routes == 0][:3]
    other = torch.arange(200)[routes == 1][:1]
    before = [t.weights.clone() for t in (adagrad, sgd, shard.table)]

    def pull(*parts: tuple[int, list[int]]) -> bool:
        req = [(i, torch.tensor(ids, dtype=torch.int64), None, -1) for i, ids in parts]
        return batched.pull_many(len(req), 1, _pull_request(req, dims)) is not None

    assert pull((0, [1, 2]), (1, [499]), (3, mine.tolist()))
    assert not pull((0, [1]), (2, [5]))  # a dynamic table
    assert not pull((4, [1]))  # a dropped table's index
    assert not pull((0, [300]))  # out of range
    assert not pull((0, [-1]))
    assert not pull((3, other.tolist()))  # another server's row
    payload = _pull_request([(0, torch.tensor([1, 2]), None, -1)])
    assert batched.pull_many(1, 1, payload[:-1]) is None  # a word short
    assert batched.pull_many(1, 1, np.append(payload, 7)) is None  # a word over
    assert batched.pull_many(2, 1, payload) is None  # fewer parts than it says
    wrong_dim = payload.copy()
    wrong_dim[2] = 8
    assert batched.pull_many(1, 1, wrong_dim) is None
    unknown = payload.copy()
    unknown[0] = 5
    assert batched.pull_many(1, 1, unknown) is None
    bad_bound = _pull_request([(0, torch.tensor([1]), torch.tensor([0]), 0)])
    bad_bound[3] = -2
    assert batched.pull_many(1, 1, bad_bound) is None

    def push(i: int, ids: list[int], grads: torch.Tensor | None = None) -> bool:
        t = torch.tensor(ids, dtype=torch.int64)
        g = torch.ones(t.numel(), dims[i]) if grads is None else grads
        payload, data = _push_request([(i, t, g)])
        return batched.checked_push(1, payload, data, sequenced=False) is not None

    assert push(0, [1, 5, 9]) and push(3, mine.tolist())
    assert not push(1, [1, 2])  # SGD
    assert not push(2, [1, 2])  # dynamic
    assert not push(0, [5, 1])  # unsorted
    assert not push(0, [1, 1])  # repeated
    assert not push(0, [300])
    assert not push(3, other.tolist())
    for bad in (float("nan"), float("inf"), float("-inf")):
        g = torch.ones(2, 4)
        g[1, 3] = bad
        assert not push(0, [1, 2], g)
    payload, data = _push_request([(0, torch.tensor([1, 2]), torch.ones(2, 4))])
    assert batched.checked_push(1, payload, data[:-1], sequenced=False) is None  # a float short
    assert batched.checked_push(1, payload[:-1], data, sequenced=False) is None  # an id short
    assert batched.checked_push(1, payload, data, sequenced=True) is None  # no session word
    for now, then in zip((adagrad, sgd, shard.table), before, strict=True):
        assert torch.equal(now.weights, then)  # checks change nothing
    assert batched.served == 1
