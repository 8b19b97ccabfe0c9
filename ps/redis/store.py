"""The Redis store: a :class:`ps.Store` on a Redis server or Redis Cluster.

Several workers (processes, machines) open a :class:`RedisStore` on one Redis and
share its tables; the optimizer runs inside Redis, so concurrent pushes never lose
an update (a client-side read-modify-write with HMSET, as TFRA's Redis backend
does, loses every update that races another)::

    store = RedisStore("redis://10.0.0.5:6379/0", prefix="hybridrec:dlrm", password="...")
    store.create_table(spec, exist_ok=True)     # every worker may call it
    rows = store.pull("items", ids).rows
    store.push("items", ids, grads)

Where the rows live: :mod:`ps.redis.layout` (keys, buckets, metadata). The
exactly-once protocol, retries and the incarnation tokens that detect lost data are
described in ``docs/ps_protocol.md``; eviction in :mod:`ps.redis.eviction`, save and
load in :mod:`ps.redis.snapshot`, the scripts in :mod:`ps.redis.lua`, the fp16/bf16 rows
of narrow tables (and their stochastic rounding inside Redis) in :mod:`ps.redis.narrow`.

Requests (one command per touched bucket, each node's commands written in one go):

* plain pull: ``HMGET`` per bucket;
* conditional pull (``clocks``/``bound``): a Lua script per bucket compares the
  stored clocks inside Redis and returns only the stale rows (one round trip,
  bytes moved = the stale rows); ids whose caller clock is below ``-bound`` (a
  cache's misses: they come back whatever Redis holds) go as a plain ``HMGET`` in the
  same round trip instead, half the cost per row of comparing in Lua;
* push: duplicate ids are summed by the client; a generated Lua script per bucket
  (:func:`ps.redis.lua.push_script`) applies the optimizer to each row and adds 1
  to its clock atomically. A row that does not exist yet needs its initial value,
  which only the client can compute: rows this client's pulls found missing go
  with their initial rows in the first call; for any other missing row the script
  changes nothing and names it, and the client resends that bucket with their
  initial rows (a second round trip, only for pushes of rows never read).

Batches: ``pull_many_async`` / ``push_many_async`` check every table's request, then
write all of their commands together: one pipelined round trip per Redis node for
the whole batch, each table's commands in the order given (a push batch's second
round, if any, is again one round trip per node). Tables with eviction add round
trips per batch: their steps are read (pull) or counted up (push) before it, and
the eviction runs after a push. :meth:`RedisStore.request_counts` counts the round
trips.

Asynchrony and order: ``pull_async``/``push_async`` write their commands at once
and return; ``wait()`` reads the replies. A store keeps one connection per Redis
node, so Redis applies one store's requests in the order they were issued (a pull
issued after a push sees it) whatever order the handles are waited in. The rows a
push creates are written by its second round trip, sent when the push is *settled*:
by its own ``wait()`` or by the wait of any later request of this store on the same
table (a pull, push, ``clocks``, ``state``, ``save``), which first settles the
earlier pushes in issue order and, if one of them created rows, sends its own
commands again; so a pull issued after an unwaited push still sees it (the cache
never waits its pushes until ``flush``). ``wait(timeout)`` past its limit closes
the connection, which fails the other requests in flight on it.

Counters in :meth:`RedisStore.stats` (``pull_requests`` ...) are this client's;
``rows`` and ``bytes`` are read from Redis. ``bytes`` counts the payload held (rows
stored x ``TableSpec.row_bytes``: 4 bytes a weight, 2 on an fp16/bf16 table, 4 a state
value, 8 the clock), so a fixed table's untouched rows count nothing there.
``push_calls`` / ``push_retries`` are this client's, ``push_calls_applied`` /
``push_calls_repeated`` are counted inside Redis (all clients).

A Redis whose data was lost (restart without persistence, flush, eviction) raises
:class:`RedisDataLossError` naming the table and the address instead of handing out
re-initialized rows. Run Redis with ``appendonly yes`` and ``maxmemory-policy
noeviction``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from comm import Handle
from ps.checkpoint import TablePart, read_checkpoint, write_checkpoint
from ps.errors import check_existing
from ps.local.table import coalesce, coalesce_counted
from ps.redis.conn import (
    Batch,
    Command,
    RedisAuthError,
    RedisLink,
    RedisUnavailableError,
    bulk_rows,
    evalsha,
    pack,
    pack_fixed,
    raw,
)
from ps.redis.eviction import EvictionScripts, evict, evict_lru
from ps.redis.layout import (
    CLIENT_COUNTERS,
    RedisTable,
    bucket_keys,
    check_key_part,
    meta_json,
    parse_meta,
    step_key,
)
from ps.redis.lua import (
    MARKER,
    MAX_ROWS_PER_CALL,
    PULL_BOUNDED,
    PUSH_GONE,
    RESET_BUCKET,
    SNAPSHOT,
    TOUCH_PULL,
    WIDE,
    WIDE_VALUE,
    counted_push_script,
    push_script,
)
from ps.redis.narrow import NarrowRows
from ps.redis.sequencing import PushNumbers, PushSettle
from ps.redis.snapshot import row_commands, table_parts, write_rows
from ps.routing import shard_of
from ps.store import PullRequest, PullResult, PushRequest, Store, WriteRequest, check_requests
from ps.table import TableSpec
from ps.validate import (
    check_counted,
    check_grads,
    check_ids,
    check_pull_bound,
    check_write,
    plain_counted,
    unknown_table,
)

__all__ = ["RedisAuthError", "RedisDataLossError", "RedisStore", "RedisUnavailableError"]

#: Labels of the round trips counted for :meth:`RedisStore.request_counts`.
PULL, PUSH = "pull_messages", "push_messages"


class RedisDataLossError(RuntimeError):
    """A table's rows are gone from Redis (restart without persistence, flush, eviction)."""


@dataclass(slots=True)
class _Pull:
    """One table's pull, checked: ``ids`` int64 ``[N]``; ``caller`` the caller's clocks
    ``[N]`` of a conditional pull (with ``bound``), else None; ``with_state``: the
    returned rows' optimizer state too."""

    t: RedisTable
    ids: torch.Tensor
    caller: torch.Tensor | None
    bound: int | None
    with_state: bool = False


@dataclass(slots=True, eq=False)
class _Push:
    """One table's push, checked: unique ids ``uniq`` int64 ``[U]`` and their summed
    gradients ``summed`` float32 ``[U, D]`` (``skipped`` rows dropped as not finite);
    once built (:meth:`RedisStore._build_push`), its calls, their numbers and commands."""

    t: RedisTable
    uniq: torch.Tensor
    summed: torch.Tensor
    skipped: int
    counted: tuple[torch.Tensor, torch.Tensor] | None = None  # counts [U], stats [U, Q]
    step: bytes = b""  # the table step of this push (tables with eviction), else b""
    calls: list[tuple[int, int, int]] = field(default_factory=list)  # (bucket, lo, hi)
    seqs: list[tuple[int, int]] = field(default_factory=list)  # per call (number, watermark)
    first: list[Command] = field(default_factory=list)  # the first round, one per call
    command: Any = None  # command(call, rows, numbers, done) -> Command (second rounds)
    created: int = 0  # rows created, counted from the replies


