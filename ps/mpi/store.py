"""The worker side of the MPI store: a :class:`ps.Store` whose shards live on server ranks.

Run a job as ``mpirun -n N`` with ``topology = comm.Topology(world_size=N,
num_servers=S)``: the last ``S`` ranks call :func:`ps.mpi.server.serve_mpi`, the
others open an :class:`MPIStore` and use it like any store::

    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=2)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)            # returns when every worker closed its store
    else:
        with MPIStore(group, topology) as store:
            if group.rank == 0:
                store.create_table(spec)
            ...                                   # pull / push / save / load / stats

Both constructors are collective over ``group`` (they duplicate its
communicator, so parameter-server traffic never mixes with other messages);
every rank must make exactly one of the two calls, in the same order relative to
other collectives on ``group``.

Every request is a batch (``pull_async`` / ``push_async`` are batches of one
table): each table's ids are split by :func:`ps.routing.group_by_shard` (row ``id``
lives on server ``shard_of(id, S)``) and each server gets ONE ``PULL_MANY`` /
``PUSH_MANY`` message with its share of every table, all sent at once without
blocking; the handle's ``wait()`` merges the replies back into the caller's order.
Messages are the binary layout of :mod:`ps.mpi.wire` (no pickle). Several requests
may be in flight; the requests of one worker are applied in the order they were issued.
A narrow table's (``TableSpec.dtype`` fp16 / bf16) rows come back in its type and are
widened to float32 here; its gradients are rounded to its type (to nearest) before they
are sent, half the bytes, and a gradient that this makes Inf is refused like a NaN one.

Semantics that differ from the in-process store, because the table is sharded:

* ``capacity`` of a dynamic table is split evenly: each of the ``S`` servers
  keeps at most ``ceil(capacity / S)`` rows (LRU within the shard);
* ``stats()`` sums the servers' counters, so ``pull_requests`` /
  ``push_requests`` count per-server sub-requests;
* a push to a table with ``max_age_steps`` goes to every server (an empty one
  where no id routes), so every shard counts the table's pushes like the
  in-process store does;
* ``save`` writes one consistent snapshot per server, not across servers: stop
  pushing (e.g. a barrier of the workers) before saving for a global snapshot.
* servers and workers must share the checkpoint's filesystem.

Dead servers: every ``wait()`` gives up after ``request_timeout_s`` and raises
:class:`comm.CommTimeoutError` naming the server ranks that did not answer.
(With MPICH's default launcher a rank that dies takes the whole job down at
once; the timeout covers hung servers and ``mpiexec -disable-auto-cleanup``.)

Exactly-once pushes: a push whose reply has not come ``push_retry_s`` after it
was sent is resent unchanged, at most ``max_retries`` times while its handle is
waited; its sequence number makes the server acknowledge a repeat without applying
it (``docs/ps_protocol.md``). ``stats()`` adds this worker's ``worker_push_calls``
(push sub-requests sent), ``worker_push_retries`` (resends) and
``worker_push_duplicates`` (replies that said "repeat") to the servers' counters,
which include ``push_duplicates``.

Tables: ``create_table(spec, exist_ok=True)`` may be called by every worker at once
(server 0 decides first; see ``docs/ps_protocol.md``), ``drop_table`` drops a table on
every server.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import secrets
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from comm import CommTimeoutError, Handle, ProcessGroup, Topology
from ps import checkpoint
from ps.group_requests import GroupPull, GroupPush, GroupWrite, sorted_push
from ps.mpi import group_messages, wire
from ps.mpi.server import check_mpi_topology, check_push_grads
from ps.mpi.wire import HEADER_LEN, Op
from ps.routing import group_by_shard
from ps.store import (
    PullRequest,
    PullResult,
    PushRequest,
    Store,
    WriteRequest,
    check_requests,
    first_of,
)
from ps.table import TableSpec
from ps.validate import (
    all_finite,
    check_counted,
    check_ids,
    check_pull_bound,
    check_write,
    finite_rows,
    unknown_table,
)

_EMPTY_F32 = np.empty(0, dtype=np.float32)


@dataclass(slots=True, eq=False)
class _Call:
    """One sub-request to one server: its MPI requests and reply buffers."""

    server: int  # MPI rank
    request_id: int
    op: int
    requests: list[Any]  # [recv meta, recv data, send meta, send data, resends...]
    reply: np.ndarray  # int64 [HEADER_LEN + K]
    data: np.ndarray  # float32 reply buffer (may be a view into the caller's output)
    started: float  # time.monotonic() when sent
    # What a resend needs (pushes only): the request's two buffers.
    sent: tuple[np.ndarray, np.ndarray] | None = None
    last_sent: float = 0.0
    retries: int = 0
    names: list[str] = field(default_factory=list)  # tables of a batched push

    def done(self) -> bool:
        return bool(MPI.Request.Testall(self.requests))

    def check(self, what: str) -> np.ndarray:
        """The reply header (after raising the error it carries, if any)."""
        where = f"{what} (server rank {self.server})"
        head = wire.check_header(self.reply, where)
        if int(head[wire.W_ID]) != self.request_id:
            raise RuntimeError(
                f"{where}: reply is for request {int(head[wire.W_ID])}, expected "
                f"{self.request_id}; the protocol is out of step"
            )
        wire.raise_if_error(self.reply, where)
        if int(head[wire.W_OP]) != self.op:
            raise RuntimeError(f"{where}: reply op {int(head[wire.W_OP])}, expected {self.op}")
        return head

    def text(self) -> str:
        return wire.unpack_bytes(self.reply[HEADER_LEN:], int(self.reply[wire.W_ARG])).decode()


@dataclass(slots=True)
class _Table:
    spec: TableSpec
    index: list[int] = field(default_factory=list)  # the table's index on each server


@dataclass(slots=True)
class _Stray:
    """Replies that may still come for a request that was resent (the first was only late)."""

    server: int
    meta_tag: int
    data_tag: int
    left: int  # at most this many more
    until: float  # stop looking (monotonic time)


class MPIStore(Store):
    """A store whose tables are sharded over the server ranks of ``topology``.

    ``request_timeout_s`` bounds every wait for a reply (a server that died or
    hangs raises :class:`comm.CommTimeoutError` naming its rank). A push whose
    reply is ``push_retry_s`` late (default ``request_timeout_s / 3``) is resent
    with the same sequence number, at most ``max_retries`` times (see the module
    docstring).
    """

    # Pushes carry sequence numbers (exactly-once). Only a test subclass turns them off,
    # to show what a resend does without them.
    _sequenced = True
    counted_pushes = True
    value_writes = True

    def __init__(
        self,
        group: ProcessGroup,
        topology: Topology,
        *,
        request_timeout_s: float = 30.0,
        push_retry_s: float | None = None,
        max_retries: int = 2,
    ) -> None:
        mpi_comm = check_mpi_topology(group, topology, "MPIStore")
        if group.rank not in topology.worker_ranks:
            raise ValueError(
                f"MPIStore: rank {group.rank} is a server in {topology}; workers are ranks "
                f"{topology.worker_ranks} (servers call ps.mpi.server.serve_mpi)"
            )
        t = request_timeout_s
        if (
            not isinstance(t, int | float)
            or isinstance(t, bool)
            or not (math.isfinite(t) and t > 0)
        ):
            raise ValueError(f"MPIStore: request_timeout_s must be a number > 0, got {t!r}")
        r = t / 3 if push_retry_s is None else push_retry_s
        if (
            not isinstance(r, int | float)
            or isinstance(r, bool)
            or not (math.isfinite(r) and r > 0)
        ):
            raise ValueError(f"MPIStore: push_retry_s must be None or a number > 0, got {r!r}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"MPIStore: max_retries must be an int >= 0, got {max_retries!r}")
        self.rank = group.rank
        self.request_timeout_s = float(request_timeout_s)
        self.push_retry_s = float(r)
        self.max_retries = max_retries
        self._session = secrets.randbits(63)  # this store's pushes, told apart from earlier ones
        self._seq: dict[int, int] = {}  # server number -> the last push number sent to it
        self._strays: list[_Stray] = []
        # This worker's exactly-once counters per table (see stats()).
        self._counters: dict[str, dict[str, int]] = {}
        self._servers = topology.server_ranks
        self._comm = mpi_comm.Dup()
        self._tag_ub = int(self._comm.Get_attr(MPI.TAG_UB))
        self._tables: dict[str, _Table] = {}
        self._next_id = 0
        # Sub-requests that may still be in flight: MPI writes into their buffers until
        # they complete, so they are held here even if the caller drops the handle.
        self._pending: set[_Call] = set()
        self._dead: set[int] = set()  # server ranks that let a request time out
        self._closed = False
        # A store left open at exit would keep the servers waiting for its goodbye (and
        # MPI_Finalize waiting for the servers): close it first. atexit handlers run
        # last-in first-out, so this runs before mpi4py's MPI_Finalize.
        self._at_exit = _close_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    def __repr__(self) -> str:
        return f"MPIStore(rank={self.rank}, servers={self._servers})"

    def __enter__(self) -> MPIStore:
        return self

    @property
    def server_ranks(self) -> list[int]:
        return list(self._servers)

    # ------------------------------------------------------------ plumbing

    def _start(
        self,
        s: int,
        op: int,
        *,
        payload: tuple[np.ndarray, ...] = (),
        data: np.ndarray = _EMPTY_F32,
        reply_words: int = 0,
        reply_data: np.ndarray = _EMPTY_F32,
        table: int = -1,
        n: int = 0,
        dim: int = 0,
        flags: int = 0,
        arg: int = 0,
        resendable: bool = False,
    ) -> _Call:
        """Send one request to server number ``s``; the receives are posted first.

        ``resendable``: keep the request's buffers so that :meth:`_resend` can send
        it again (pushes)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._servers[s] in self._dead:
            raise CommTimeoutError(
                f"server rank {self._servers[s]} did not answer an earlier request within "
                f"{self.request_timeout_s:g} s; this MPIStore no longer sends to it"
            )
        rid = self._next_id
        self._next_id += 1
        if rid % 64 == 0:
            # Forget requests that completed: the caller's handle (if it still has one)
            # keeps them alive for wait(); dropped handles then free their buffers.
            self._pending = {c for c in self._pending if not c.done()}
            if self._strays:
                self._drain_strays()
        head = wire.header(op, rid, table=table, n=n, dim=dim, flags=flags, arg=arg)
        meta = wire.message(head, *payload)
        dest = self._servers[s]
        reply = np.empty(HEADER_LEN + max(reply_words, wire.ERROR_WORDS), dtype=np.int64)
        meta_tag, data_tag = wire.reply_tags(rid, self._tag_ub)
        c = self._comm
        reqs = [
            c.Irecv([reply, MPI.INT64_T], source=dest, tag=meta_tag),
            c.Irecv([reply_data, MPI.FLOAT], source=dest, tag=data_tag),
            c.Isend([meta, MPI.INT64_T], dest=dest, tag=wire.TAG_REQUEST),
            c.Isend([data, MPI.FLOAT], dest=dest, tag=wire.TAG_REQUEST_DATA),
        ]
        now = time.monotonic()
        call = _Call(dest, rid, op, reqs, reply, reply_data, now, last_sent=now)
        if resendable:
            call.sent = (meta, data)
        self._pending.add(call)
        return call

    def _resend(self, call: _Call) -> None:
        """Send ``call``'s request again, unchanged; its posted receives take whichever
        reply comes first (a later one is drained as a stray)."""
        assert call.sent is not None, "only pushes are resent"
        meta, data = call.sent
        c = self._comm
        call.requests.append(c.Isend([meta, MPI.INT64_T], dest=call.server, tag=wire.TAG_REQUEST))
        call.requests.append(
            c.Isend([data, MPI.FLOAT], dest=call.server, tag=wire.TAG_REQUEST_DATA)
        )
        call.retries += 1
        call.last_sent = time.monotonic()

    def _drain_strays(self) -> None:
        """Receive and drop second replies to resent pushes that have come by now."""
        status = MPI.Status()
        now = time.monotonic()
        keep = []
        for s in self._strays:
            while s.left > 0 and self._comm.Iprobe(s.server, s.meta_tag, status):
                junk = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                self._comm.Recv([junk, MPI.BYTE], source=s.server, tag=s.meta_tag)
                self._comm.Probe(source=s.server, tag=s.data_tag, status=status)
                junk = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                self._comm.Recv([junk, MPI.BYTE], source=s.server, tag=s.data_tag)
                s.left -= 1
            if s.left > 0 and now < s.until:
                keep.append(s)
        self._strays = keep

    def _count(self, table: str, key: str, n: int = 1) -> None:
        per = self._counters.setdefault(
            table,
            {"worker_push_calls": 0, "worker_push_retries": 0, "worker_push_duplicates": 0},
        )
        per[key] += n

    def _handle(self, calls: list[_Call], finish: Callable[[], Any], what: str) -> Handle:
        """A handle that completes when every call has its reply; ``finish`` builds the result."""

        def test() -> bool:
            return all(c.done() for c in calls)

        def block(limit: float) -> None:
            deadline = time.monotonic() + limit
            n = 0
            while not test():
                n += 1
                if n & 63 == 0:
                    now = time.monotonic()
                    for c in calls:
                        if (
                            c.sent is not None
                            and c.retries < self.max_retries
                            and now - c.last_sent >= self.push_retry_s
                            and now - c.started < self.request_timeout_s
                            and not c.done()
                        ):
                            self._resend(c)
                    if now > deadline:
                        late = [c for c in calls if not c.done()]
                        # Only a server silent for request_timeout_s counts as dead (not
                        # one that missed a short timeout the caller chose for wait()).
                        self._dead.update(
                            c.server for c in late if now - c.started >= self.request_timeout_s
                        )
                        late_ranks = sorted({c.server for c in late})
                        raise CommTimeoutError(
                            f"{what} on worker rank {self.rank}: no reply from server rank(s) "
                            f"{late_ranks} within {limit:g} s; the server may have died or hang "
                            "(MPIStore request_timeout_s)"
                        )
                    os.sched_yield()

        def done() -> Any:
            self._pending.difference_update(calls)
            for c in calls:
                if c.retries:
                    tags = wire.reply_tags(c.request_id, self._tag_ub)
                    until = time.monotonic() + 2 * self.request_timeout_s
                    self._strays.append(_Stray(c.server, *tags, left=c.retries, until=until))
            for c in calls:
                c.check(what)
            return finish()

        return Handle(test, done, what=what, timeout_s=self.request_timeout_s, block=block)

    def _all(
        self,
        op: int,
        text: str = "",
        what: str = "",
        *,
        servers: Iterable[int] | None = None,
        flags: int = 0,
    ) -> list[_Call]:
        """Send a text request to every server (or server numbers ``servers``) and wait
        for all replies."""
        raw = text.encode("utf-8")
        calls = [
            self._start(
                s,
                op,
                payload=(wire.pack_bytes(raw),),
                arg=len(raw),
                reply_words=wire.TEXT_WORDS,
                flags=flags,
            )
            for s in (range(len(self._servers)) if servers is None else servers)
        ]
        self._handle(calls, lambda: None, what).wait()
        return calls

    def _split(self, ids: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        """``(order, counts)`` of the per-server sub-requests (order None: one server)."""
        if len(self._servers) == 1:
            return None, [int(ids.numel())]
        order, counts = group_by_shard(ids, len(self._servers))
        return order, counts.tolist()

    # ------------------------------------------------------------ tables

    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        """Create ``spec.name`` on every server; see :meth:`ps.Store.create_table`.

        Server 0 decides first (it serves one request at a time, so of several
        workers creating the table at once exactly one creates it there, and a
        different spec is refused before any other server has it); the other
        servers follow only once server 0 accepted.
        """
        if not isinstance(spec, TableSpec):
            raise TypeError(f"create_table: expected a ps.TableSpec, got {type(spec).__name__}")
        what = f"create_table {spec.name!r}"
        text = json.dumps(spec.to_json())
        flags = wire.FLAG_EXIST_OK if exist_ok else 0
        first = self._all(Op.CREATE, text, what, servers=[0], flags=flags)
        # The rest with exist_ok: a worker that lost the race at server 0 raised there.
        rest = self._all(
            Op.CREATE, text, what, servers=range(1, len(self._servers)), flags=wire.FLAG_EXIST_OK
        )
        self._tables[spec.name] = _Table(spec, [int(c.reply[wire.W_TABLE]) for c in first + rest])

    def drop_table(self, table: str) -> None:
        """Delete ``table`` on every server (other workers' next request on it fails)."""
        if not isinstance(table, str):
            raise unknown_table(table, self.tables())
        self._tables.pop(table, None)
        self._all(Op.DROP, table, f"drop_table {table!r}")

    def tables(self) -> list[str]:
        call = self._start(0, Op.LIST, reply_words=wire.TEXT_WORDS)
        self._handle([call], lambda: None, "tables").wait()
        names: list[str] = json.loads(call.text())
        return names

    def spec(self, table: str) -> TableSpec:
        return self._table(table).spec

    def _table(self, name: str) -> _Table:
        t = self._tables.get(name) if isinstance(name, str) else None
        if t is not None:
            return t
        if not isinstance(name, str):
            raise unknown_table(name, self._tables)
        calls = self._all(Op.LOOKUP, name, f"table {name!r}")
        t = _Table(
            TableSpec.from_json(calls[0].text()), [int(c.reply[wire.W_TABLE]) for c in calls]
        )
        self._tables[name] = t
        return t

    # ------------------------------------------------------------ rows

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        """A batch of one table (:meth:`pull_many_async`)."""
        batch = self.pull_many_async([PullRequest(table, ids, clocks, bound)])
        return first_of(batch, f"pull {table!r}")

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        """A batch of one table (:meth:`push_many_async`)."""
        return self.push_many_async([PushRequest(table, ids, grads)])

    # ------------------------------------------------------------ batched rows

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Every table's pull checked, then ONE ``PULL_MANY`` message per server that
        holds any of the ids (its share of every table, back to back); ``wait()``
        gives one :class:`ps.PullResult` per request, in order. ``with_state``: when
        every request asks for it, the ``PULL_MANY`` says so (``FLAG_STATE``) and each
        returned row comes back with its optimizer state after it, read by the server in
        the same pass; else one ``STATE`` message per table and server for every
        requested id of those that ask, sent right after the pulls (a server answers one
        worker's messages in order, so it reads the state the pull's rows have). The
        result keeps the returned rows' state."""
        plans = []
        reqs = check_requests(requests, PullRequest, "pull_many")
        # Every request wants its rows' state: it rides in the pull's reply, each row
        # [dim + state_dim] wide (the plans' widths), split off in finish().
        inline = bool(reqs) and all(r.with_state for r in reqs)
        for r in reqs:
            t = self._table(r.table)
            ids = check_ids(t.spec, r.ids, "pull")
            caller = check_pull_bound(t.spec, ids, r.clocks, r.bound)
            order, counts = self._split(ids)
            clk = None if caller is None else _sorted_np(caller, order)
            bound = -1 if caller is None else int(r.bound or 0)
            width = t.spec.dim + (t.spec.state_dim if inline else 0)
            plans.append(
                _PullPlan(r.table, t, _sorted_np(ids, order), clk, bound, order, counts, width)
            )
        calls: list[_Call] = []
        layout: list[list[tuple[int, int, int]]] = []  # per call: (plan, start, count)
        for s in range(len(self._servers)):
            parts = [(i, sum(p.counts[:s]), p.counts[s]) for i, p in enumerate(plans)]
            parts = [x for x in parts if x[2] > 0]
            if not parts:
                continue
            toc = np.empty((len(parts), wire.PULL_PART_WORDS), dtype=np.int64)
            words: list[np.ndarray] = [toc]
            reply_words, floats = len(parts) * wire.REPLY_PART_WORDS, 0
            for j, (i, a, c) in enumerate(parts):
                p = plans[i]
                spec = p.table.spec
                toc[j] = (p.table.index[s], c, wire.width_word(spec.dim, spec.dtype), p.bound)
                words.append(p.ids[a : a + c])
                if p.clocks is not None:
                    words.append(p.clocks[a : a + c])
                reply_words += c * (2 if p.clocks is not None else 1)
                floats += p.data_words(c)
            calls.append(
                self._start(
                    s,
                    Op.PULL_MANY,
                    payload=tuple(words),
                    reply_words=reply_words,
                    reply_data=np.empty(floats, dtype=np.float32),
                    table=len(parts),
                    n=sum(c for _, _, c in parts),
                    flags=wire.FLAG_STATE if inline else 0,
                )
            )
            layout.append(parts)

        # The state reads, in flight beside the pulls: [(request index, result())].
        states = [
            (i, self._start_gather(r.table, r.ids, Op.STATE, "state"))
            for i, r in enumerate(reqs)
            if r.with_state and not inline
        ]

        def finish() -> list[PullResult]:
            got: list[list[tuple[int, int, np.ndarray, np.ndarray | None, np.ndarray]]] = [
                [] for _ in plans
            ]  # per plan: (start, asked, clocks [m], positions [m] | None, rows [m, D])
            for call, parts in zip(calls, layout, strict=True):
                _split_pull_reply(call, parts, plans, got)
            out = [p.merge(g) for p, g in zip(plans, got, strict=True)]
            for i, p in enumerate(plans if inline else ()):
                d = p.table.spec.dim  # rows [M, dim + state_dim]: values, then state
                wide = out[i].rows
                out[i] = dataclasses.replace(
                    out[i], rows=wide[:, :d].contiguous(), state=wide[:, d:].contiguous()
                )
            for i, (_calls, result) in states:
                state = result()  # [N, S], every requested id
                back = out[i].positions
                out[i] = dataclasses.replace(out[i], state=state if back is None else state[back])
            return out

        every = calls + [c for _, (cs, _) in states for c in cs]
        return self._handle(every, finish, "pull_many " + _names(plans))

    def push_many_async(self, requests: Sequence[PushRequest]) -> Handle:
        """Every table's push checked (all rows, before any server changes anything),
        then ONE ``PUSH_MANY`` message per server with rows to apply, sent with one
        exactly-once sequence number per server."""
        plans = []
        for r in check_requests(requests, PushRequest, "push_many"):
            t = self._table(r.table)
            ids = check_ids(t.spec, r.ids, "push")
            grads = check_push_grads(t.spec, ids, r.grads)
            counted = check_counted(t.spec, ids, r.counts, r.stats, takes=True, where="MPI")
            order, counts = self._split(ids)
            g = wire_grads(t.spec, ids, grads.detach().cpu())  # [N, D] in the table's type
            g = g if order is None else g.index_select(0, order)  # [N, D] shard order
            if counted is not None:
                k, q = counted if order is None else (counted[0][order], counted[1][order])
                counted = (k, q)
            plans.append((r.table, t, _sorted_np(ids, order), g, counts, counted))
        calls: list[_Call] = []
        for s in range(len(self._servers)):
            parts = [
                (i, sum(counts[:s]), counts[s])
                for i, (_, t, _, _, counts, _) in enumerate(plans)
                if counts[s] > 0 or t.spec.max_age_steps is not None  # every shard counts
            ]
            if not parts:
                continue
            toc = np.empty((len(parts), wire.PUSH_PART_WORDS), dtype=np.int64)
            words: list[np.ndarray] = [toc]
            data = []
            for j, (i, a, c) in enumerate(parts):
                _, t, ids_np, g, _, _ = plans[i]
                toc[j] = (t.index[s], c, wire.width_word(t.spec.dim, t.spec.dtype))
                words.append(ids_np[a : a + c])
                data.append(wire.pack_values(g[a : a + c]))
            both = None
            if any(plans[i][5] is not None for i, _, _ in parts):
                # Every part's counts and statistics (a plain part's ones and zeros).
                k_parts, q_parts = [], []
                for i, a, c in parts:
                    spec, counted = plans[i][1].spec, plans[i][5]
                    if counted is None:  # a plain part: one update per row
                        width = spec.optimizer.stat_dim(spec.dim)
                        k_parts.append(np.ones(c, dtype=np.int64))
                        q_parts.append(np.zeros(c * width, dtype=np.float32))
                    else:
                        k_parts.append(counted[0][a : a + c].numpy())
                        q_parts.append(counted[1][a : a + c].numpy().reshape(-1))
                both = (np.concatenate(k_parts), np.concatenate(q_parts))
            names = [plans[i][0] for i, _, _ in parts]
            calls.append(self._send_push(s, words, data, both, names))

        return self._handle(
            calls, lambda: self._pushed(calls), "push_many " + ", ".join(repr(p[0]) for p in plans)
        )

    def _send_push(
        self,
        s: int,
        words: list[np.ndarray],
        data: list[np.ndarray],
        counted: tuple[np.ndarray, np.ndarray] | None,
        names: list[str],
    ) -> _Call:
        """Send server number ``s`` one ``PUSH_MANY``: ``words`` its table of contents
        ``[k, 3]``, then the parts' ids; ``data`` their gradients; ``counted``: every
        part's update counts ``[n]`` and statistics (flat), a plain part's ones and
        zeros. ``names``: the parts' tables, for the push counters."""
        toc = words[0]
        flags = seq = 0
        if counted is not None:
            packed, wide = wire.pack_counts(counted[0])
            words.append(packed)
            data.append(counted[1])
            flags = wire.FLAG_COUNTED | (wire.FLAG_WIDE_COUNTS if wide else 0)
        if self._sequenced:
            seq = self._seq.get(s, 0) + 1
            self._seq[s] = seq
            flags |= wire.FLAG_SEQ
            words.append(np.array([self._session], dtype=np.int64))
        call = self._start(
            s,
            Op.PUSH_MANY,
            payload=tuple(words),
            # One copy: the caller may reuse its gradient buffers while in flight.
            data=np.concatenate(data),
            table=len(toc),
            n=int(toc[:, 1].sum()),
            flags=flags,
            arg=seq,
            resendable=True,
        )
        call.names = names
        for name in names:
            self._count(name, "worker_push_calls")
        return call

    def _pushed(self, calls: list[_Call]) -> None:
        """Count the retries and repeats of push ``calls`` that have their replies."""
        for c in calls:
            repeat = int(c.reply[wire.W_FLAGS]) & wire.FLAG_DUPLICATE
            for name in c.names:
                if c.retries:
                    self._count(name, "worker_push_retries", c.retries)
                if repeat:
                    self._count(name, "worker_push_duplicates")

    # ------------------------------------------------------------ group requests

    def pull_groups_async(self, requests: Sequence[PullRequest | GroupPull]) -> Handle:
        """A lone group request goes out in bulk (:mod:`ps.mpi.group_messages`: one
        ``PULL_MANY`` per server, built from the packed ids with no request per table);
        anything else, or what that cannot take, the base class's way."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupPull):
                tables = [self._table(name) for name in r.space.names]
                plan = group_messages.pull_plan(
                    r, [t.spec for t in tables], [t.index for t in tables], len(self._servers)
                )
                if plan is not None:
                    return self._pull_group(plan, r.with_state)
        return super().pull_groups_async(requests)

    def _pull_group(self, plan: group_messages.PullPlan, with_state: bool) -> Handle:
        calls = [
            self._start(
                m.block.server,
                Op.PULL_MANY,
                payload=m.words,
                reply_words=m.reply_words,
                reply_data=np.empty(m.floats, dtype=np.float32),
                table=len(m.block.parts),
                n=m.block.size,
                flags=wire.FLAG_STATE if with_state else 0,
            )
            for m in plan.messages
        ]

        def finish() -> list[PullResult]:
            return [plan.result([(c.reply, c.data, c.server) for c in calls])]

        return self._handle(calls, finish, "pull_groups " + "+".join(plan.names))

    def push_groups_async(self, requests: Sequence[PushRequest | GroupPush]) -> Handle:
        """A lone group push goes out in bulk (:mod:`ps.mpi.group_messages`: one
        ``PUSH_MANY`` per server, its ids sorted first); anything else, or what that
        cannot take, the base class's way."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupPush):
                tables = [self._table(name) for name in r.space.names]
                messages = group_messages.push_messages(
                    sorted_push(r),
                    [t.spec for t in tables],
                    [t.index for t in tables],
                    len(self._servers),
                )
                if messages is not None:
                    names = r.space.names
                    calls = [
                        self._send_push(
                            m.block.server,
                            [m.toc, m.ids],
                            [m.grads],
                            m.counted,
                            [names[i] for i, _, _ in m.block.parts],
                        )
                        for m in messages
                    ]
                    return self._handle(
                        calls, lambda: self._pushed(calls), "push_groups " + "+".join(names)
                    )
        return super().push_groups_async(requests)

    # ------------------------------------------------------------ inspection

    def write_many_async(self, requests: Sequence[WriteRequest]) -> Handle:
        """Every table's write is checked first (nothing is sent if one is bad), then each
        server gets ONE ``WRITE`` message with its rows of every table (per table: ids and
        clocks, then the rows and their state); a server applies one worker's messages in
        order. A write is not resent: a late reply is a timeout (a resent write could
        land after a newer one of the same row)."""
        reqs = check_requests(requests, WriteRequest, "write_many")
        tables = [self._table(r.table) for r in reqs]
        for t, r in zip(tables, reqs, strict=True):
            check_write(t.spec, r.ids, r.rows, r.state, r.clocks)
        parts = [(t, r.ids, r.clocks, r.rows, r.state) for t, r in zip(tables, reqs, strict=True)]
        return self._send_writes(parts, ", ".join(repr(r.table) for r in reqs))

    def write_groups_async(self, requests: Sequence[WriteRequest | GroupWrite]) -> Handle:
        """A lone group write whose checks pass over the whole request at once (packed ids
        strictly increasing inside its space, rows and state finite, clocks >= 0: what a
        cache sends) goes out as :meth:`write_many_async` does, its tables' parts sliced
        out of it; anything else goes the base class's way (which checks table by table
        and says what is wrong)."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if isinstance(r, GroupWrite) and _plain_group_write(r):
                space, packed = r.space, r.ids.numpy()
                segments = space.segments(packed)
                local = torch.from_numpy(space.local(packed, segments))  # [P] table ids
                parts = [
                    (self._table(space.names[i]), local[a:b], r.clocks[a:b], r.rows[a:b],
                     r.state[a:b])
                    for i, a, b in segments
                ]  # fmt: skip
                if all(_writable(t.spec, rows, state) for t, _, _, rows, state in parts):
                    return self._send_writes(parts, f"tables {', '.join(space.names)}")
        return super().write_groups_async(requests)

    def _send_writes(self, parts: list[Any], names: str) -> Handle:
        """One ``WRITE`` message per server of the checked ``(table, ids, clocks, rows,
        state)`` parts, each table's rows split by the server that holds them: the table
        of contents, every part's ids, every part's clocks; as data every part's rows,
        then every part's state."""
        n_servers = len(self._servers)
        toc: list[list[list[int]]] = [[] for _ in range(n_servers)]  # per server: parts
        # per server: each part's ids, clocks, rows and state
        cols: list[list[list[np.ndarray]]] = [[[], [], [], []] for _ in range(n_servers)]
        for t, ids_t, clocks_t, rows_t, state_t in parts:
            d, s = t.spec.dim, t.spec.state_dim
            order, counts = self._split(ids_t)
            got = [_sorted_np(x, order) for x in (ids_t, clocks_t, rows_t, state_t)]
            a = 0
            for k, c in enumerate(counts):
                if c:
                    toc[k].append([t.index[k], c, wire.width_word(d, "fp32"), s])
                    for col, x in zip(cols[k], got, strict=True):
                        col.append(x[a : a + c].reshape(-1))
                a += c
        calls = []
        for k in range(n_servers):
            if toc[k]:
                ids, clocks, rows, state = (_joined(col) for col in cols[k])
                head = np.asarray(toc[k], dtype=np.int64).reshape(-1)
                calls.append(
                    self._start(
                        k,
                        Op.WRITE,
                        payload=(head, ids, clocks),
                        data=np.concatenate([rows, state]),
                        n=len(toc[k]),
                    )  # fmt: skip
                )
        return self._handle(calls, lambda: None, f"write_many of {names}")

    def _gather(self, table: str, ids: torch.Tensor, op: int, what: str) -> torch.Tensor:
        """Clocks (int64 ``[N]``) or state (float32 ``[N, S]``) of rows ``ids``, from servers."""
        calls, result = self._start_gather(table, ids, op, what)
        self._handle(calls, lambda: None, f"{what} {table!r}").wait()
        return result()

    def _start_gather(
        self, table: str, ids: torch.Tensor, op: int, what: str
    ) -> tuple[list[_Call], Callable[[], torch.Tensor]]:
        """The calls of :meth:`_gather`, sent, and what builds its result once they have
        their replies."""
        t = self._table(table)
        ids = check_ids(t.spec, ids, what)
        n = int(ids.numel())
        width = t.spec.state_dim
        order, counts = self._split(ids)
        ids_np = _sorted_np(ids, order)
        state = torch.empty(n, width, dtype=torch.float32)  # [N, S] in shard order
        state_np = state.numpy().reshape(-1)
        calls, starts = [], []
        a = 0
        for s, c in enumerate(counts):
            if c:
                calls.append(
                    self._start(
                        s,
                        op,
                        payload=(ids_np[a : a + c],),
                        reply_words=c if op == Op.CLOCKS else 0,
                        reply_data=state_np[a * width : (a + c) * width]
                        if op == Op.STATE
                        else _EMPTY_F32,
                        table=t.index[s],
                        n=c,
                    )
                )
                starts.append(a)
            a += c

        def result() -> torch.Tensor:
            if op == Op.CLOCKS:
                out = torch.empty(n, dtype=torch.int64)
                for call, a in zip(calls, starts, strict=True):
                    k = int(call.reply[wire.W_N])
                    out[a : a + k] = torch.from_numpy(call.reply[HEADER_LEN : HEADER_LEN + k])
            else:
                out = state
            return out if order is None else torch.empty_like(out).index_copy_(0, order, out)

        return calls, result

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self._gather(table, ids, Op.CLOCKS, "clocks")

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self._gather(table, ids, Op.STATE, "state")

    def state_many(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Every table's state requests sent before any reply is awaited, so their round
        trips overlap (one message per table and server)."""
        started = [self._start_gather(t, ids, Op.STATE, "state") for t, ids in requests]
        calls = [c for cs, _ in started for c in cs]
        names = ", ".join(repr(t) for t, _ in requests)
        self._handle(calls, lambda: None, f"state of {names}").wait()
        return [result() for _, result in started]

    def request_counts(self) -> dict[str, int]:
        """Pull and push messages the servers received (from every worker), summed."""
        total = {"pull_messages": 0, "push_messages": 0}
        for call in self._all(Op.STATS, what="request_counts"):
            for key, value in json.loads(call.text())["requests"].items():
                if key in total:
                    total[key] += int(value)
        return {**total, "servers": len(self._servers)}

    def server_busy(self) -> list[dict[str, float]]:
        """Per server: the pull and push messages it served and the seconds it spent
        serving them (decoding, checks, the tables' work, the reply; not the
        transfers), so ``pull_s / pull_messages`` is what a message costs a server;
        ``batched_pass_messages``: the batched ones it served whole in C
        (:mod:`ps.mpi.batched_pass`)."""
        out = []
        for call in self._all(Op.STATS, what="server_busy"):
            doc = json.loads(call.text())
            out.append({**{k: float(v) for k, v in doc["requests"].items()}, **doc["busy"]})
        return out

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per table, the servers' counters summed (``rows`` of a fixed table: ``num_rows``).
        A table another worker is creating (or dropping) meanwhile, held by only some of
        the servers, is left out."""
        total: dict[str, dict[str, int | float]] = {}
        held: dict[str, int] = {}
        calls = self._all(Op.STATS, what="stats")
        for call in calls:
            for table, counters in json.loads(call.text())["tables"].items():
                acc = total.setdefault(table, {})
                held[table] = held.get(table, 0) + 1
                for key, value in counters.items():
                    acc[key] = acc.get(key, 0) + value
        total = {t: acc for t, acc in total.items() if held[t] == len(calls)}
        for table, acc in list(total.items()):
            try:
                num_rows = self.spec(table).num_rows
            except ValueError:  # dropped by another worker since its counters came
                if table in self.tables():
                    raise
                del total[table]
                continue
            if num_rows is not None:  # shards hold only the rows they touched
                acc["rows"] = num_rows
            acc.update(
                self._counters.get(
                    table,
                    {"worker_push_calls": 0, "worker_push_retries": 0, "worker_push_duplicates": 0},
                )
            )
        return total

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Every server writes its rows as parts; this worker writes the manifest and swaps it in.

        Call it from one worker. Each server's part is a consistent snapshot of
        its shard; stop the other workers' pushes first for a global snapshot.
        """
        names = self.tables()
        specs = [self.spec(name) for name in names]
        tmp = checkpoint.begin_checkpoint(path)
        try:
            request = json.dumps({"dir": str(Path(tmp).resolve()), "tables": names})
            calls = self._all(Op.SAVE, request, f"save {str(path)!r}")
            entries: list[list[dict[str, Any]]] = [[] for _ in names]
            for call in calls:
                per_table = json.loads(call.text())
                for i, name in enumerate(names):
                    entries[i].extend(per_table[name])
            tables = list(zip(specs, entries, strict=True))
            checkpoint.finish_checkpoint(tmp, path, tables, writer="MPIStore")
        except BaseException:
            checkpoint.abort_checkpoint(tmp)
            raise

    def load(self, path: str | os.PathLike[str]) -> None:
        """Servers read the checkpoint and keep the rows that route to them (two phases:
        every server reads and checks its rows first; only then do they all switch over)."""
        ckpt = checkpoint.read_checkpoint(path)  # checks the manifest before bothering servers
        stage = json.dumps({"phase": "stage", "dir": str(ckpt.path.resolve())})
        try:
            self._all(Op.LOAD, stage, f"load {str(path)!r}")
        except BaseException:
            self._all(Op.LOAD, json.dumps({"phase": "abort"}), f"load {str(path)!r} (abort)")
            raise
        self._all(Op.LOAD, json.dumps({"phase": "commit"}), f"load {str(path)!r}")
        for spec in ckpt.specs:
            self._tables.pop(spec.name, None)  # looked up again, with the loaded spec

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Wait for requests still in flight, say goodbye to every server, free the communicator.

        Servers return from ``serve_mpi`` once every worker has closed. Servers
        that already let a request time out are skipped (the others still get
        their goodbye); a server that times out now raises
        :class:`comm.CommTimeoutError` after the rest are done.
        """
        if self._closed:
            return
        error: Exception | None = None
        try:
            for rank in self._servers:
                # Replies still owed (e.g. handles never waited), one server at a time.
                owed = [c for c in self._pending if c.server == rank and rank not in self._dead]
                if owed:
                    try:
                        self._handle(owed, lambda: None, "requests in flight at close").wait()
                    except Exception as e:  # reported after the goodbyes
                        error = error or e
            alive = [s for s, rank in enumerate(self._servers) if rank not in self._dead]
            self._drain_strays()
            calls = [self._start(s, Op.GOODBYE) for s in alive]
            try:
                self._handle(calls, lambda: None, "close").wait()
            except Exception as e:
                error = error or e
        finally:
            self._closed = True
            self._pending.clear()
            self._comm.Free()
            atexit.unregister(self._at_exit)
        if error is not None:
            raise error


def _close_at_exit(ref: weakref.ReferenceType[MPIStore]) -> Callable[[], None]:
    def close() -> None:
        store = ref()
        if store is not None and not store._closed:
            try:
                store.close()
            except Exception as e:  # at exit there is nobody left to raise to
                print(f"MPIStore.close at exit on rank {store.rank}: {e}", file=sys.stderr)

    return close


@dataclass(slots=True)
class _PullPlan:
    """One table's part of a batched pull: its ids (and clocks) in shard order."""

    name: str
    table: _Table
    ids: np.ndarray  # [N] int64, shard order
    clocks: np.ndarray | None  # [N] int64, shard order (conditional pulls)
    bound: int  # -1: a plain pull
    order: torch.Tensor | None  # shard order -> caller order (None: one server)
    counts: list[int]  # ids per server
    width: int  # floats per returned row: dim (+ state_dim when the state rides along)

    def data_words(self, m: int) -> int:
        """Data words of ``m`` returned rows: float32 rows (and state) one word per
        float; narrow rows two values per word, then (riding along) their float32 state."""
        spec = self.table.spec
        if not spec.narrow:
            return m * self.width
        return wire.value_words(m * spec.dim, spec.dtype) + m * (self.width - spec.dim)

    def rows(self, words: np.ndarray, m: int) -> np.ndarray:
        """``m`` returned rows as float32 ``[m, width]`` from their data ``words`` (narrow
        rows widened, exactly; a view of float32 ones)."""
        spec = self.table.spec
        if not spec.narrow:
            return words.reshape(m, self.width)
        size = wire.value_words(m * spec.dim, spec.dtype)
        values = wire.unpack_values(words[:size], m * spec.dim, spec.dtype).view(m, spec.dim)
        if self.width == spec.dim:
            return values.numpy()
        state = torch.from_numpy(words[size:]).view(m, self.width - spec.dim)
        return torch.cat([values, state], dim=1).numpy()

    def merge(
        self, got: list[tuple[int, int, np.ndarray, np.ndarray | None, np.ndarray]]
    ) -> PullResult:
        """The table's result from each server's ``(start, asked, clocks, positions,
        rows)`` (servers in order), in the caller's order (rows ``[M, width]``)."""
        dim = self.width
        if self.clocks is None:
            n = int(self.ids.size)
            if self.order is None and len(got) == 1:  # one server: its reply, as it is
                return PullResult(
                    rows=torch.from_numpy(got[0][4]), clocks=torch.from_numpy(got[0][2])
                )
            rows = torch.empty(n, dim, dtype=torch.float32)  # [N, D] shard order
            clocks = torch.empty(n, dtype=torch.int64)
            for a, k, clk, _, r in got:
                rows[a : a + k] = torch.from_numpy(r)
                clocks[a : a + k] = torch.from_numpy(clk)
            if self.order is None:
                return PullResult(rows=rows, clocks=clocks)
            return PullResult(
                rows=torch.empty_like(rows).index_copy_(0, self.order, rows),
                clocks=torch.empty_like(clocks).index_copy_(0, self.order, clocks),
            )
        empty_i64 = torch.empty(0, dtype=torch.int64)
        parts_rows = [torch.from_numpy(r) for _, _, _, _, r in got]
        parts_clk = [torch.from_numpy(c) for _, _, c, _, _ in got]
        parts_pos = [torch.from_numpy(p) + a for a, _, _, p, _ in got if p is not None]
        out_rows = torch.cat(parts_rows) if parts_rows else torch.empty(0, dim)
        out_clocks = torch.cat(parts_clk) if parts_clk else empty_i64
        pos = torch.cat(parts_pos) if parts_pos else empty_i64  # positions in shard order
        if self.order is not None:
            pos = self.order[pos]
            perm = torch.argsort(pos)
            pos, out_rows, out_clocks = pos[perm], out_rows[perm], out_clocks[perm]
        return PullResult(rows=out_rows, clocks=out_clocks, positions=pos)


def _names(plans: list[_PullPlan]) -> str:
    return ", ".join(repr(p.name) for p in plans)


def _split_pull_reply(
    call: _Call,
    parts: list[tuple[int, int, int]],
    plans: list[_PullPlan],
    got: list[list[tuple[int, int, np.ndarray, np.ndarray | None, np.ndarray]]],
) -> None:
    """Cut one server's ``PULL_MANY`` reply into its tables' parts (checked against
    what was asked) and append them to ``got``."""
    k = len(parts)
    body, toc = wire.pull_reply_parts(call.reply, k, call.server)
    at, fat = k * wire.REPLY_PART_WORDS, 0
    for (i, a, c), (m, flags) in zip(parts, toc.tolist(), strict=True):
        p = plans[i]
        conditional = p.clocks is not None
        positions = bool(flags & wire.FLAG_POSITIONS)
        ok = (0 <= m <= c) if conditional else m == c
        if not ok or positions != conditional:
            raise wire.pull_part_error(call.server, m, positions, p.name, c)
        clk = body[at : at + m]
        at += m
        pos = None
        if conditional:
            pos = body[at : at + m]
            at += m
        size = p.data_words(m)
        got[i].append((a, c, clk, pos, p.rows(call.data[fat : fat + size], m)))
        fat += size


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` back to back (the one part itself where there is one)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _plain_group_write(r: GroupWrite) -> bool:
    """Whether the group write ``r`` passes every check of a write at once: host tensors
    of the right kinds and shapes, packed ids strictly increasing inside its space, rows
    and state finite, clocks >= 0 (else the per-table path finds what is wrong)."""
    ints = all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.dim() == 1
               and not x.is_cuda for x in (r.ids, r.clocks))  # fmt: skip
    floats = all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 2
                 and not x.is_cuda for x in (r.rows, r.state))  # fmt: skip
    if not (ints and floats):
        return False
    n = r.ids.shape[0]
    if n == 0 or r.clocks.shape[0] != n or r.rows.shape[0] != n or r.state.shape[0] != n:
        return False
    packed = r.ids.numpy()
    if not bool((packed[1:] > packed[:-1]).all()) or not r.space.inside(packed):
        return False
    return all_finite(r.rows) and all_finite(r.state) and int(r.clocks.min()) >= 0


def _writable(spec: TableSpec, rows: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether ``spec``'s table takes a write of ``rows`` ``[n, D]`` and ``state`` ``[n, S]``
    as they are (a fixed float32 table of that dim and state width)."""
    shapes = rows.shape[1] == spec.dim and state.shape[1] == spec.state_dim
    return spec.num_rows is not None and not spec.narrow and shapes


def wire_grads(spec: TableSpec, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Checked float32 ``grads`` ``[N, D]`` of ``ids`` ``[N]`` as they travel: in the table's
    type for a narrow table (rounded to nearest: half the bytes; the server widens them
    again, exactly), else as they are. A gradient beyond the narrow type's range
    becomes Inf there: with ``nan_policy="raise"`` it is refused here, naming the row,
    like a NaN/Inf gradient (with "skip" the server drops its row)."""
    if not spec.narrow:
        return grads
    narrow = grads.to(spec.torch_dtype)  # [N, D]
    if spec.nan_policy == "raise" and narrow.numel() > 0 and not all_finite(narrow):
        pos = int(torch.nonzero(~finite_rows(narrow.to(torch.float32)))[0, 0])
        big = float(grads[pos].abs().max())
        raise ValueError(
            f"push table {spec.name!r}: gradient of row id {int(ids[pos])} (position {pos}) "
            f"contains NaN or Inf once rounded to the table's {spec.dtype} for the wire "
            f"(|gradient| {big:g} is past its largest finite value "
            f"{torch.finfo(spec.torch_dtype).max:g}); nothing was applied (scale the "
            "gradients down, or set the table's nan_policy='skip' to drop such rows instead)"
        )
    return narrow


def _sorted_np(t: torch.Tensor, order: torch.Tensor | None) -> np.ndarray:
    """``t`` in shard order as a contiguous numpy array (a copy only when reordering)."""
    t = t.detach().cpu()
    return (t if order is None else t.index_select(0, order)).contiguous().numpy()
