"""The C message passes over tables of fp16 / bf16 rows, against the table engine.

The passes (:class:`ps.mpi.batched_pass.BatchedPass` for an MPI server's messages,
:class:`ps.local.batched_pass.LocalBatchedPass` for the in-process store's batched
requests) serve narrow tables mixed with float32 ones in one request; the reference is
the same tables served part by part by the engine the Python path calls
(``LocalTable`` / ``FixedShard`` ``pull`` and ``push``, one table at a time). Both
widen the stored row, run the same C float32 row step (``adagrad_step`` of
``rowwise_adagrad.c``) and round with the same keys (seed, table id, clock after the
update, column) by ``narrow_rows.c``'s functions; gathers are copies. So rows (their
16-bit bits), state, clocks and counters must be bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ps
from ps import PullRequest, PushRequest
from ps.kernels import message_pass
from ps.local.batched_pass import LocalBatchedPass
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

SAME = "both sides widen, run the same C row step and round with the same keys"
# (rows, dim, dtype) of the tables: a float32 one between narrow ones; dim 5 makes
# parts of an odd count of 16-bit values (a padded last data word)
_TABLES = [(300, 5, "fp16"), (200, 16, "fp32"), (400, 16, "bf16"), (250, 33, "fp16")]


def _spec(i: int, dtype: str, opt: ps.Optimizer | None = None) -> ps.TableSpec:
    rows, dim, own = _TABLES[i]
    return ps.TableSpec(
        name=f"t{i}",
        num_rows=rows,
        dim=dim,
        optimizer=opt or ps.RowWiseAdagrad(lr=0.05),
        dtype=own if own == "fp32" else dtype,
    )


def _engine(s: Shard | None) -> LocalTable:
    assert s is not None
    return s.table if isinstance(s, FixedShard) else s


def _shard(s: Shard | None) -> Shard:
    assert s is not None
    return s


def _build(dtype: str, shards: int, shard: int) -> list[Shard | None]:
    out: list[Shard | None] = []
    for i in range(len(_TABLES)):
        spec = _spec(i, dtype)
        out.append(FixedShard(spec, shard, shards) if shards > 1 else LocalTable(spec))
    return out


def _routed(shards: int, shard: int) -> list[torch.Tensor]:
    every = [torch.arange(rows) for rows, _, _ in _TABLES]
    return [e[shard_of(e, shards) == shard] if shards > 1 else e for e in every]


def _pick(gen: torch.Generator, ids: torch.Tensor, n: int, *, unique: bool) -> torch.Tensor:
    if unique:
        return ids[torch.randperm(ids.numel(), generator=gen)[:n]].sort().values
    return ids[torch.randint(0, ids.numel(), (n,), generator=gen)]


def _same_tables(mine: list[Shard | None], ref: list[Shard | None]) -> None:
    for a, b in zip(mine, ref, strict=True):
        ea, eb = _engine(a), _engine(b)
        name = ea.spec.name
        bits = torch.int16 if ea.spec.narrow else torch.int32  # the stored bits
        assert torch.equal(ea.weights.view(bits), eb.weights.view(bits)), name
        assert_same(ea.state, eb.state, what=f"{name} state", why=SAME)
        assert torch.equal(ea.clocks, eb.clocks), name
        assert ea.counters == eb.counters, name


def _wire_grads(spec: ps.TableSpec, g: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A worker's gradients in the table's type: (the float32 values the server widens
    them to, the data words)."""
    narrow = g.to(spec.torch_dtype)
    return narrow.to(torch.float32), wire.pack_values(narrow)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("shards", "shard"), [(1, 0), (2, 1), (3, 0)])
