"""Exactly-once pushes, bad wire messages and Redis data-loss detection, on real processes.

Lost replies are injected by real code paths (no mocks): the MPI server applies a
push and does not send its reply, the Redis store treats a reply as lost after its
scripts ran (both through the test-only subclasses of ``tests/support/ps_faults.py``), and a
Redis server drops a client's connection while its pushes are queued (``CLIENT
PAUSE`` + ``CLIENT KILL``: the pushes never ran). The workers resend; the rows and
clocks must equal the sequential reference (``tests/ps/ranks/ps_exactly_once.py``:
exact sums for SGD on exact gradients, an InProcessStore fed each push once for
Adam). Each scenario also runs with the sequence numbers switched off, and there
the rows must differ: the check can fail.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import ps
import tests.ps.ranks.ps_exactly_once as eo  # noqa: E402
from multiproc import run_ranks
from ps.redis.store import RedisDataLossError, RedisStore
from ps_faults import LossyRedisStore
from ps_reference import RecordingStore
from redis_server import RedisCluster, RedisServer, redis_cluster, redis_server
from tolerance import assert_same

SCRIPT = "ps_exactly_once.py"


def _mpi(nprocs: int, servers: int, *extra: str) -> dict[str, tuple[str, dict[str, int]]]:
    """Run the rank script; per session label ("result", "control"): (outcome, counters)."""
    outs = run_ranks(SCRIPT, nprocs, "mpi", ["--servers", str(servers), *extra], timeout=110)
    out = "\n".join(outs)
    labels = ["result", "control"] if "--control" in extra else ["result"]
    workers = nprocs - servers
    got = {}
    for label in labels:
        assert len(re.findall(rf"rank \d+: ok worker {label}", out)) == workers, out
        assert len(re.findall(rf"rank \d+: ok server {label}", out)) == servers, out
        result = re.search(rf"rank 0: {label} (match|mismatch.*)", out)
        counters = re.search(rf"rank 0: {label} counters (\{{.*\}})", out)
        assert result and counters, out
        got[label] = result.group(1), json.loads(counters.group(1))
    return got


# ---------------------------------------------------------------- MPI


@pytest.mark.timeout(120)
def test_mpi_lost_replies_one_worker_one_server_and_bad_wire_messages() -> None:
    result, c = _mpi(2, 1, "--drop", "3", "--bad-wire")["result"]
    assert result == "match", result
    assert c["resent"] > 0 and c["duplicates"] > 0, c
    assert c["applied"] == c["issued"], c  # lost = issued - applied = 0


@pytest.mark.timeout(150)
def test_mpi_lost_replies_two_workers_two_servers_and_the_control() -> None:
    """With sequence numbers every resend is a repeat; then, in the same job, the control
    (same faults, no numbers): the comparison must fail, resends were applied twice."""
    runs = _mpi(4, 2, "--drop", "4", "--control")
    result, c = runs["result"]
    assert result == "match", result
    assert c["resent"] > 0 and c["duplicates"] > 0 and c["applied"] == c["issued"], c
    result, c = runs["control"]
    assert result.startswith("mismatch") and "shared rows" in result, result
    assert c["applied"] > c["issued"] and c["duplicates"] == 0, c


# ---------------------------------------------------------------- Redis


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


def _prefix() -> str:
    return f"eo-{uuid.uuid4().hex[:10]}"


def _make_tables(url: str, prefix: str, workers: int, **kw: object) -> RedisStore:
    store = LossyRedisStore(url, prefix=prefix, buckets=4, **kw)  # type: ignore[arg-type]
    store.create_table(eo.shared_spec())
    eo.zero_shared(store)
    for r in range(workers):
        store.create_table(eo.own_spec(r))
    return store


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dedup", [True, False], ids=["exactly_once", "control"])
def test_redis_lost_replies_one_worker(server: RedisServer, dedup: bool) -> None:
    store = _make_tables(server.url, _prefix(), 1, drop_reply_every=3, exactly_once=dedup)
    with store:
        eo.push_all(store, 0, own_in_order=True)
        result = eo.compare(store, 1)
        st = store.stats()
    calls = sum(int(v["push_calls"]) for v in st.values())
    applied = sum(int(v["push_calls_applied"]) for v in st.values())
    repeated = sum(int(v["push_calls_repeated"]) for v in st.values())
    assert sum(int(v["push_retries"]) for v in st.values()) > 0, st
    if dedup:
        assert result == "match", result
        assert applied == calls and repeated > 0, (calls, applied, repeated)
    else:
        assert result.startswith("mismatch") and "shared rows" in result, result
        assert applied > calls and repeated == 0, (calls, applied, repeated)


@pytest.mark.timeout(120)
def test_redis_lost_replies_two_concurrent_clients(server: RedisServer) -> None:
    """Two clients (own connections, worker ids and sessions) push at the same time, each
    losing every third reply: every resend is a repeat, the sums are exact. Threads, not
    processes: the race that matters is between the clients' calls inside Redis."""
    prefix = _prefix()
    with _make_tables(server.url, prefix, 2) as store:
        clients = [
            LossyRedisStore(server.url, prefix=prefix, buckets=4, drop_reply_every=3)
            for _ in range(2)
        ]
        try:
            with ThreadPoolExecutor(2) as pool:
                jobs = [
                    pool.submit(eo.push_all, c, r, own_in_order=True) for r, c in enumerate(clients)
                ]
                for job in jobs:
                    job.result()
            retries = [sum(int(v["push_retries"]) for v in c.stats().values()) for c in clients]
        finally:
            for c in clients:
                c.close()
        assert min(retries) > 0, retries
        assert eo.compare(store, 2) == "match"
        st = store.stats()
        assert sum(int(v["push_calls_repeated"]) for v in st.values()) > 0, st