class _Stream:
    """One batch written part by part as a request builds it (:meth:`Batch.extend`):
    Redis runs a batched request's first tables while the client encodes the next, as
    it does for requests sent one table at a time. ``batch`` is None where Redis could
    not be reached (or nothing was sent): the replies' retry then writes every command
    again (:meth:`RedisStore._replies`; pushes are numbered, so none is applied twice)."""

    def __init__(self, link: RedisLink, what: str, label: str) -> None:
        self.link, self.what, self.label = link, what, label
        self.batch: Batch | None = None
        self.broken = False

    def send(self, cmds: list[Command]) -> None:
        if self.broken or not cmds:
            return
        try:
            if self.batch is None:
                self.batch = self.link.start(cmds, self.what, self.label)
            else:
                self.batch.extend(cmds)
        except RedisUnavailableError:
            self.batch, self.broken = None, True


#: Buckets per table on a Redis Cluster: a table's keys spread over up to 64 slots, so
#: over every node of a cluster of up to ~16 masters.
CLUSTER_BUCKETS = 64
#: Buckets per table on one Redis server, where they spread nothing: each bucket a step
#: touches costs a pull and a push command with fixed work on both sides (~20 us in the
#: push script, ~10 us of packing and parsing in the client), so fewer buckets make a
#: step of ~1 k ids per table faster (measured, 8 tables x 100 k rows: 64 -> 8 buckets
#: took an uncached step from 95 to 59 ms and a cached one from 73 to 50 ms).
SERVER_BUCKETS = 8