def test_mpi_pass_serves_narrow_tables_as_the_engine(
    dtype: str, threads: int, shards: int, shard: int
) -> None:
    """``PULL_MANY`` (plain, conditional, with state) and ``PUSH_MANY`` of narrow tables
    mixed with a float32 one: the reply's data words are the engine's rows in the table's
    type (``pack_values``, padding included), the pushes leave the same bits, clocks,
    state and counters as the engine's part-by-part pushes."""
    mine, ref = _build(dtype, shards, shard), _build(dtype, shards, shard)
    routed = _routed(shards, shard)
    specs = [_engine(s).spec for s in mine]
    batched = BatchedPass(threads=threads)
    batched.rebuild(mine)
    gen = torch.Generator().manual_seed(shards * 10 + shard)
    for step in range(5):
        with_state = step % 2 == 1
        order = [3, 0, 1, 2] if step % 2 else [2, 1, 0, 3]
        toc, words, want_words, want_clocks = [], [], [], []
        for index in order:
            spec = specs[index]
            ids = _pick(gen, routed[index], 7, unique=False)  # 7 * dim 5: an odd count
            bound, caller = -1, None
            if (step + index) % 2:
                bound = step % 2
                caller = _shard(ref[index]).read_clocks(ids) - torch.randint(
                    0, 3, (ids.numel(),), generator=gen
                )
            toc.append([index, ids.numel(), wire.width_word(spec.dim, spec.dtype), bound])
            words.append(ids.numpy())
            if caller is not None:
                words.append(caller.numpy())
            got = _shard(ref[index]).pull(ids, caller, None if caller is None else bound)
            want_clocks.append(got.clocks.numpy())
            if got.positions is not None:
                want_clocks.append(got.positions.numpy())
            back = ids if got.positions is None else ids[got.positions]
            rows = got.rows.to(spec.torch_dtype) if spec.narrow else got.rows
            state = _shard(ref[index]).read_state(back) if with_state else None
            if state is not None and not spec.narrow:
                want_words.append(torch.cat([got.rows, state], dim=1).reshape(-1).numpy())
            else:
                want_words.append(wire.pack_values(rows))
                if state is not None:
                    want_words.append(state.reshape(-1).numpy())
        payload = np.concatenate([np.asarray(toc, dtype=np.int64).reshape(-1), *words])
        reply = batched.pull_many(len(order), 4, payload, with_state)
        assert reply is not None, "the pass serves pulls of narrow tables"
        meta, data = reply
        body = meta[wire.HEADER_LEN :]
        assert np.array_equal(body[2 * len(order) :], np.concatenate(want_clocks))
        want = np.concatenate(want_words)
        assert np.array_equal(data.view(np.int32), want.view(np.int32)), f"step {step} rows"
        # pushes: distinct sorted ids, every table once, gradients in the tables' types
        toc, ids_words, grad_words = [], [], []
        for index in order:
            spec = specs[index]
            ids = _pick(gen, routed[index], 9, unique=True)
            g = torch.randn(ids.numel(), spec.dim, generator=gen)
            widened, packed = _wire_grads(spec, g) if spec.narrow else (g, g.numpy().reshape(-1))
            toc.append([index, ids.numel(), wire.width_word(spec.dim, spec.dtype)])
            ids_words.append(ids.numpy())
            grad_words.append(packed)
            _shard(ref[index]).push(ids, widened, checked=True)
        payload = np.concatenate([np.asarray(toc, dtype=np.int64).reshape(-1), *ids_words])
        whole = batched.checked_push(len(order), payload, np.concatenate(grad_words), False)
        assert whole is not None, "the pass applies pushes of narrow row-wise Adagrad tables"
        batched.push(whole)
        batched.fold()
        _same_tables(mine, ref)
    assert batched.served == 10