@pytest.mark.timeout(120)
def test_redis_cluster_lost_replies() -> None:
    with redis_cluster(3) as cluster:
        _cluster_case(cluster)


def _cluster_case(cluster: RedisCluster) -> None:
    store = LossyRedisStore(
        host=cluster.host,
        port=cluster.port,
        cluster=True,
        prefix=_prefix(),
        buckets=8,
        drop_reply_every=2,
    )
    with store:
        store.create_table(eo.shared_spec())
        eo.zero_shared(store)
        store.create_table(eo.own_spec(0))
        eo.push_all(store, 0, own_in_order=True)
        assert eo.compare(store, 1) == "match"
        st = store.stats()["shared"]
        assert st["push_calls_repeated"] > 0 and st["push_calls_applied"] == st["push_calls"], st


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dedup", [True, False], ids=["exactly_once", "control"])
def test_redis_connection_killed_while_pushes_wait(server: RedisServer, dedup: bool) -> None:
    """Redis drops the store's connection while its pushes are queued (never run): the
    store reconnects and resends. With dedup on, resends of pushes that did run are
    repeats too, so the result is exact either way; the control shows the same faults
    without numbers still end right here (nothing ran twice), so this case checks the
    reconnect path, and the drop case above checks the repeat path."""
    spec = ps.TableSpec(name="k", num_rows=16, dim=2, optimizer=ps.SGD(lr=1.0))
    admin = server.client()
    with LossyRedisStore(server.url, prefix=_prefix(), buckets=2, exactly_once=dedup) as store:
        store.create_table(spec)
        everything = torch.arange(16)
        store.push("k", everything, store.pull("k", everything).rows)  # rows = 0: sums exact
        admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
        handles = [
            store.push_async("k", torch.tensor([i % 16, (3 * i) % 16]), torch.ones(2, 2))
            for i in range(8)
        ]
        killer = threading.Timer(
            0.1, lambda: server.client().execute_command("CLIENT", "KILL", "TYPE", "normal")
        )
        killer.start()
        for h in handles:
            h.wait()
        killer.join()
        ref = torch.zeros(16, 2)
        clocks = torch.ones(16, dtype=torch.int64)
        for i in range(8):
            for j in {i % 16, (3 * i) % 16}:
                clocks[j] += 1
            ref[i % 16] -= 1
            ref[(3 * i) % 16] -= 1
        got = store.pull("k", everything)
        # SGD lr 1 from 0 on ones: every sum and every update is a small integer, exact.
        assert_same(got.rows, ref, what="rows", why="SGD lr 1 from 0 on ones: exact integers")
        assert torch.equal(got.clocks, clocks), got.clocks
        assert store.stats()["k"]["push_retries"] > 0


# ---------------------------------------------------------------- Redis data loss


def _table(store: RedisStore) -> None:
    spec = ps.TableSpec(name="items", num_rows=100, dim=4, optimizer=ps.Adagrad(lr=0.1))
    store.create_table(spec)
    store.push("items", torch.arange(10), torch.ones(10, 4))


