"""Redis killed under a running store: nothing acknowledged is lost, nothing is served silently.

Real ``redis-server`` processes (``tests/support/redis_server.py``), killed with SIGKILL and
restarted on the same port and data folder:

* with the append-only file fsynced on every write (``appendfsync always``) every
  push whose ``wait()`` returned is in Redis after the restart: rows, optimizer
  state and clocks equal an :class:`ps.InProcessStore` fed the same acknowledged
  pushes (bit for bit for SGD on exact gradients; for Adagrad within a few times the
  reference's rounding error, measured by a float64 replay); the push in flight at
  the kill is applied whole, per bucket, or not at all (never half a row), and the
  same store object reconnects by itself;
* without persistence the restarted Redis is empty: the store must raise (the
  message says the table is "gone from Redis") instead of training on re-initialized
  rows;
* a Redis that stays dead is a :class:`ps.RedisUnavailableError` naming
  ``host:port`` within seconds, for requests issued before and after the kill.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import ps
from ps.redis.store import RedisStore, RedisUnavailableError
from redis_server import RedisServer, redis_server
from tolerance import assert_close, assert_same, replay_tol

pytestmark = pytest.mark.timeout(90)

NUM_ROWS = 200
DIM = 4
# SGD with lr 1 and gradients that are multiples of 1/8: every store computes the same floats.
SPEC = ps.TableSpec(name="t", num_rows=NUM_ROWS, dim=DIM, optimizer=ps.SGD(lr=1.0))
ADAGRAD = ps.TableSpec(name="a", num_rows=NUM_ROWS, dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.1))


def _push(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Push number ``step``: 16 ids (with repeats) and gradients, a pure function of ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, NUM_ROWS, (16,), generator=gen)
    grads = torch.randint(-8, 9, (16, DIM), generator=gen).to(torch.float32) / 8
    return ids, grads


def _store(srv: RedisServer, prefix: str) -> RedisStore:
    return RedisStore(srv.url, prefix=prefix, buckets=8, socket_timeout=2.0, connect_timeout=1.0)


class _Adagrad64:
    """The pushes to ``ADAGRAD`` replayed in float64 (duplicate ids summed, as every store
    does): how far the float32 :class:`ps.InProcessStore` is from the exact result."""

    def __init__(self) -> None:
        self.rows = ADAGRAD.initial_rows(torch.arange(NUM_ROWS)).double()  # [R, D]
        self.acc = ADAGRAD.initial_state().double().expand(NUM_ROWS, -1).clone()  # [R, 1]

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        opt = ADAGRAD.optimizer
        assert isinstance(opt, ps.RowWiseAdagrad)
        uniq, inv = torch.unique(ids, return_inverse=True)
        g = torch.zeros(len(uniq), DIM, dtype=torch.float64).index_add_(0, inv, grads.double())
        self.acc[uniq, 0] += g.square().mean(dim=1)
        self.rows[uniq] -= opt.lr * g / (self.acc[uniq].sqrt() + opt.eps)


# Up to 16 gradients of one id summed, then the row-wise Adagrad update (at most 8
# roundings per element; the accumulator: the squares and a mean over DIM besides): the
# floor of a replayed tolerance whose measured error is small by chance.
_ROW_TERMS = 16 + 8
_STATE_TERMS = 2 * 16 + DIM + 8


def _assert_rows_equal(store: ps.Store, ref: ps.Store, table: str, ref64: _Adagrad64) -> None:
    """``table`` "t" bit for bit; "a" (Adagrad: the Redis store's Lua computes in doubles
    and rounds each stored value to float32 once per update, the reference rounds every
    intermediate) within a few times the reference's own rounding error, measured by
    the float64 replay ``ref64``."""
    ids = torch.arange(NUM_ROWS)
    assert torch.equal(store.clocks(table, ids), ref.clocks(table, ids))
    got, want = store.pull(table, ids).rows, ref.pull(table, ids).rows
    got_s, want_s = store.state(table, ids), ref.state(table, ids)
    if table == "t":
        why = "SGD with lr 1 on gradients that are multiples of 1/8: every update is one exact "
        why += "difference rounded once to float32, in doubles or in floats"
        assert_same(got, want, what="SGD rows", why=why)
        assert_same(got_s, want_s, what="SGD state", why=why)
        return
    why = "a few times the float32 reference's own rounding error, measured in float64"
    tol = replay_tol(want, ref64.rows, floor_terms=_ROW_TERMS)
    assert_close(got, want, atol=tol, what="Adagrad rows", why=why)
    tol = replay_tol(want_s, ref64.acc, floor_terms=_STATE_TERMS)
    assert_close(got_s, want_s, atol=tol, what="Adagrad state", why=why)


def _reconnect(store: RedisStore, srv: RedisServer) -> None:
    """The same store object goes on after a restart. Its connection broke with the server:
    the first request may fail with RedisUnavailableError naming the address (the store
    cannot know the socket is dead before using it); the next one reconnects (and reloads
    the Lua scripts, which a restart forgets)."""
    try:
        store.clocks("t", torch.arange(3))
    except RedisUnavailableError as err:
        assert f"127.0.0.1:{srv.port}" in str(err), err
    store.clocks("t", torch.arange(3))


def store_clocks_after_one_push(ids: torch.Tensor) -> torch.Tensor:
    ref = ps.InProcessStore()
    ref.create_table(SPEC)
    ref.push("t", *_push(0))
    return ref.clocks("t", ids)


def _prefix() -> str:
    return f"fault-{uuid.uuid4().hex[:10]}"


def test_aof_restart_keeps_every_acknowledged_push_and_the_store_reconnects() -> None:
    ref = ps.InProcessStore()
    for spec in (SPEC, ADAGRAD):
        ref.create_table(spec)
    ref64 = _Adagrad64()
    with redis_server(appendonly=True, appendfsync="always") as srv:
        store = _store(srv, _prefix())
        for spec in (SPEC, ADAGRAD):
            store.create_table(spec)
        step = 0
        for _round in range(2):  # two kill/restart cycles on the same store object
            for _ in range(15):
                ids, grads = _push(step)
                for table in ("t", "a"):
                    store.push(table, ids, grads)
                    ref.push(table, ids, grads)
                ref64.push(ids, grads)
                step += 1
            srv.kill()
            srv.restart()
            _reconnect(store, srv)
            for table in ("t", "a"):
                _assert_rows_equal(store, ref, table, ref64)
        assert store.tables() == ["t", "a"]
        store.close()


def test_aof_kill_during_pushes_loses_no_acknowledged_push() -> None:
    """A thread pushes as fast as it can; Redis is SIGKILLed under it and restarted."""
    prefix = _prefix()
    with redis_server(appendonly=True, appendfsync="always") as srv:
        store = _store(srv, prefix)
        store.create_table(SPEC)
        acked: list[int] = []
        failed: list[tuple[int, BaseException]] = []

        def pusher() -> None:
            step = 0
            while True:
                ids, grads = _push(step)
                try:
                    store.push("t", ids, grads)
                except Exception as err:
                    failed.append((step, err))
                    return
                acked.append(step)
                step += 1

        thread = threading.Thread(target=pusher, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30.0
        while len(acked) < 40 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(acked) >= 40, (acked[-1:], failed)
        t_kill = time.monotonic()
        srv.kill()
        thread.join(timeout=20.0)
        assert not thread.is_alive(), "a push hung after Redis was killed"
        assert len(failed) == 1, failed
        in_flight, err = failed[0]
        assert isinstance(err, RedisUnavailableError), repr(err)
        assert f"127.0.0.1:{srv.port}" in str(err), err
        assert time.monotonic() - t_kill < 10.0
        assert acked == list(range(len(acked))) and in_flight == len(acked)
        srv.restart()
        _reconnect(store, srv)

        before = ps.InProcessStore()  # every acknowledged push
        before.create_table(SPEC)
        for step in acked:
            before.push("t", *_push(step))
        after = ps.InProcessStore()  # ... and the one in flight
        after.create_table(SPEC)
        for step in [*acked, in_flight]:
            after.push("t", *_push(step))
        ids = torch.arange(NUM_ROWS)
        got = store.pull("t", ids)
        b, a = before.pull("t", ids), after.pull("t", ids)
        # Per row: exactly the acknowledged state, or that plus the in-flight push.
        as_before = (got.clocks == b.clocks) & (got.rows == b.rows).all(dim=1)
        as_after = (got.clocks == a.clocks) & (got.rows == a.rows).all(dim=1)
        bad = torch.nonzero(~(as_before | as_after)).flatten().tolist()
        assert not bad, (
            f"rows {bad[:10]} are neither the acknowledged state nor it plus the in-flight "
            f"push: clocks {got.clocks[bad[:10]].tolist()} vs {b.clocks[bad[:10]].tolist()}"
        )
        store.close()


def test_restart_without_persistence_is_an_error_not_fresh_rows() -> None:
    with redis_server(appendonly=False) as srv:
        store = _store(srv, _prefix())
        store.create_table(SPEC)
        ids, grads = _push(0)
        store.push("t", ids, grads)
        srv.kill()
        srv.restart()  # empty: no RDB, no AOF
        with pytest.raises(ps.RedisDataLossError, match=r"gone from Redis") as pull_err:
            store.pull("t", ids)
        assert "'t'" in str(pull_err.value) and f"{srv.port}" in str(pull_err.value)
        with pytest.raises(ps.RedisDataLossError, match=r"gone from Redis"):
            store.push("t", ids, grads)
        # Nothing was written back: the push did not recreate rows or the table.
        client = srv.client()
        assert client.dbsize() == 0, sorted(client.keys())[:10]
        store.close()


def test_dead_redis_is_an_error_naming_the_address_within_seconds(tmp_path: Path) -> None:
    with redis_server(appendonly=False) as srv:
        store = _store(srv, _prefix())
        store.create_table(SPEC)
        ids, grads = _push(0)
        store.push("t", ids, grads)
        address = f"127.0.0.1:{srv.port}"
        in_flight = store.pull_async("t", ids)  # written before the kill, read after
        srv.kill()
        # Redis may have answered before it died (the reply waits in the socket): then the
        # rows are the right ones; else the wait fails like any request.
        try:
            got = in_flight.wait()
            assert torch.equal(got.clocks, store_clocks_after_one_push(ids))
        except RedisUnavailableError as err:
            assert address in str(err), err
        calls = [
            ("pull", lambda: store.pull("t", ids)),
            ("push", lambda: store.push("t", ids, grads)),
            ("clocks", lambda: store.clocks("t", ids)),
            ("stats", store.stats),
            ("save", lambda: store.save(tmp_path / "ck")),
        ]
        for what, call in calls:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailableError) as info:
                call()
            seconds = time.monotonic() - t0
            assert seconds < 8.0, f"{what} took {seconds:.1f} s to fail"
            assert address in str(info.value), (what, info.value)
        assert not (tmp_path / "ck").exists()
        store.close()
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailableError, match=address):
            _store(srv, _prefix())
        assert time.monotonic() - t0 < 8.0
