"""Exactly-once pushes, bad wire messages and Redis data-loss detection, on real processes.

Lost replies are injected by real code paths (no mocks): the MPI server applies a
push and does not send its reply (``ServerConfig.drop_reply_every``), the Redis
store treats a reply as lost after its scripts ran (``drop_reply_every``), and a
Redis server drops a client's connection while its pushes are queued (``CLIENT
PAUSE`` + ``CLIENT KILL``: the pushes never ran). The workers resend; the rows and
clocks must equal the sequential reference (``tests/ranks/ps_exactly_once.py``:
exact sums for SGD on exact gradients, an InProcessStore fed each push once for
Adam). Each scenario also runs with the sequence numbers switched off, and there
the rows must differ: the check can fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ps
from multiproc import ROOT, rank_env, run_ranks
from ps.redis_store import RedisDataLossError, RedisStore
from redis_server import RedisCluster, RedisServer, redis_cluster, redis_server

sys.path.insert(0, str(ROOT / "tests" / "ranks"))
import ps_exactly_once as eo  # noqa: E402

SCRIPT = "ps_exactly_once.py"


def _mpi(nprocs: int, servers: int, *extra: str) -> tuple[str, dict[str, int]]:
    outs = run_ranks(SCRIPT, nprocs, "mpi", ["--servers", str(servers), *extra], timeout=110)
    out = "\n".join(outs)
    workers = nprocs - servers
    assert len(re.findall(r"rank \d+: ok worker", out)) == workers, out
    assert len(re.findall(r"rank \d+: ok server", out)) == servers, out
    result = re.search(r"rank 0: result (.*)", out)
    counters = re.search(r"rank 0: counters (\{.*\})", out)
    assert result and counters, out
    import json

    return result.group(1), json.loads(counters.group(1))


# ---------------------------------------------------------------- MPI


@pytest.mark.timeout(120)
def test_mpi_lost_replies_one_worker_one_server_and_bad_wire_messages() -> None:
    result, c = _mpi(2, 1, "--drop", "3", "--bad-wire")
    assert result == "match", result
    assert c["resent"] > 0 and c["duplicates"] > 0, c
    assert c["applied"] == c["issued"], c  # lost = issued - applied = 0


@pytest.mark.timeout(120)
def test_mpi_lost_replies_two_workers_two_servers() -> None:
    result, c = _mpi(4, 2, "--drop", "4")
    assert result == "match", result
    assert c["resent"] > 0 and c["duplicates"] > 0 and c["applied"] == c["issued"], c


@pytest.mark.timeout(120)
def test_mpi_without_sequence_numbers_the_resends_apply_twice() -> None:
    """The control: same faults, no dedup; the comparison must fail."""
    result, c = _mpi(3, 1, "--drop", "3", "--no-dedup")
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
    store = RedisStore(url, prefix=prefix, buckets=4, **kw)  # type: ignore[arg-type]
    store.create_table(eo.shared_spec())
    eo.zero_shared(store)
    for r in range(workers):
        store.create_table(eo.own_spec(r))
    return store


def _run_workers(url: str, prefix: str, workers: int, *extra: str) -> list[str]:
    script = ROOT / "tests" / "ranks" / SCRIPT
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--redis", url, "--prefix", prefix]
            + ["--worker", str(r), *extra],
            cwd=ROOT,
            env=rank_env(inherit=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(workers)
    ]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


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
def test_redis_lost_replies_two_worker_processes(server: RedisServer) -> None:
    prefix = _prefix()
    with _make_tables(server.url, prefix, 2) as store:
        outs = _run_workers(server.url, prefix, 2, "--drop", "3")
        retries = [int(m) for o in outs for m in re.findall(r"retries=(\d+)", o)]
        assert len(retries) == 2 and min(retries) > 0, outs
        assert eo.compare(store, 2) == "match"
        st = store.stats()
        assert sum(int(v["push_calls_repeated"]) for v in st.values()) > 0, st


@pytest.mark.timeout(120)
def test_redis_cluster_lost_replies() -> None:
    with redis_cluster(3) as cluster:
        _cluster_case(cluster)


def _cluster_case(cluster: RedisCluster) -> None:
    store = RedisStore(
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
    with RedisStore(server.url, prefix=_prefix(), buckets=2, exactly_once=dedup) as store:
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
        assert torch.equal(got.rows, ref), (got.rows - ref).abs().max()
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
        ref = ps.InProcessStore()
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
        a, b = store.pull("items", torch.arange(100)), ref.pull("items", torch.arange(100))
        torch.testing.assert_close(a.rows, b.rows, rtol=1e-6, atol=1e-6)
        assert torch.equal(a.clocks, b.clocks)
        store.close()


def test_redis_store_options_are_checked() -> None:
    for kw, needle in (
        ({"worker_id": -1}, "worker_id"),
        ({"max_retries": -1}, "max_retries"),
        ({"drop_reply_every": 1.5}, "drop_reply_every"),
        ({"retry_backoff_s": -0.1}, "retry_backoff_s"),
    ):
        with pytest.raises(ValueError, match=needle):
            RedisStore("redis://127.0.0.1:1/0", **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exactly_once"):
        RedisStore("redis://127.0.0.1:1/0", exactly_once=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop_reply_every"):
        from ps.mpi_server import ServerConfig

        ServerConfig(drop_reply_every=-1)