@pytest.mark.timeout(60)
def test_redis_restart_without_persistence_is_an_error_not_new_rows(tmp_path: Path) -> None:
    with redis_server() as srv:
        store = RedisStore(srv.url, prefix="loss", buckets=4, socket_timeout=2.0)
        _table(store)
        srv.restart()  # appendonly no, save "": everything is gone
        where = f"127.0.0.1:{srv.port}"
        calls = [
            ("pull", lambda: store.pull("items", torch.arange(5))),
            (
                "pull bound",
                lambda: store.pull(
                    "items", torch.arange(3), clocks=torch.zeros(3, dtype=torch.int64), bound=0
                ),
            ),
            ("push", lambda: store.push("items", torch.arange(3), torch.ones(3, 4))),
            ("clocks", lambda: store.clocks("items", torch.arange(3))),
            ("save", lambda: store.save(tmp_path / "ckpt")),
        ]
        for what, fn in calls:
            with pytest.raises(RedisDataLossError, match=rf"'items' is gone from Redis at {where}"):
                fn()
            assert not (tmp_path / "ckpt").exists(), what
        # Nothing was written back: the push did not re-create rows from initial values.
        assert srv.client().keys("*") == []
        store.close()


@pytest.mark.timeout(60)
def test_redis_flush_and_recreate_are_detected(server: RedisServer) -> None:
    prefix = _prefix()
    a = RedisStore(server.url, prefix=prefix, buckets=4)
    b = RedisStore(server.url, prefix=prefix, buckets=4)
    _table(a)
    b.pull("items", torch.arange(3))  # b opens the table
    b.drop_table("items")
    _table(b)  # a new table of the same name: a's copy of the token is old
    with pytest.raises(RedisDataLossError, match="not this table's"):
        a.pull("items", torch.arange(3))
    b.push("items", torch.arange(3), torch.ones(3, 4))
    a.close()
    b.close()


@pytest.mark.timeout(90)
def test_redis_restart_with_append_only_file_keeps_every_acknowledged_push() -> None:
    """appendonly yes + appendfsync always: after a restart the store reconnects (and
    reloads its scripts) by itself; a push issued while Redis is down is resent once it
    is back (retries within the wait limit), and every acknowledged push is there."""
    with redis_server(appendonly=True, appendfsync="always") as srv:
        store = RedisStore(
            srv.url,
            prefix="aof",
            buckets=4,
            socket_timeout=8.0,
            retry_backoff_s=0.05,
            max_retries=8,
        )
        ref = RecordingStore()  # remembers the pushes, for the tolerance
        spec = ps.TableSpec(name="items", num_rows=100, dim=4, optimizer=ps.Adagrad(lr=0.1))
        for s in (store, ref):
            s.create_table(spec)
        gen = torch.Generator().manual_seed(3)
        for step in range(20):
            ids = torch.randint(0, 100, (12,), generator=gen)
            grads = torch.randn(12, 4, generator=gen)
            if step == 10:
                srv.kill()
                restart = threading.Timer(0.3, srv.restart)
                restart.start()
                store.push("items", ids, grads)  # waits out the restart
                restart.join()
            else:
                store.push("items", ids, grads)
            ref.push("items", ids, grads)
        every = torch.arange(100)
        a, b = store.pull("items", every), ref.pull("items", every)
        # Redis computes in doubles and rounds once per update, the in-process store rounds
        # every operation: two float32 runs of the same pushes (ps_reference.Replay).
        ref.assert_pull_close("items", every, a.rows, b.rows, "after the restart")
        assert torch.equal(a.clocks, b.clocks)
        store.close()


def test_redis_store_options_are_checked() -> None:
    for kw, needle in (
        ({"worker_id": -1}, "worker_id"),
        ({"max_retries": -1}, "max_retries"),
        ({"retry_backoff_s": -0.1}, "retry_backoff_s"),
    ):
        with pytest.raises(ValueError, match=needle):
            RedisStore("redis://127.0.0.1:1/0", **kw)  # type: ignore[arg-type]
    # The fault switches are not part of the product constructors any more.
    for switch in ("drop_reply_every", "exactly_once"):
        with pytest.raises(TypeError, match=switch):
            RedisStore("redis://127.0.0.1:1/0", **{switch: 1})  # type: ignore[arg-type]
    from ps.mpi.server import ServerConfig

    with pytest.raises(TypeError, match="drop_reply_every"):
        ServerConfig(drop_reply_every=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="worker_timeout_s"):
        ServerConfig(worker_timeout_s=0)
    with pytest.raises(ValueError, match="drop_reply_every"):
        LossyRedisStore("redis://127.0.0.1:1/0", drop_reply_every=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exactly_once"):
        LossyRedisStore("redis://127.0.0.1:1/0", exactly_once=1)  # type: ignore[arg-type]