def test_mpi_pass_refuses_what_the_python_path_serves() -> None:
    """Narrow parts the pass does not take go the Python path with nothing changed: a
    part whose row type is not its table's, a non-finite narrow gradient, a counted push
    of a narrow table, a narrow SGD table's push."""
    tables = _build("fp16", 1, 0)
    sgd = LocalTable(_spec(0, "fp16", ps.SGD(lr=0.1)))
    batched = BatchedPass(threads=1)
    batched.rebuild([*tables, sgd])
    before = [_engine(t).weights.clone() for t in tables]
    ids = torch.arange(4)

    def push(index: int, dtype: str, grads: np.ndarray, counted: bool = False) -> bool:
        dim = _TABLES[index % len(_TABLES)][1]
        payload = np.concatenate([[index, 4, wire.width_word(dim, dtype)], ids.numpy()])
        data = grads
        if counted:
            counts, wide = wire.pack_counts(np.ones(4, dtype=np.int64))
            payload = np.concatenate([payload, counts])
            data = np.concatenate([grads, np.zeros(4, dtype=np.float32)])
            return batched.checked_push(1, payload, data, False, counted=True, wide=wide) is None
        return batched.checked_push(1, payload, data, False) is None

    g = torch.randn(4, 5)
    assert push(0, "fp32", g.numpy().reshape(-1)), "fp32 values for an fp16 table"
    assert push(0, "bf16", wire.pack_values(g.to(torch.bfloat16))), "bf16 for an fp16 table"
    bad = g.clone()
    bad[2, 3] = float("inf")
    assert push(0, "fp16", wire.pack_values(bad.to(torch.float16))), "an Inf gradient"
    assert push(0, "fp16", wire.pack_values(g.to(torch.float16)), counted=True), "counted"
    assert push(4, "fp16", wire.pack_values(g.to(torch.float16))), "SGD"
    assert not push(0, "fp16", wire.pack_values(g.to(torch.float16))), "a good one is taken"
    for t, w in zip(tables[1:], before[1:], strict=True):
        assert torch.equal(_engine(t).weights, w)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_inprocess_pass_serves_narrow_tables_as_the_engine(dtype: str) -> None:
    """``LocalBatchedPass`` pulls (widened to float32, with state and conditional) and
    pushes (float32 gradients, repeated ids summed first) of narrow tables mixed with a
    float32 one: the engine's results and tables, bit for bit."""
    specs = [_spec(i, dtype) for i in range(len(_TABLES))]
    mine = [LocalTable(s) for s in specs]
    ref = [LocalTable(s) for s in specs]
    batched = LocalBatchedPass()
    gen = torch.Generator().manual_seed(3)
    every = [torch.arange(rows) for rows, _, _ in _TABLES]
    for step in range(5):
        with_state = step % 2 == 1
        order = [3, 0, 1, 2] if step % 2 else [2, 1, 0, 3]
        requests = []
        for index in order:
            ids = _pick(gen, every[index], 11, unique=False)
            if step >= 2:
                clocks = ref[index].read_clocks(ids) - torch.randint(0, 2, ids.shape, generator=gen)
                requests.append(PullRequest(specs[index].name, ids, clocks, 0, with_state))
            else:
                requests.append(PullRequest(specs[index].name, ids, with_state=with_state))
        got = batched.pull([mine[i] for i in order], requests)
        assert got is not None, "the pass serves pulls of narrow tables"
        for index, r, g in zip(order, requests, got, strict=True):
            want = ref[index].pull(r.ids, r.clocks, r.bound)
            assert_same(g.rows, want.rows, what=f"step {step} rows", why=SAME)
            assert torch.equal(g.clocks, want.clocks)
            assert (g.positions is None) == (want.positions is None)
            if g.positions is not None and want.positions is not None:
                assert torch.equal(g.positions, want.positions)
            if with_state:
                back = r.ids if want.positions is None else r.ids[want.positions]
                assert g.state is not None
                assert_same(g.state, ref[index].read_state(back), what="state", why=SAME)
        pushes = []
        for index in order:
            ids = _pick(gen, every[index], 13, unique=False)  # repeats summed by coalesce
            g = torch.randn(ids.numel(), specs[index].dim, generator=gen)
            pushes.append(PushRequest(specs[index].name, ids, g))
            ref[index].push(ids, g, checked=True)
        assert batched.push([mine[i] for i in order], pushes)
        _same_tables(list(mine), list(ref))
    assert batched.served == 10
    # a counted push of a narrow table goes the Python path, nothing changed
    ids = torch.arange(3)
    counted = PushRequest(specs[0].name, ids, torch.randn(3, 5), torch.ones(3, dtype=torch.int64),
                          torch.zeros(3, 1))  # fmt: skip
    assert not batched.push([mine[0]], [counted])
    _same_tables(list(mine), list(ref))