class RedisStore(Store):
    """A :class:`ps.Store` on a Redis server or Redis Cluster (see the module docstring).

    Connection: ``url`` (``redis://[user:password@]host:port/db``, ``rediss://`` for
    TLS) or ``host``/``port``/``db``; ``username``/``password`` (ACL user or
    ``requirepass``) and the ``ssl*`` options go to redis-py unchanged;
    ``cluster=True`` for Redis Cluster (``host``/``port`` of any node).
    ``socket_timeout`` bounds every reply and ``connect_timeout`` every connect, so
    a dead Redis raises :class:`RedisUnavailableError` naming its address within
    seconds. ``prefix`` namespaces the keys of this job (several jobs can share one
    Redis); ``buckets`` is the bucket count of the tables this store creates (default:
    :data:`CLUSTER_BUCKETS` on a cluster, to spread a table over its nodes, else
    :data:`SERVER_BUCKETS`; a table keeps the count it was created with).
    ``worker_id``, ``max_retries`` and ``retry_backoff_s``: see the module docstring
    (exactly-once pushes).
    """

    counted_pushes = True
    value_writes = True

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        prefix: str = "hybridrec",
        username: str | None = None,
        password: str | None = None,
        ssl: bool = False,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str = "required",
        cluster: bool = False,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        buckets: int | None = None,
        worker_id: int | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.1,
    ) -> None:
        self._prefix = check_key_part("prefix", prefix)
        if worker_id is None:
            worker_id = secrets.randbits(63)
        if not isinstance(worker_id, int) or isinstance(worker_id, bool) or worker_id < 0:
            raise ValueError(f"RedisStore: worker_id must be an int >= 0, got {worker_id!r}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"RedisStore: max_retries must be an int >= 0, got {max_retries!r}")
        b = retry_backoff_s
        if not isinstance(b, int | float) or isinstance(b, bool) or not 0 <= b < 60:
            raise ValueError(f"RedisStore: retry_backoff_s must be in [0, 60) seconds, got {b!r}")
        self.worker_id = worker_id
        self._session = str(secrets.randbits(63)).encode()
        # The worker id the push scripts record numbers under (b"": no numbers, the scripts
        # then apply every call; only a test subclass turns numbering off, to show why).
        self._wid = str(worker_id).encode()
        self._max_retries = max_retries
        self._backoff_s = float(retry_backoff_s)
        if buckets is None:
            buckets = CLUSTER_BUCKETS if cluster else SERVER_BUCKETS
        if not isinstance(buckets, int) or isinstance(buckets, bool) or not 1 <= buckets <= 65536:
            raise ValueError(f"RedisStore: buckets must be an int in [1, 65536], got {buckets!r}")
        for name, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout)):
            if not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"RedisStore: {name} must be a number > 0 (seconds), got {v!r}")
        self._buckets = buckets
        self._link = RedisLink(
            url=url,
            host=host,
            port=port,
            db=db,
            username=username,
            password=password,
            ssl=ssl,
            ssl_ca_certs=ssl_ca_certs,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            ssl_cert_reqs=ssl_cert_reqs,
            cluster=cluster,
            socket_timeout=float(socket_timeout),
            connect_timeout=float(connect_timeout),
        )
        self._timeout_s = float(socket_timeout)
        self._tables: dict[str, RedisTable] = {}
        self._lock = threading.Lock()
        self._issued = itertools.count()  # issue order of pushes (PushSettle.order)
        self._link.ping("open the Redis store")
        self._sha_bounded = self._link.register_script(PULL_BOUNDED)
        self._sha_touch = self._link.register_script(TOUCH_PULL)
        self._sha_snapshot = self._link.register_script(SNAPSHOT)
        self._sha_evict = EvictionScripts.register(self._link)
        self._sha_reset = self._link.register_script(RESET_BUCKET)

    def __repr__(self) -> str:
        kind = "cluster" if self._link.cluster else "server"
        return f"RedisStore({kind} {self._link.address}, prefix={self._prefix!r})"

    def __enter__(self) -> RedisStore:
        return self

    @property
    def prefix(self) -> str:
        """The key prefix of this store's tables."""
        return self._prefix

    @property
    def address(self) -> str:
        """``host:port`` of the server (or the cluster's startup node)."""
        return self._link.address

    # ------------------------------------------------------------ keys and tables

    def _key(self, suffix: str) -> bytes:
        return f"{self._prefix}:{suffix}".encode()

    def _meta_key(self, name: str) -> bytes:
        return self._key(f"table:{name}")

    def _token_key(self, name: str) -> bytes:
        return self._key(f"table:{name}:inc")

    def _new_token(self, name: str, what: str, *, replace: bool = False) -> bytes:
        """The table's incarnation token: a new random one, unless another client chose
        one first (SET NX), so that concurrent creators mark the buckets alike;
        ``replace``: a new one in any case."""
        key = self._token_key(name)
        nx = [] if replace else ["NX"]
        self._link.command(key, "SET", key, secrets.token_hex(8), *nx, what=what)
        token = self._link.command(key, "GET", key, what=what)
        if token is None:  # dropped in between
            raise RuntimeError(f"{what}: the table's token at {key!r} vanished; try again")
        return bytes(token)

    def _make_table(self, spec: TableSpec, buckets: int, token: bytes) -> RedisTable:
        keys = bucket_keys(self._prefix, spec.name, buckets)
        narrow = NarrowRows.of(spec)
        src = push_script(spec.optimizer, spec.dim, narrow=narrow)
        counted = counted_push_script(spec.optimizer, spec.dim, narrow)
        s = spec.state_dim
        state0 = spec.initial_state().numpy().astype("<f4").tobytes() if s else b""
        return RedisTable(
            spec=spec,
            buckets=buckets,
            w_keys=keys["w"],
            s_keys=keys["s"],
            t_keys=keys["t"],
            q_keys=keys["q"],
            step_key=step_key(self._prefix, spec.name),
            push_src=src,
            push_sha=self._link.register_script(src),
            counted_src=counted,
            counted_sha=self._link.register_script(counted),
            state0=state0,
            token=token,
            numbers=PushNumbers.fresh(buckets),
        )

    def _parse_meta(self, name: str, text: bytes) -> tuple[TableSpec, int, bytes]:
        where = f"{self._meta_key(name).decode()!r} on Redis {self.address}"
        return parse_meta(name, text, where)

    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        """Create ``spec.name`` in Redis (no rows are written: they start as initial rows).

        See :meth:`ps.Store.create_table` for ``exist_ok``. Race-free: the meta is
        written with SET NX, so of several workers creating the table at once one
        writes it and the others compare their spec with it.
        """
        if not isinstance(spec, TableSpec):
            raise TypeError(f"create_table: expected a ps.TableSpec, got {type(spec).__name__}")
        check_key_part("table name", spec.name)
        push_script(spec.optimizer, spec.dim)  # NotImplementedError before any write
        key = self._meta_key(spec.name)
        old = self._link.command(key, "GET", key, what="create_table")
        if old is None:
            # The token first, then every bucket's marker, then the meta: a client that
            # finds the meta finds the markers. Concurrent creators share the token.
            token = self._new_token(spec.name, "create_table")
            table = self._make_table(spec, self._buckets, token)
            # Each hash's wide field first (no command finds a marked bucket whose
            # hashes are still compact lists; see ps.redis.lua.WIDE), then the markers.
            wide = table.w_keys + (table.s_keys if spec.state_dim > 0 else [])
            cmds = [raw(k, pack(["HSETNX", k, WIDE, WIDE_VALUE])) for k in wide]
            cmds += [raw(k, pack(["HSETNX", k, MARKER, token])) for k in table.w_keys]
            self._link.run(cmds, "create_table")
            meta = meta_json(spec, self._buckets, token)
            if self._link.command(key, "SET", key, meta, "NX", what="create_table"):
                lst = self._key("tables")
                self._link.command(lst, "RPUSH", lst, spec.name, what="create_table")
                with self._lock:
                    self._tables[spec.name] = table
                return
            old = self._link.command(key, "GET", key, what="create_table")
        if old is None:
            raise RuntimeError(f"create_table {spec.name!r}: the table was dropped meanwhile")
        old_spec, old_buckets, old_token = self._parse_meta(spec.name, old)
        where = f"on Redis {self.address} (db {self._link.db}, prefix {self._prefix!r})"
        clear = "or give the job another Redis db or prefix"
        check_existing(old_spec, spec, exist_ok=exist_ok, where=where, clear=clear)
        with self._lock:
            known = self._tables.get(spec.name)
            # The same incarnation this client already uses keeps its state: a fresh
            # object would restart the push sequence numbers, and Redis would take this
            # client's next pushes for repeats of ones it already applied.
            if known is None or known.token != old_token:
                self._tables[spec.name] = self._make_table(old_spec, old_buckets, old_token)

    def tables(self) -> list[str]:
        """Names of the tables under this prefix (also those other clients created)."""
        lst = self._key("tables")
        names = self._link.command(lst, "LRANGE", lst, 0, -1, what="tables")
        return [n.decode() for n in names]

    def spec(self, table: str) -> TableSpec:
        return self._get(table).spec

    def _get(self, table: str) -> RedisTable:
        t = self._tables.get(table) if isinstance(table, str) else None
        if t is not None:
            return t
        if isinstance(table, str) and table and "{" not in table and "}" not in table:
            key = self._meta_key(table)
            text = self._link.command(key, "GET", key, what=f"open table {table!r}")
            if text is not None:
                spec, buckets, token = self._parse_meta(table, text)
                with self._lock:
                    t = self._tables.setdefault(table, self._make_table(spec, buckets, token))
                return t
        raise unknown_table(table, self.tables())

    # ------------------------------------------------------------ requests

    def _steps(self, tables: list[RedisTable], op: str, what: str, label: str) -> list[bytes]:
        """Per entry of ``tables``: the table step (``op`` "GET": as it is, stamped on the
        rows a pull touches; "INCR": counted up, for a push), b"" for a table without
        eviction. One pipelined round trip per node holding such a step key, none if no
        table evicts."""
        out = [b""] * len(tables)
        ev = [k for k, t in enumerate(tables) if t.evicts]
        if ev:
            cmds = [raw(tables[k].step_key, pack([op, tables[k].step_key])) for k in ev]
            for k, v in zip(ev, self._link.run(cmds, what, label), strict=True):
                out[k] = b"0" if v is None else str(int(v)).encode()
        return out

    def _handle(
        self,
        cmds: list[Command],
        sent: _Stream,
        finish: Any,
        what: str,
        *,
        label: str,
        earlier: list[PushSettle] | None = None,
    ) -> Handle:
        """A read of ``cmds``, written as ``sent`` (part by part, as they were built); the
        handle's ``wait()`` reads the replies (resending on a lost reply, see
        :meth:`_replies`) and returns ``finish(replies)``. ``earlier``: this client's
        pushes on the tables read that were not settled when ``cmds`` were sent: they are
        settled first, and if one of them had to send a second round (rows it created
        after ``cmds`` ran), ``cmds`` are sent again, so the read sees every push issued
        before it."""
        box: dict[str, Any] = {"batch": sent.batch}

        def block(limit: float) -> None:
            again = self._settle(earlier) if earlier else False
            box["replies"] = self._replies(box.pop("batch"), cmds, what, limit, label=label)
            if again:
                box["replies"] = self._replies(None, cmds, what, limit, label=label)

        def done() -> Any:
            return finish(box["replies"])

        return Handle(lambda: False, done, what=what, timeout_s=self._timeout_s, block=block)

    def _unsettled(self, t: RedisTable) -> list[PushSettle]:
        """This client's pushes on ``t`` not settled yet, in issue order."""
        return self._unsettled_of([t])

    def _unsettled_of(self, tables: list[RedisTable]) -> list[PushSettle]:
        """This client's pushes on any of ``tables`` not settled yet, in issue order (a
        batched push is pending on each of its tables, and listed once)."""
        found: dict[int, PushSettle] = {}
        with self._lock:
            for t in tables:
                t.pending = [p for p in t.pending if not p.done]
                found.update((id(p), p) for p in t.pending)
        return sorted(found.values(), key=lambda p: p.order)

    def _settle(self, pushes: list[PushSettle] | None) -> bool:
        """Complete ``pushes`` in issue order; True if one of them sent a second round.

        Why: a push's rows missing from Redis are created by a second call sent only
        when the push completes, so without this a later pull (or push) of the same
        client would overtake them: the store must apply one client's requests in
        issue order (:class:`cache.CachedStore` relies on it). A push's error is
        raised by its own ``wait()``, not here."""
        again = False
        for p in pushes or ():
            try:
                again |= p(self._timeout_s)
            except Exception:  # noqa: S112 -- reported by that push's own wait()
                continue
        return again

    def _replies(
        self,
        batch: Batch | None,
        cmds: list[Command],
        what: str,
        limit: float | None,
        push: list[RedisTable] | None = None,
        label: str | None = None,
    ) -> list[Any]:
        """The replies of ``cmds`` (written as ``batch``; None: not written yet).

        A lost reply (:class:`RedisUnavailableError`: the connection broke, Redis did
        not answer in time or is restarting) makes it resend every command of the
        batch, unchanged, after a pause of ``retry_backoff_s`` (doubling), at most
        ``max_retries`` times and not past ``limit`` seconds from now. Pushes carry
        their sequence numbers, so a call that did run is not applied again.
        ``push``: the tables of a push batch (their retry counters); ``label``: what
        the round trips count as (:meth:`request_counts`).
        """
        deadline = None if limit is None else time.monotonic() + limit
        tries = 0
        while True:
            try:
                if batch is None:
                    batch = self._link.start(cmds, what, label)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return batch.finish(left)
            except RedisUnavailableError:
                pause = self._backoff_s * 2**tries
                late = deadline is not None and time.monotonic() + pause >= deadline
                if tries >= self._max_retries or late:
                    raise
                time.sleep(pause)
                tries += 1
                batch = None
                for c in cmds:
                    c.asking = None
                if push is not None:
                    with self._lock:
                        for t in push:
                            t.counters["push_retries"] += 1

    def _gone(self, t: RedisTable, bucket: int | None, marker: object) -> RedisDataLossError:
        if bucket is None:
            where, how = self.address, "not in the table list any more"
        else:
            where = self._link.node_of(t.w_keys[bucket])
            how = "missing" if marker is None else f"{marker!r}, not this table's {t.token!r}"
            how = f"bucket {bucket}: incarnation marker {how}"
        return RedisDataLossError(
            f"table {t.spec.name!r} is gone from Redis at {where} ({how}); the server "
            "restarted without persistence, or the data was "
            "flushed, evicted or the table dropped and re-created? Its rows would be "
            "re-initialized, so the store stops here: restore from a checkpoint "
            "(RedisStore.load), and run Redis with appendonly yes and "
            "maxmemory-policy noeviction"
        )

    def _check_markers(
        self, t: RedisTable, calls: list[tuple[int, int, int]], markers: list[Any]
    ) -> None:
        for (b, _lo, _hi), m in zip(calls, markers, strict=True):
            if m != t.token:
                raise self._gone(t, b, m)

    def _split(
        self, t: RedisTable, ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """``order`` (bucket-sorted permutation of ``ids``) and the calls ``(bucket, lo, hi)``
        over ``ids[order]``, each at most :data:`MAX_ROWS_PER_CALL` rows."""
        # ps.routing.group_by_shard, with numpy's radix sort for the small bucket numbers.
        bucket = shard_of(ids, t.buckets).numpy().astype(np.uint16)  # [N]
        order = torch.from_numpy(np.argsort(bucket, kind="stable"))  # [N]
        counts = np.bincount(bucket, minlength=t.buckets)  # [B]
        calls = []
        lo = 0
        for b, c in enumerate(counts.tolist()):
            for s in range(lo, lo + c, MAX_ROWS_PER_CALL):
                calls.append((b, s, min(lo + c, s + MAX_ROWS_PER_CALL)))
            lo += c
        return order, calls

    def _note_absent(self, t: RedisTable, missing: np.ndarray, epoch: int) -> None:
        """Remember ``missing`` (int64 ids a read issued at ``t.push_epoch == epoch`` found
        missing from Redis) for the next push of them (see :class:`RedisTable`).

        Not if a push on ``t`` was built since the read was issued: that push may create
        these rows in its second round, and a later push that created them first, in its
        first round, would apply its update before the earlier push's."""
        if missing.size == 0:
            return
        with self._lock:
            if t.push_epoch != epoch:
                return
            t.absent.add(missing)

    # ------------------------------------------------------------ pulls

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        pull = self._checked_pull(PullRequest(table, ids, clocks, bound))
        what = f"pull table {table!r} from Redis {self.address}"
        return self._pull([pull], what, lambda results: results[0])

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Every table's pull is checked first, then all of them go out together: one
        pipelined round trip per Redis node they reach (tables with eviction add one
        before it, to read their steps)."""
        pulls = [self._checked_pull(r) for r in check_requests(requests, PullRequest, "pull_many")]
        names = ", ".join(repr(p.t.spec.name) for p in pulls)
        return self._pull(pulls, f"pull_many of tables {names} from Redis {self.address}", list)

    def _checked_pull(self, r: PullRequest) -> _Pull:
        t = self._get(r.table)
        ids = check_ids(t.spec, r.ids, "pull").cpu()
        caller = check_pull_bound(t.spec, ids, r.clocks, r.bound)
        return _Pull(t, ids, caller, r.bound, r.with_state)

    def _pull(self, pulls: list[_Pull], what: str, result: Any) -> Handle:
        """Send ``pulls`` as one batch; ``wait()`` gives ``result([PullResult per pull])``."""
        tables = [p.t for p in pulls]
        with self._lock:
            for t in tables:
                t.counters["pull_requests"] += 1
            epochs = [t.push_epoch for t in tables]
        earlier = self._unsettled_of(tables)  # before the pull is sent (see _handle)
        steps = self._steps(tables, "GET", what, PULL)
        stream = _Stream(self._link, what, PULL)  # each table's commands out as built
        plans = []
        for p, step, epoch in zip(pulls, steps, epochs, strict=True):
            plans.append(self._with_state(p, *self._pull_commands(p, step, epoch)))
            stream.send(plans[-1][0])
        cmds = [c for part, _finish in plans for c in part]

        def finish(replies: list[Any]) -> Any:
            out, at = [], 0
            for part, decode in plans:  # each table's replies, in the order they were sent
                out.append(decode(replies[at : at + len(part)]))
                at += len(part)
            return result(out)

        return self._handle(cmds, stream, finish, what, label=PULL, earlier=earlier)

    def _pull_commands(
        self, p: _Pull, step: bytes, epoch: int
    ) -> tuple[list[Command], Callable[[list[Any]], PullResult]]:
        """One table's pull: its commands (one per bucket call) and the function that
        decodes their replies into the :class:`PullResult` (checking the markers)."""
        t, ids, caller, bound = p.t, p.ids, p.caller, p.bound
        if caller is not None and bound is not None and ids.numel() > 0:
            always = (caller + bound) < 0  # [N] returned whatever the stored clock (>= 0)
            if bool(always.any()):
                return self._split_bounded(p, always, step, epoch)
        n = int(ids.shape[0])
        order, calls = self._split(t, ids)
        sorted_ids = ids[order].numpy().astype("<i8")  # [N] bucket-sorted
        id_bytes = sorted_ids.tobytes()
        cmds: list[Command] = []
        if caller is not None:
            assert bound is not None
            c_bytes = caller[order].numpy().astype("<i8").tobytes()
            for b, lo, hi in calls:
                keys = [t.w_keys[b], t.t_keys[b] if t.evicts else t.w_keys[b]]
                args: list[bytes | str | int] = [
                    id_bytes[8 * lo : 8 * hi],
                    c_bytes[8 * lo : 8 * hi],
                    bound,
                    t.wb,
                    step,
                    t.token,
                ]
                cmds.append(evalsha(self._sha_bounded, PULL_BOUNDED, keys, args))
        elif t.evicts:
            for b, lo, hi in calls:
                keys = [t.w_keys[b], t.t_keys[b]]
                cmds.append(
                    evalsha(self._sha_touch, TOUCH_PULL, keys, [id_bytes[8 * lo : 8 * hi], step])
                )
        else:
            fields = bulk_rows([sorted_ids.view(np.uint8).reshape(n, 8)])  # [N, 14]
            for b, lo, hi in calls:
                head: list[bytes | str | int] = ["HMGET", t.w_keys[b], MARKER]
                cmds.append(raw(t.w_keys[b], pack_fixed(head, fields[lo:hi], 1)))

        def finish(replies: list[Any]) -> PullResult:
            if caller is None:
                if not t.evicts:  # HMGET: the marker first
                    self._check_markers(t, calls, [r[0] for r in replies])
                    replies = [r[1:] for r in replies]
                else:  # TOUCH_PULL: the marker last
                    self._check_markers(t, calls, [r[-1] for r in replies])
                    replies = [r[:-1] for r in replies]
                rows, row_clocks, missing = self._decode_values(
                    t, sorted_ids, order.numpy(), replies
                )
                result = PullResult(rows, row_clocks, None)
            else:
                for (b, _lo, _hi), r in zip(calls, replies, strict=True):
                    if int(r[3]) != 1:
                        raise self._gone(t, b, None)
                result, missing = self._decode_bounded(t, ids, order, calls, replies, caller, bound)
            self._note_absent(t, missing, epoch)
            m = int(result.rows.shape[0])
            with self._lock:
                t.counters["rows_pulled"] += m
                t.counters["rows_skipped_by_bound"] += n - m
            return result

        return cmds, finish

    def _with_state(
        self, p: _Pull, cmds: list[Command], decode: Callable[[list[Any]], PullResult]
    ) -> tuple[list[Command], Callable[[list[Any]], PullResult]]:
        """A pull ``with_state``: HMGETs of every requested row's state after its
        commands, in the same pipelined round trip, and its result with the state of
        the rows it returns (the pull's own commands and decoding otherwise)."""
        if not p.with_state:
            return cmds, decode
        reads, states = self._state_reads(p.t, p.ids)
        k = len(cmds)

        def finish(replies: list[Any]) -> PullResult:
            result = decode(replies[:k])
            state = states(replies[k:])  # [N, S] in request order
            if result.positions is not None:
                state = state[result.positions]
            return dataclasses.replace(result, state=state)

        return cmds + reads, finish

    def _state_reads(
        self, t: RedisTable, ids: torch.Tensor
    ) -> tuple[list[Command], Callable[[list[Any]], torch.Tensor]]:
        """The HMGETs of the optimizer state of ``ids`` ``[N]`` (none for a stateless
        table or no ids), and what decodes their replies: float32 ``[N, S]`` in request
        order, the initial state for rows not in Redis."""
        n, s = int(ids.shape[0]), t.spec.state_dim
        if n == 0 or s == 0:
            return [], lambda _replies: t.spec.initial_state().unsqueeze(0).repeat(n, 1)
        _sorted, _calls, cmds, order = self._hmgets(t, ids, t.s_keys)

        def decode(replies: list[Any]) -> torch.Tensor:
            flat = [v if v is not None else t.state0 for r in replies for v in r]
            got = np.frombuffer(b"".join(flat), dtype="<f4").reshape(n, s)
            state = torch.empty(n, s, dtype=torch.float32)
            state[order] = torch.from_numpy(got.copy())
            return state

        return cmds, decode

    def _split_bounded(
        self, p: _Pull, always: torch.Tensor, step: bytes, epoch: int
    ) -> tuple[list[Command], Callable[[list[Any]], PullResult]]:
        """A conditional pull whose ``always`` ids (caller clock ``< -bound``: a cache's
        misses) come back whatever Redis holds: those as a plain pull (HMGET, no clock
        compared in Lua, which costs twice as much per row), the rest conditionally; one
        result with the positions of both, in request order."""
        assert p.caller is not None
        at_a = torch.nonzero(always).squeeze(1)  # [A] positions of the plain part
        at_c = torch.nonzero(~always).squeeze(1)  # [C] positions of the conditional part
        cmds_a, finish_a = self._pull_commands(_Pull(p.t, p.ids[at_a], None, None), step, epoch)
        parts = [(cmds_a, finish_a, at_a)]
        if at_c.numel():
            sub = _Pull(p.t, p.ids[at_c], p.caller[at_c], p.bound)
            cmds_c, finish_c = self._pull_commands(sub, step, epoch)
            parts.append((cmds_c, finish_c, at_c))

        def finish(replies: list[Any]) -> PullResult:
            rows, clocks, positions, k = [], [], [], 0
            for cmds, fin, at in parts:
                got = fin(replies[k : k + len(cmds)])
                k += len(cmds)
                rows.append(got.rows)
                clocks.append(got.clocks)
                positions.append(at if got.positions is None else at[got.positions])
            pos = torch.cat(positions)
            rank = torch.argsort(pos, stable=True)
            return PullResult(torch.cat(rows)[rank], torch.cat(clocks)[rank], pos[rank])

        return [c for cmds, _, _ in parts for c in cmds], finish

    def _decode_values(
        self, t: RedisTable, sorted_ids: np.ndarray, order: np.ndarray, replies: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Rows ``[N, D]`` and clocks ``[N]`` in request order from HMGET-style replies,
        and the ids missing from Redis (int64 ``[M]``).

        ``replies`` hold the values of ``sorted_ids`` (None where Redis has no row);
        ``order`` maps them back: value ``k`` belongs to request position ``order[k]``.
        """
        wb, n = t.wb, int(sorted_ids.shape[0])
        rows = np.empty((n, t.spec.dim), dtype=np.float32)
        clocks = np.zeros(n, dtype=np.int64)
        missing = np.empty(0, dtype=np.int64)
        try:
            blob = b"".join(itertools.chain.from_iterable(replies))
            dest = order
        except TypeError:  # some rows are missing: initial rows, clock 0
            flat = list(itertools.chain.from_iterable(replies))  # [N] bytes | None
            present = np.fromiter((v is not None for v in flat), dtype=bool, count=n)
            blob = b"".join(v for v in flat if v is not None)
            miss = order[~present]
            missing = sorted_ids[~present].astype(np.int64)
            rows[miss] = t.initial_rows(torch.from_numpy(missing)).numpy()
            dest = order[present]
        got = np.frombuffer(blob, dtype=np.uint8).reshape(-1, wb + 8)  # [P, wb + 8]
        rows[dest] = t.widen(got[:, :wb])  # one copy, straight into request order
        clocks[dest] = got[:, wb:].view("<i8")[:, 0]
        return torch.from_numpy(rows), torch.from_numpy(clocks), missing

    def _decode_bounded(
        self,
        t: RedisTable,
        ids: torch.Tensor,
        order: torch.Tensor,
        calls: list[tuple[int, int, int]],
        replies: list[Any],
        caller: torch.Tensor,
        bound: int | None,
    ) -> tuple[PullResult, np.ndarray]:
        """The conditional pull's result, and the ids missing from Redis (int64 ``[M]``)."""
        assert bound is not None
        wb = t.wb
        pos_parts, miss_parts, blobs = [], [], []
        for (_b, lo, _hi), (vals, pos, miss, _ok) in zip(calls, replies, strict=True):
            if pos:
                pos_parts.append(np.frombuffer(pos, dtype="<i4").astype(np.int64) + (lo - 1))
                blobs.append(vals)
            if miss:
                miss_parts.append(np.frombuffer(miss, dtype="<i4").astype(np.int64) + (lo - 1))
        order_np = order.numpy()
        got_pos = order_np[np.concatenate(pos_parts)] if pos_parts else np.empty(0, np.int64)
        got = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(-1, wb + 8)
        # Missing rows have store clock 0: stale iff 0 > caller clock + bound.
        miss_pos = order_np[np.concatenate(miss_parts)] if miss_parts else np.empty(0, np.int64)
        missing = ids.numpy()[miss_pos]
        if miss_pos.size:
            miss_pos = miss_pos[(caller.numpy()[miss_pos] + bound) < 0]
        positions = np.concatenate([got_pos, miss_pos])
        rank = np.argsort(positions, kind="stable")
        m = positions.size
        rows = torch.empty(m, t.spec.dim, dtype=torch.float32)
        clocks = torch.zeros(m, dtype=torch.int64)
        k = got_pos.size
        rows[:k] = torch.from_numpy(t.widen(got[:, :wb].copy()))
        clocks[:k] = torch.from_numpy(got[:, wb:].copy().view("<i8").reshape(-1))
        if miss_pos.size:
            rows[k:] = t.initial_rows(ids[torch.from_numpy(miss_pos)])
        sel = torch.from_numpy(rank)
        result = PullResult(rows[sel], clocks[sel], torch.from_numpy(positions[rank]))
        return result, missing

    # ------------------------------------------------------------ pushes

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        push = self._checked_push(PushRequest(table, ids, grads))
        return self._push([push], f"push table {table!r} to Redis {self.address}")

    def push_many_async(self, requests: Sequence[PushRequest]) -> Handle:
        """Every table's push is checked first (a bad one raises and nothing is sent),
        then all of them go out together, applied in order: one pipelined round trip per
        Redis node they reach (see the module docstring for the rare second rounds)."""
        pushes = [self._checked_push(r) for r in check_requests(requests, PushRequest, "push_many")]
        names = ", ".join(repr(p.t.spec.name) for p in pushes)
        return self._push(pushes, f"push_many of tables {names} to Redis {self.address}")

    def _checked_push(self, r: PushRequest) -> _Push:
        """``r`` validated, its duplicate ids summed, its non-finite rows dropped (with
        ``nan_policy="skip"``; "raise" refused them in :func:`check_grads`)."""
        t = self._get(r.table)
        ids = check_ids(t.spec, r.ids, "push").cpu()
        finite = t.spec.nan_policy == "raise"
        grads = check_grads(t.spec, ids, r.grads, finite=finite).detach().cpu()
        counted = check_counted(t.spec, ids, r.counts, r.stats, takes=True, where="Redis")
        uniq, summed = ids, grads
        if ids.numel() and counted is None:
            uniq, summed = coalesce(ids, grads)  # [U], [U, D]
        elif ids.numel() and counted is not None:
            uniq, summed, counted = coalesce_counted(ids, grads, *counted)
        skipped = 0
        if summed.numel():
            ok = torch.isfinite(summed).all(dim=1)  # [U]
            if not bool(ok.all()):
                skipped = int((~ok).sum())
                uniq, summed = uniq[ok], summed[ok]
                if counted is not None:
                    counted = (counted[0][ok], counted[1][ok])
        if counted is not None and plain_counted(t.spec, uniq, counted[0]):
            counted = None  # coalesced to one update a row: the plain push
        return _Push(t, uniq, summed, skipped, counted)

    def _push(self, pushes: list[_Push], what: str) -> Handle:
        """Send ``pushes`` as one batch (each table's calls in the order given); the
        handle's ``wait()`` settles it (see :class:`PushSettle`)."""
        tables = list({id(p.t): p.t for p in pushes}.values())
        earlier = self._unsettled_of(tables)  # their second rounds must run before ours
        steps = self._steps([p.t for p in pushes], "INCR", what, PUSH)
        stream = _Stream(self._link, what, PUSH)  # each table's calls out as built
        first: list[Command] = []
        for p, step in zip(pushes, steps, strict=True):
            self._build_push(p, step)
            first.extend(p.first)
            stream.send(p.first)
        box: dict[str, Any] = {"batch": stream.batch}

        def run(limit: float | None) -> bool:
            """Replies, second round, eviction, counters; True if a second round was sent."""
            try:
                self._settle(earlier)  # their second rounds before ours: issue order
                earlier.clear()
                replies = self._replies(box.pop("batch"), first, what, limit, tables, PUSH)
                second = self._second_round(pushes, replies, what)
            finally:
                for p in pushes:
                    self._answered(p.t, p.calls, p.seqs)
            evicted = [self._evict(p.t, int(p.step)) if p.t.evicts else 0 for p in pushes]
            with self._lock:
                for p, gone in zip(pushes, evicted, strict=True):
                    c = p.t.counters
                    c["push_requests"] += 1
                    c["rows_pushed"] += int(p.uniq.numel())
                    c["rows_skipped_nan"] += p.skipped
                    c["rows_created"] += p.created
                    c["rows_evicted"] += gone
            return second

        with self._lock:
            settle = PushSettle(run, next(self._issued))
            for t in tables:
                t.pending.append(settle)

        def block(limit: float) -> None:
            settle(limit)

        return Handle(
            lambda: settle.done,
            lambda: settle(None),
            what=what,
            timeout_s=self._timeout_s,
            block=block,
        )

    def _build_push(self, p: _Push, step: bytes) -> None:
        """Number ``p``'s calls (one per bucket call) and build their commands.

        Ids this client last read as missing from Redis (:meth:`_note_absent`) get their
        initial rows in these first calls, so that a pull-then-push of new rows costs no
        second round."""
        t = p.t
        p.step = step
        order, calls = self._split(t, p.uniq)
        sorted_ids = p.uniq[order].numpy().astype("<i8")  # [U]
        g_bytes = p.summed[order].numpy().astype("<f4").tobytes()
        id_bytes = sorted_ids.tobytes()
        d4, wb = t.d4, t.wb  # a gradient's bytes, a stored row's weights' bytes
        k_bytes = s_bytes = b""  # counted: int32 [U] counts, float32 [U, Q] statistics
        q4 = 4 * t.spec.optimizer.stat_dim(t.spec.dim)
        if p.counted is not None:
            k_bytes = p.counted[0][order].numpy().astype("<i4").tobytes()
            s_bytes = p.counted[1][order].numpy().astype("<f4").tobytes()
        with self._lock:
            seqs = t.next_numbers([b for b, _lo, _hi in calls])  # [calls] (number, watermark)
            t.push_epoch += 1
            hinted = t.absent.take(sorted_ids)  # positions in sorted_ids [H]
        init_rows = b""  # [H, wb] the hinted ids' initial rows, as stored
        if hinted.size:
            first_ids = torch.from_numpy(sorted_ids[hinted].astype(np.int64))
            init_rows = t.stored(t.spec.initial_rows(first_ids)).tobytes()

        def command(
            k: int, rows: np.ndarray | None, numbers: tuple[int, int], done: int
        ) -> Command:
            """Call ``k`` (bucket, rows lo:hi) with the hinted ids' initial rows, or only its
            ``rows`` (0-based) all with their initial values, completing call number ``done``."""
            b, lo, hi = calls[k]
            if rows is None:
                ids_b, g_b = id_bytes[8 * lo : 8 * hi], g_bytes[d4 * lo : d4 * hi]
                k_b, s_b = k_bytes[4 * lo : 4 * hi], s_bytes[q4 * lo : q4 * hi]
                a, z = np.searchsorted(hinted, [lo, hi]).tolist()
                init = init_rows[wb * a : wb * z]
                init_pos = (hinted[a:z] - (lo - 1)).astype("<i4").tobytes()
            else:
                at = lo + rows
                ids_b = sorted_ids[at].tobytes()
                g_b = b"".join(g_bytes[d4 * j : d4 * (j + 1)] for j in at.tolist())
                k_b = b"".join(k_bytes[4 * j : 4 * (j + 1)] for j in at.tolist())
                s_b = b"".join(s_bytes[q4 * j : q4 * (j + 1)] for j in at.tolist())
                first = torch.from_numpy(sorted_ids[at].astype(np.int64))
                init = t.stored(t.spec.initial_rows(first)).tobytes()
                init_pos = np.arange(1, rows.size + 1, dtype="<i4").tobytes()
            keys = [t.w_keys[b], t.s_keys[b], t.t_keys[b], t.q_keys[b]]
            args: list[bytes | str | int] = [
                ids_b,
                g_b,
                init,
                init_pos,
                step,
                t.token,
                self._wid,
                self._session,
                numbers[0],
                numbers[1],
                done or b"",
            ]
            if p.counted is None:
                return evalsha(t.push_sha, t.push_src, keys, args)
            return evalsha(t.counted_sha, t.counted_src, keys, [*args, k_b, s_b])

        p.calls, p.seqs, p.command = calls, seqs, command
        p.first = [command(k, None, seqs[k], 0) for k in range(len(calls))]

    def write_many_async(self, requests: Sequence[WriteRequest]) -> Handle:
        """Every table's write is checked first (nothing is sent if one is bad), then
        every table's rows go in one pipelined round trip per Redis node, as a
        checkpoint's rows are written (``HSET`` of each bucket's rows with their clocks,
        and of their state; no script: a write sets values, so a resent one changes
        nothing more), before this call returns. A written row exists in Redis, so the
        read hints that it was missing are used up."""
        reqs = check_requests(requests, WriteRequest, "write_many")
        checked = []
        for r in reqs:
            t = self._get(r.table)
            check_write(t.spec, r.ids, r.rows, r.state, r.clocks)
            checked.append((t, r))
        names = ", ".join(repr(t.spec.name) for t, _ in checked)
        what = f"write_many of tables {names} to Redis {self.address}"
        cmds = []
        for t, r in checked:
            part = TablePart(r.ids, r.rows.detach(), r.state.detach(), r.clocks)
            cmds += row_commands(t, part, *self._split(t, r.ids))
        if cmds:
            self._replies(None, cmds, what, None, label=PUSH)
        for t, r in checked:
            with self._lock:
                t.absent.take(r.ids.numpy())
                t.counters["write_requests"] += 1
                t.counters["rows_written"] += int(r.ids.numel())
        return Handle.completed(None, what=what)

    def _numbers(self, t: RedisTable, buckets: list[int]) -> list[tuple[int, int]]:
        with self._lock:
            return t.next_numbers(buckets)

    def _answered(
        self, t: RedisTable, calls: list[tuple[int, int, int]], seqs: list[tuple[int, int]]
    ) -> None:
        with self._lock:
            t.numbers.answered(calls, seqs)

    def _second_round(self, pushes: list[_Push], replies: list[Any], what: str) -> bool:
        """Count the rows the first calls created; send the rows they skipped (missing from
        Redis, no initial row given) with their initial values, as new calls (new numbers),
        every table's in one batch. True if any were sent."""
        need: list[tuple[_Push, int, np.ndarray]] = []  # (push, call, 0-based rows in it)
        at = 0
        for p in pushes:
            for k, r in enumerate(replies[at : at + len(p.calls)]):
                if int(r[0]) == PUSH_GONE:
                    raise self._gone(p.t, p.calls[k][0], None)
                p.created += int(r[1])
                if r[2]:
                    need.append((p, k, np.frombuffer(r[2], dtype="<i4").astype(np.int64) - 1))
            at += len(p.calls)
        if not need:
            return False
        cmds: list[Command] = []
        owners: list[tuple[_Push, int]] = []  # per command: its push and bucket
        numbered: list[tuple[_Push, list[tuple[int, int, int]], list[tuple[int, int]]]] = []
        for p in pushes:
            mine = [(k, m) for q, k, m in need if q is p]
            if not mine:
                continue
            more = [p.calls[k] for k, _m in mine]
            numbers = self._numbers(p.t, [b for b, _lo, _hi in more])
            numbered.append((p, more, numbers))
            for (k, m), nums in zip(mine, numbers, strict=True):
                cmds.append(p.command(k, m, nums, p.seqs[k][0]))
                owners.append((p, p.calls[k][0]))
        tables = list({id(p.t): p.t for p, _m, _n in numbered}.values())
        try:
            again = self._replies(None, cmds, what, self._timeout_s, tables, PUSH)
        finally:
            for p, more, numbers in numbered:
                self._answered(p.t, more, numbers)
        for (p, b), r in zip(owners, again, strict=True):
            if int(r[0]) == PUSH_GONE:
                raise self._gone(p.t, b, None)
            assert not r[2], "rows missing despite their initial rows"
            p.created += int(r[1])
        return True

    def request_counts(self) -> dict[str, int]:
        """Round trips this client made for pulls and for pushes, summed over the Redis
        nodes: a request (one table's, or a batch of several) costs one per node it
        reaches; more only for tables with eviction (their steps, the eviction), rows a
        push had to create in a second round, resends after lost replies and cluster
        redirects. ``servers``: the nodes (1, or the cluster's masters)."""
        trips = self._link.round_trips()
        return {
            "pull_messages": trips.get(PULL, 0),
            "push_messages": trips.get(PUSH, 0),
            "servers": len(self._link.masters()),
        }

    # ------------------------------------------------------------ eviction

    def _evict(self, t: RedisTable, step: int) -> int:
        what = f"evict rows of table {t.spec.name!r} on Redis {self.address}"
        return evict(self._link, self._sha_evict, t, step, what, PUSH)

    # ------------------------------------------------------------ inspection

    def _fetch(
        self, t: RedisTable, ids: torch.Tensor, keys: list[bytes], what: str
    ) -> tuple[np.ndarray, list[Any], torch.Tensor]:
        """HMGET ``ids`` from the bucket hashes ``keys`` (the rows hashes: their markers are
        checked too). This client's pushes on ``t`` are settled first (issue order)."""
        self._settle(self._unsettled(t))
        sorted_ids, calls, cmds, order = self._hmgets(t, ids, keys)
        marked = keys is t.w_keys
        replies = self._replies(None, cmds, what, self._timeout_s)
        if marked:
            self._check_markers(t, calls, [r[0] for r in replies])
            replies = [r[1:] for r in replies]
        return sorted_ids, replies, order

    def _hmgets(
        self, t: RedisTable, ids: torch.Tensor, keys: list[bytes]
    ) -> tuple[np.ndarray, list[tuple[int, int, int]], list[Command], torch.Tensor]:
        """One HMGET of ``ids`` per bucket hash of ``keys`` (the rows hashes: with their
        marker first): ``(sorted ids, (bucket, lo, hi) per command, commands, order)``."""
        order, calls = self._split(t, ids)
        sorted_ids = ids[order].numpy().astype("<i8")
        fields = bulk_rows([sorted_ids.view(np.uint8).reshape(-1, 8)])
        cmds = []
        for b, lo, hi in calls:
            head: list[bytes | str | int] = ["HMGET", keys[b]]
            if keys is t.w_keys:
                head.append(MARKER)
            cmds.append(raw(keys[b], pack_fixed(head, fields[lo:hi], 1)))
        return sorted_ids, calls, cmds, order

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Clocks of rows ``ids`` ``[N]`` (0 for rows not in Redis); touches nothing."""
        t = self._get(table)
        ids = check_ids(t.spec, ids, "clocks").cpu()
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        sorted_ids, replies, order = self._fetch(t, ids, t.w_keys, f"clocks of {table!r}")
        return self._decode_values(t, sorted_ids, order.numpy(), replies)[1]  # clocks

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of rows ``ids`` ``[N, S]`` (initial state for rows not in Redis)."""
        return self.state_many([(table, ids)])[0]

    def state_many(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Every table's state HMGETs in one pipelined round trip per node (after this
        client's pushes on those tables are settled: issue order)."""
        parts: list[tuple[Callable[[list[Any]], torch.Tensor], int, int]] = []
        cmds: list[Command] = []
        for table, ids in requests:
            t = self._get(table)
            self._settle(self._unsettled(t))
            reads, decode = self._state_reads(t, check_ids(t.spec, ids, "state").cpu())
            parts.append((decode, len(cmds), len(cmds) + len(reads)))
            cmds += reads
        names = ", ".join(repr(t) for t, _ in requests)
        replies = self._replies(None, cmds, f"state of {names}", self._timeout_s) if cmds else []
        return [decode(replies[lo:hi]) for decode, lo, hi in parts]

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per table: ``rows`` (fixed: num_rows; dynamic: rows in Redis), ``rows_stored``,
        ``bytes`` (payload in Redis), ``buckets`` and this client's counters."""
        out: dict[str, dict[str, int | float]] = {}
        for name in self.tables():
            t = self._get(name)
            b = t.buckets
            cmds = [raw(k, pack(["HLEN", k])) for k in t.w_keys]
            cmds += [raw(k, pack(["HEXISTS", k, WIDE])) for k in t.w_keys]
            cmds += [raw(k, pack(["HMGET", k, "@applied", "@dup"])) for k in t.q_keys]
            got = self._link.run(cmds, f"stats of table {name!r}")
            # Each bucket's rows hash also holds its marker and (a table created by an
            # earlier version may lack it) its wide field.
            lengths, wide = got[:b], got[b : 2 * b]
            stored = sum(max(0, int(n) - 1 - int(w)) for n, w in zip(lengths, wide, strict=True))
            applied = sum(int(r[0] or 0) for r in got[2 * b :])
            repeated = sum(int(r[1] or 0) for r in got[2 * b :])
            row_bytes = t.spec.row_bytes
            rows = t.spec.num_rows if t.spec.num_rows is not None else stored
            entry: dict[str, int | float] = {
                "rows": rows,
                "rows_stored": stored,
                "bytes": stored * row_bytes,
                "buckets": t.buckets,
                "push_calls_applied": applied,
                "push_calls_repeated": repeated,
            }
            with self._lock:
                entry.update(t.counters)
            out[name] = entry
        return out

    # ------------------------------------------------------------ checkpoints

    def _table_parts(self, t: RedisTable) -> Iterator[TablePart]:
        what = f"save table {t.spec.name!r} from Redis {self.address}"
        return table_parts(
            self._link, self._sha_snapshot, t, what, lambda b: self._gone(t, b, None)
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every table under this prefix to the checkpoint folder ``path`` (atomic).

        Only rows present in Redis are written (untouched rows of a fixed table are
        initial rows, which every store's load recreates).
        """
        names = self.tables()
        with self._lock:
            lost = [t for name, t in self._tables.items() if name not in names]
        if lost:  # tables this client used are no longer listed: not a checkpoint to write
            raise self._gone(lost[0], None, None)
        used = [self._get(n) for n in names]
        for t in used:
            self._settle(self._unsettled(t))  # every push issued before the save is in it
        tables = [(t.spec, self._table_parts(t)) for t in used]
        write_checkpoint(path, tables, writer=type(self).__name__)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Replace (or create) every table of the checkpoint at ``path`` with its rows.

        The checkpoint is read and checked before Redis changes. Each table's keys are
        deleted and rewritten; clients using the table meanwhile see it half loaded.
        Eviction ages of dynamic tables restart at the load (step 0).
        """
        ckpt = read_checkpoint(path)
        parts = {spec.name: ckpt.read_table(spec.name) for spec in ckpt.specs}
        for spec in ckpt.specs:
            check_key_part("table name", spec.name)
            push_script(spec.optimizer, spec.dim)  # unsupported optimizer: fail before writing
        for spec in ckpt.specs:
            self._load_table(spec, parts[spec.name])

    def _load_table(self, spec: TableSpec, part: TablePart) -> None:
        what = f"load table {spec.name!r} into Redis {self.address}"
        key = self._meta_key(spec.name)
        old = self._link.command(key, "GET", key, what=what)
        buckets = self._buckets
        if old is not None:
            # The same buckets; the same token if the spec is the same (clients that have
            # the table open go on), else a new one (they must open it again).
            old_spec, buckets, token = self._parse_meta(spec.name, old)
            if old_spec.to_json() != spec.to_json():
                token = self._new_token(spec.name, what, replace=True)
        else:
            token = self._new_token(spec.name, what)
        t = self._make_table(spec, buckets, token)
        # Each bucket emptied and marked in one script (no moment without its marker).
        # The :q hashes stay: a push resent across the load is still a repeat.
        cmds = [
            evalsha(
                self._sha_reset,
                RESET_BUCKET,
                [t.w_keys[b], t.s_keys[b], t.t_keys[b]],
                [token, WIDE_VALUE, "1" if spec.state_dim > 0 else "0"],
            )
            for b in range(buckets)
        ]
        self._link.run(cmds + [raw(t.step_key, pack(["DEL", t.step_key]))], what)
        meta = meta_json(spec, buckets, token)
        self._link.command(key, "SET", key, meta, what=what)
        if old is None:
            lst = self._key("tables")
            self._link.command(lst, "RPUSH", lst, spec.name, what=what)
        with self._lock:
            self._tables[spec.name] = t
        self._write_rows(t, part, what)
        if t.evicts:
            self._link.command(t.step_key, "SET", t.step_key, 0, what=what)
            if spec.capacity is not None:
                evict_lru(self._link, self._sha_evict, t, spec.capacity, what)
        with self._lock:
            t.counters = dict.fromkeys(CLIENT_COUNTERS, 0)

    def _write_rows(self, t: RedisTable, part: TablePart, what: str) -> None:
        if part.num_rows:
            order, calls = self._split(t, part.ids)
            write_rows(self._link, t, part, order, calls, what)

    # ------------------------------------------------------------ admin

    def drop_table(self, table: str) -> None:
        """Delete ``table``'s rows and metadata from Redis (every client loses it).

        The meta goes first (one DEL: of several clients dropping at once, one deletes
        it and the others are told the table is unknown), then the buckets."""
        what = f"drop table {table!r}"
        t = self._get(table)
        key = self._meta_key(table)
        deleted = int(self._link.command(key, "DEL", key, what=what))
        with self._lock:
            self._tables.pop(table, None)
        if not deleted:  # another client dropped it since this one opened it
            raise unknown_table(table, self.tables())
        keys = t.w_keys + t.s_keys + t.t_keys + t.q_keys + [t.step_key, self._token_key(table)]
        self._link.run([raw(k, pack(["DEL", k])) for k in keys], what)
        lst = self._key("tables")
        self._link.command(lst, "LREM", lst, 0, table, what=what)

    def close(self) -> None:
        self._link.close()
