"""The server side of the MPI store: a loop that serves one shard of every table.

Under ``mpirun -n N`` with ``comm.Topology(world_size=N, num_servers=S)`` the
last ``S`` ranks call :func:`serve_mpi`; it returns once every worker rank has
closed its :class:`ps.mpi.store.MPIStore`. Server ``k`` (``k = rank - num_workers``)
holds the rows whose ``ps.routing.shard_of(id, S) == k``.

The shard's tables are :class:`ps.local.table.LocalTable` objects, the engine of
the in-process store, so optimizers, dynamic tables, statistics and checkpoint
parts are exactly the in-process store's; the loop only receives requests
(:mod:`ps.mpi.wire`), checks them (sizes, table index, then :mod:`ps.validate`, the
in-process store's own checks), calls the table and sends the reply. A narrow table's
(fp16 / bf16) rows go out in its type and its gradients come in it, widened to float32
for the checks and the update (``docs/ps_protocol.md``, narrow tables on the wire).

With more than one server, a shard of a *fixed* table holds exactly the rows routed
to it, densely (:class:`ps.mpi.fixed_shard.FixedShard`: a fixed table of those rows
and an int32 map from the table's ids, 4 bytes per table row); ids are checked
against ``num_rows``. With one server the table is a plain fixed table.

The loop is single-threaded, so every request is applied atomically on this
shard, and the requests of one worker are applied in the order it sent them
(MPI keeps the messages between two ranks in order).

A bad request (unknown table index, ids out of range, wrong sizes, NaN
gradients, ...) gets an error reply that the worker raises as ValueError /
TypeError; the server changes nothing and keeps serving. Sizes are checked
before anything is allocated or read: the header's ``n`` (at most
:data:`ps.mpi.wire.MAX_IDS`) and ``dim`` against the payload words and the word
count of the data message, byte counts that are not whole words, a request whose
data message does not follow within ``ServerConfig.data_timeout_s``, and the
table index against the tables this server has.

Exactly-once pushes: the server keeps, per worker rank (for ``PUSH_MANY``; per
(table, worker rank) for a single-table ``PUSH``), the session and sequence number of
the last push it applied and acknowledges a repeat with
:data:`ps.mpi.wire.FLAG_DUPLICATE` without applying it again (``docs/ps_protocol.md``).
``stats()`` adds ``push_duplicates`` per table.

Liveness: a worker that has talked and then stays silent past
``ServerConfig.worker_timeout_s`` (died or hangs) makes :func:`serve_mpi` raise
:class:`comm.CommTimeoutError` naming its rank, instead of waiting for its goodbye.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from comm import CommTimeoutError, ProcessGroup, Topology, detect_launch, usable_cores
from ps.checkpoint import TablePart, check_row_ids, read_checkpoint, write_part
from ps.errors import check_existing
from ps.local.store import PART_ROWS
from ps.local.table import LocalTable
from ps.mpi import wire
from ps.mpi.batched_pass import BatchedPass
from ps.mpi.fixed_shard import FixedShard
from ps.mpi.wire import HEADER_LEN, Op
from ps.routing import shard_of
from ps.table import TableSpec
from ps.validate import (
    all_finite,
    check_counted,
    check_grads,
    check_ids,
    check_pull_bound,
    check_write,
    unknown_table,
)

_EMPTY_F32 = np.empty(0, dtype=np.float32)
Shard = LocalTable | FixedShard  # a server's part of one table
# The exactly-once key of a worker's batched pushes (a table name is never empty).
_BATCH_KEY = ""
# Idle policy: poll without pause for SPIN_S after the last request (lowest latency
# while a worker is busy talking to us), then poll with short sleeps so that idle
# servers leave the CPU to workers on oversubscribed machines.
_SPIN_S = 0.005
_IDLE_SLEEP_S = 0.0002


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Knobs of :func:`serve_mpi`.

    ``idle_sleep_s`` is the pause between polls once the server has been idle for
    ``spin_s`` (0: never sleep, lowest latency, one busy core per server).
    ``torch_threads``: the server sets ``torch.set_num_threads`` to this (None:
    leave it). One thread is the default because a server's requests are small
    (10 k rows) and its neighbours on the node are workers that spin while they
    wait: with 2 intra-op threads a 10 k-row push took ~50x longer on the 2-core
    development machine (other jobs running) than with 1.
    ``pass_threads``: threads that serve the table parts of one batched message at once
    (:mod:`ps.mpi.batched_pass`; parts of different tables touch disjoint rows). None:
    this host's cores shared out over the ranks on it (``comm.detect_launch().local_size``),
    at least 1, so the ranks of a host do not outnumber its cores.
    ``data_timeout_s``: how long the server waits for the data message that
    must follow a request's header message (a broken client that sends only
    one gets an error reply instead of hanging the server).
    ``worker_timeout_s``: a worker that has sent requests and then sends
    nothing for this long (no request, no goodbye) is taken for dead or hung:
    :func:`serve_mpi` raises :class:`comm.CommTimeoutError` naming its rank and
    how long it was silent, instead of waiting for its goodbye forever. The
    default (120 s) is far longer than a training step's gap between two
    requests and well under the 300 s of a collective's timeout; raise it for
    workers that pause longer without the parameter server (a long evaluation
    that does not pull, a long pause between epochs), None turns it off. A
    worker's silence is counted from its first request, so a worker that takes
    long to start (reading data) is not judged before it talks.
    """

    spin_s: float = _SPIN_S
    idle_sleep_s: float = _IDLE_SLEEP_S
    torch_threads: int | None = 1
    pass_threads: int | None = None
    data_timeout_s: float = 10.0
    worker_timeout_s: float | None = 120.0

    def __post_init__(self) -> None:
        for name in ("torch_threads", "pass_threads"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
                raise ValueError(f"ServerConfig: {name} must be None or an int >= 1, got {t!r}")
        for name in ("data_timeout_s", "worker_timeout_s"):
            d = getattr(self, name)
            if d is None and name == "worker_timeout_s":
                continue
            if (
                not isinstance(d, int | float)
                or isinstance(d, bool)
                or not (math.isfinite(d) and d > 0)
            ):
                raise ValueError(f"ServerConfig: {name} must be a number > 0, got {d!r}")
        for name in ("spin_s", "idle_sleep_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"ServerConfig: {name} must be a finite number >= 0, got {v!r}")


def check_mpi_topology(group: ProcessGroup, topology: Topology, who: str) -> Any:
    """The group's mpi4py communicator, after checking ``topology`` fits ``group``."""
    mpi_comm = getattr(group, "mpi_comm", None)
    if mpi_comm is None:
        raise TypeError(
            f"{who} needs an MPI process group (comm.init('mpi') under mpirun), "
            f"got backend {getattr(group, 'backend', type(group).__name__)!r}"
        )
    if not isinstance(topology, Topology):
        raise TypeError(f"{who}: topology must be a comm.Topology, got {type(topology).__name__}")
    if topology.world_size != group.size:
        raise ValueError(
            f"{who}: topology is for {topology.world_size} ranks but the group has {group.size}"
        )
    if topology.num_servers < 1:
        raise ValueError(f"{who}: topology has num_servers=0; the MPI store needs at least 1")
    return mpi_comm


def check_push_grads(spec: TableSpec, ids: torch.Tensor, grads: object) -> torch.Tensor:
    """:func:`ps.validate.check_grads` with a fast all-finite test first.

    numpy's ``isfinite(...).all()`` over a ``[10 000, 64]`` batch takes ~0.1 ms,
    torch's per-row test ~3 ms; the per-row test (which names the bad row) only
    runs when something is not finite.
    """
    checked = check_grads(spec, ids, grads, finite=False)
    must_be_finite = spec.nan_policy == "raise" and checked.numel() > 0
    if must_be_finite and not all_finite(checked.detach().cpu()):
        check_grads(spec, ids, checked, finite=True)  # raises, naming the row
    return checked


def serve_mpi(
    group: ProcessGroup, topology: Topology, config: ServerConfig | None = None
) -> dict[str, dict[str, int | float]]:
    """Serve this rank's shard until every worker said goodbye; returns the shard's stats.

    Collective with the workers' ``MPIStore(group, topology)`` (both duplicate
    the group's communicator, so PS traffic never mixes with other messages).
    Raises :class:`comm.CommTimeoutError` naming the worker rank when a worker
    stays silent past ``config.worker_timeout_s`` (it died or hangs).
    """
    return ShardServer.open(group, topology, config).serve()


class ShardServer:
    """The loop of one server rank (see the module docstring): receives, checks and
    applies requests on this rank's shard of every table. Built by :meth:`open`."""

    @classmethod
    def open(
        cls, group: ProcessGroup, topology: Topology, config: ServerConfig | None = None
    ) -> ShardServer:
        """Check the roles, set the torch threads and duplicate the communicator
        (collective with the workers' ``MPIStore``)."""
        mpi_comm = check_mpi_topology(group, topology, "serve_mpi")
        if group.rank not in topology.server_ranks:
            raise ValueError(
                f"serve_mpi: rank {group.rank} is a worker in {topology}; servers are ranks "
                f"{topology.server_ranks}"
            )
        config = config or ServerConfig()
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        return cls(mpi_comm.Dup(), topology, group.rank, config)

    def __init__(self, comm: Any, topology: Topology, rank: int, config: ServerConfig) -> None:
        self.comm = comm
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB))
        self.topology = topology
        self.rank = rank
        self.shard = topology.server_ranks.index(rank)
        self.num_shards = topology.num_servers
        self.config = config
        self.names: list[str] = []  # table index -> name (indices are never reused)
        self.specs: dict[str, TableSpec] = {}  # the specs as the workers gave them
        self.tables: dict[str, Shard] = {}  # this shard's part of each table
        self.waiting = set(topology.worker_ranks)  # workers that have not said goodbye
        self.heard: dict[int, float] = {}  # worker rank -> when its last request came
        self.sends: list[Any] = []  # reply sends in flight (requests keep their buffers)
        # A load waiting for its commit: name -> (spec, this shard's new table).
        self.staged: dict[str, tuple[TableSpec, Shard]] | None = None
        # Exactly-once: (table, worker rank) -> (session, last applied sequence number).
        self.last_seq: dict[tuple[str, int], tuple[int, int]] = {}
        self.duplicates: dict[str, int] = {}  # table -> repeats acknowledged, not applied
        # Messages received, for request_counts(): a batched request counts once.
        self.messages = {"pull_messages": 0, "push_messages": 0}
        # Seconds spent serving them (decoding, checks, the tables' work, the reply built;
        # not the transfers), for server_busy(): what a message costs this server.
        self.busy = {"pull_s": 0.0, "push_s": 0.0}
        self.last_source = -1  # the worker served last (round robin, see next_source)
        # Batched messages of fixed tables served whole in C; rebuilt as tables change.
        self.batched = BatchedPass(config.pass_threads or _host_share_of_cores())

    def serve(self) -> dict[str, dict[str, int | float]]:
        """Run until every worker said goodbye, then free the communicator; the stats."""
        try:
            self.run()
        finally:
            self.close()
        return self.stats()

    def reply_lost(self, src: int, request_id: int) -> bool:
        """Whether to act as if the reply to an applied push were lost (not send it).
        Never here; a test subclass drops some, so that the workers' resends run."""
        return False

    def stats(self) -> dict[str, dict[str, int | float]]:
        self.batched.fold()
        return {
            name: {**t.stats(), "push_duplicates": self.duplicates.get(name, 0)}
            for name, t in self.tables.items()
        }

    # ------------------------------------------------------------ loop

    def run(self) -> None:
        status = MPI.Status()
        last = time.monotonic()
        next_check = last + 1.0  # of the workers' silence, about once a second
        polls = 0
        while self.waiting:
            if self.comm.Iprobe(MPI.ANY_SOURCE, wire.TAG_REQUEST, status):
                src = self.next_source(status.Get_source(), status)
                self.heard[src] = time.monotonic()
                self.serve_one(status)
                last = time.monotonic()
                polls = 0
                if last > next_check:
                    self.check_workers(last)
                    next_check = last + 1.0
                continue
            polls += 1
            if polls & 63 == 0:
                self.sends = [r for r in self.sends if not r.Test()]
                now = time.monotonic()
                if now > next_check:
                    self.check_workers(now)
                    next_check = now + 1.0
                if now - last > self.config.spin_s and self.config.idle_sleep_s:
                    time.sleep(self.config.idle_sleep_s)
                else:
                    os.sched_yield()

    def next_source(self, probed: int, status: Any) -> int:
        """The worker to serve next, round robin: the first worker after the one served
        last that has a request waiting (``status`` is left describing its request).

        ``Iprobe(ANY_SOURCE)`` may keep finding the same busy worker while others wait
        (MPI does not promise fairness across sources); a worker with many requests in
        flight is served one request per turn, so each of W workers waits at most
        W - 1 requests of the others."""
        order = round_robin(self.topology.worker_ranks, self.last_source)
        for w in order:
            if w == probed:
                break
            if self.comm.Iprobe(w, wire.TAG_REQUEST, status):
                self.last_source = w
                return w
        self.comm.Iprobe(probed, wire.TAG_REQUEST, status)  # status: the probed request
        self.last_source = probed
        return probed

    def check_workers(self, now: float) -> None:
        """Raise if a worker that has talked stayed silent past ``worker_timeout_s``."""
        limit = self.config.worker_timeout_s
        if limit is None:
            return
        silent = {w: now - self.heard[w] for w in self.waiting if w in self.heard}
        late = sorted(w for w, s in silent.items() if s > limit)
        if late:
            who = f"worker rank {late[0]}" if len(late) == 1 else f"worker ranks {late}"
            how_long = ", ".join(f"{silent[w]:.1f} s" for w in late)
            raise CommTimeoutError(
                f"serve_mpi on server rank {self.rank}: {who} sent no request and no goodbye "
                f"for {how_long} (ServerConfig.worker_timeout_s={limit:g}): it died or hangs. "
                f"This server stops serving (workers that did not say goodbye: "
                f"{sorted(self.waiting)})"
            )

    def close(self) -> None:
        # Replies still in flight: give the workers a moment to take them.
        deadline = time.monotonic() + 5.0
        while self.sends and time.monotonic() < deadline:
            self.sends = [r for r in self.sends if not r.Test()]
        self.comm.Free()

    def serve_one(self, status: Any) -> None:
        src = status.Get_source()
        meta_raw = self.receive(src, wire.TAG_REQUEST, status)
        request_id = op = 0
        try:
            data_raw = self.receive_data(src, status)
            meta = _as_words(meta_raw, np.int64, "header message")
            request_id = int(meta[wire.W_ID]) if meta.size > wire.W_ID else 0
            op = int(meta[wire.W_OP]) if meta.size > wire.W_OP else 0
            wire.check_header(meta, f"request from rank {src}")
            if data_raw is None:
                raise ValueError(
                    f"request from rank {src}: its data message did not follow within "
                    f"{self.config.data_timeout_s:g} s"
                )
            data = _as_words(data_raw, np.float32, "data message")
            reply = self.dispatch(src, meta, data)
        except Exception as e:  # every failure becomes an error reply; the server goes on
            reply = wire.error_message(op, request_id, e), _EMPTY_F32
        if reply is None:  # reply_lost: the push was applied, its reply "lost"
            return
        reply_meta, reply_data = reply
        meta_tag, data_tag = wire.reply_tags(request_id, self.tag_ub)
        if len(self.sends) >= 16:  # a busy server never idles: let go of finished replies here
            self.sends = [r for r in self.sends if not r.Test()]
        self.sends.append(self.comm.Isend([reply_meta, MPI.INT64_T], dest=src, tag=meta_tag))
        self.sends.append(self.comm.Isend([reply_data, MPI.FLOAT], dest=src, tag=data_tag))

    def receive(self, src: int, tag: int, status: Any) -> np.ndarray:
        """The probed message as raw bytes (any length: sizes are checked afterwards)."""
        raw = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([raw, MPI.BYTE], source=src, tag=tag)
        return raw

    def receive_data(self, src: int, status: Any) -> np.ndarray | None:
        """The data message that follows a header from ``src`` (None: it did not come)."""
        if not self.comm.Iprobe(src, wire.TAG_REQUEST_DATA, status):
            deadline = time.monotonic() + self.config.data_timeout_s
            while not self.comm.Iprobe(src, wire.TAG_REQUEST_DATA, status):
                if time.monotonic() > deadline:
                    return None
                time.sleep(self.config.idle_sleep_s or 0.0)
        return self.receive(src, wire.TAG_REQUEST_DATA, status)

    # ------------------------------------------------------------ requests

    def dispatch(
        self, src: int, meta: np.ndarray, data: np.ndarray
    ) -> tuple[np.ndarray, Any] | None:
        op, rid = int(meta[wire.W_OP]), int(meta[wire.W_ID])
        payload = meta[HEADER_LEN:]
        if op in (Op.PULL, Op.PULL_MANY):
            self.messages["pull_messages"] += 1
            t = time.perf_counter()
            try:
                if op == Op.PULL_MANY:
                    return self.pull_many(meta, payload, data)
                return self.pull(meta, payload, data)
            finally:
                self.busy["pull_s"] += time.perf_counter() - t
        if op in (Op.PUSH, Op.PUSH_MANY):
            self.messages["push_messages"] += 1
            t = time.perf_counter()
            try:
                if op == Op.PUSH_MANY:
                    return self.push_many(src, meta, payload, data)
                return self.push(src, meta, payload, data)
            finally:
                self.busy["push_s"] += time.perf_counter() - t
        if op == Op.WRITE:
            self.messages["push_messages"] += 1
            t = time.perf_counter()
            try:
                return self.write(meta, payload, data)
            finally:
                self.busy["push_s"] += time.perf_counter() - t
        if op in (Op.CLOCKS, Op.STATE):
            return self.inspect(op, meta, payload, data)
        _expect_sizes(meta, data, payload.size, 0)
        if op == Op.GOODBYE:
            self.waiting.discard(src)
            return wire.message(wire.header(Op.GOODBYE, rid)), _EMPTY_F32
        text = wire.unpack_bytes(payload, int(meta[wire.W_ARG])).decode("utf-8")
        if op == Op.CREATE:
            return self.create(
                rid, text, exist_ok=bool(int(meta[wire.W_FLAGS]) & wire.FLAG_EXIST_OK)
            )
        if op == Op.DROP:
            return self.drop(rid, text)
        if op == Op.LOOKUP:
            return self.lookup(rid, text)
        if op == Op.LIST:
            return _text_reply(Op.LIST, rid, json.dumps(self.current_names()))
        if op == Op.STATS:
            requests = {**self.messages, "batched_pass_messages": self.batched.served}
            reply = {"tables": self.stats(), "requests": requests, "busy": self.busy}
            return _text_reply(Op.STATS, rid, json.dumps(reply))
        if op == Op.SAVE:
            return _text_reply(Op.SAVE, rid, json.dumps(self.save(json.loads(text))))
        if op == Op.LOAD:
            return _text_reply(Op.LOAD, rid, json.dumps(self.load(json.loads(text))))
        raise ValueError(f"unknown request op {op} (protocol {wire.MAGIC_VERSION:#x})")

    def table(self, meta: np.ndarray, op: str) -> tuple[TableSpec, Shard]:
        dims, types = wire.split_widths(meta[wire.W_DIM : wire.W_DIM + 1])
        return self.table_at(int(meta[wire.W_TABLE]), int(dims[0]), op, types[0])

    def table_at(
        self, index: int, dim: int, op: str, row_type: str = "fp32"
    ) -> tuple[TableSpec, Shard]:
        """The table at ``index``; for a pull or push ``dim`` must be its width and
        ``row_type`` (what the rows travel in) its dtype."""
        if (
            not 0 <= index < len(self.names)
            or self.names[index] not in self.tables
            or self.index_of(self.names[index]) != index  # dropped, then created again
        ):
            raise ValueError(
                f"{op}: table index {index} is unknown on server rank {self.rank} "
                f"(its tables: {self.current_names()}; was the table dropped?)"
            )
        name = self.names[index]
        spec = self.specs[name]
        if op in ("pull", "push", "write") and dim != spec.dim:
            raise ValueError(
                f"{op} table {name!r}: the request is for rows of width {dim} but the table "
                f"has dim={spec.dim} (was it reloaded with another spec?)"
            )
        if op in ("pull", "push", "write") and row_type != spec.dtype:
            raise ValueError(
                f"{op} table {name!r}: the request is for {row_type} rows on the wire but the "
                f"table holds {spec.dtype} rows (was it reloaded with another spec?)"
            )
        return spec, self.tables[name]

    def create(self, rid: int, text: str, *, exist_ok: bool) -> tuple[np.ndarray, Any]:
        """Create (or, with ``exist_ok``, open an equal) table; requests are served one at a
        time, so of several workers creating the same table at once exactly one creates it."""
        spec = TableSpec.from_json(text)
        where = f"on the MPI parameter server (server rank {self.rank})"
        if check_existing(
            self.specs.get(spec.name),
            spec,
            exist_ok=exist_ok,
            where=where,
            clear="or restart the job",
        ):
            self.tables[spec.name] = self.new_table(spec)
            self.specs[spec.name] = spec
            self.names.append(spec.name)  # a new index, also for a table dropped before
            self.tables_changed()
        return _text_reply(Op.CREATE, rid, text, table=self.index_of(spec.name))

    def drop(self, rid: int, name: str) -> tuple[np.ndarray, Any]:
        if name not in self.specs:
            raise unknown_table(name, self.specs)
        del self.specs[name], self.tables[name]
        for key in [k for k in self.last_seq if k[0] == name]:
            del self.last_seq[key]
        self.duplicates.pop(name, None)
        self.tables_changed()
        return wire.message(wire.header(Op.DROP, rid)), _EMPTY_F32

    def lookup(self, rid: int, name: str) -> tuple[np.ndarray, Any]:
        if name not in self.specs:
            raise unknown_table(name, self.specs)
        text = json.dumps(self.specs[name].to_json())
        return _text_reply(Op.LOOKUP, rid, text, table=self.index_of(name))

    def tables_changed(self) -> None:
        """Point the C pass at the tables there are now, by index."""
        current = set(self.current_names())
        self.batched.rebuild([self.tables[n] if n in current else None for n in self.names])

    def current_names(self) -> list[str]:
        """Names of the tables there are, in the order of their current indices."""
        return [n for i, n in enumerate(self.names) if n in self.specs and self.index_of(n) == i]

    def index_of(self, name: str) -> int:
        """The table's current index: the last one given to ``name`` (a table dropped and
        created again gets a new index, so a worker holding the old one is told so)."""
        if name not in self.names:
            self.names.append(name)
        return len(self.names) - 1 - self.names[::-1].index(name)

    def new_table(self, spec: TableSpec, part: TablePart | None = None) -> Shard:
        """This server's part of table ``spec`` (holding the rows of ``part``, if given):
        the whole table with one server; with several, the rows routed here, densely
        for a fixed table (:class:`ps.mpi.fixed_shard.FixedShard`)."""
        if self.num_shards > 1 and spec.num_rows is not None:
            return FixedShard(spec, self.shard, self.num_shards, part)
        if part is None:
            return LocalTable(self.shard_spec(spec))
        return LocalTable.from_part(self.shard_spec(spec), part)

    def shard_spec(self, spec: TableSpec) -> TableSpec:
        """The spec of this shard's part of a dynamic table (a fixed one is whole with
        one server, a :class:`FixedShard` with several)."""
        if self.num_shards == 1:
            return spec
        if spec.capacity is not None:
            return replace(spec, capacity=-(-spec.capacity // self.num_shards))
        return spec

    def pull(self, meta: np.ndarray, payload: np.ndarray, data: np.ndarray) -> tuple[Any, Any]:
        spec, table = self.table(meta, "pull")
        n, flags = int(meta[wire.W_N]), int(meta[wire.W_FLAGS])
        conditional = bool(flags & wire.FLAG_CLOCKS)
        _expect_sizes(meta, data, n * (2 if conditional else 1), 0)
        ids = self.check_ids(spec, payload[:n], "pull")
        caller = None
        bound = None
        if conditional:
            bound = int(meta[wire.W_ARG])
            caller = check_pull_bound(spec, ids, torch.from_numpy(payload[n : 2 * n]), bound)
        got = table.pull(ids, caller, bound)
        parts = [got.clocks.numpy()]
        flags = 0
        if got.positions is not None:
            parts.append(got.positions.numpy())
            flags = wire.FLAG_POSITIONS
        m = int(got.rows.shape[0])
        width = wire.width_word(spec.dim, spec.dtype)
        head = wire.header(Op.PULL, int(meta[wire.W_ID]), n=m, dim=width, flags=flags)
        return wire.message(head, *parts), wire_rows(spec, got.rows)

    def push(
        self, src: int, meta: np.ndarray, payload: np.ndarray, data: np.ndarray
    ) -> tuple[Any, Any] | None:
        spec, table = self.table(meta, "push")
        n, rid = int(meta[wire.W_N]), int(meta[wire.W_ID])
        sequenced = bool(int(meta[wire.W_FLAGS]) & wire.FLAG_SEQ)
        _expect_sizes(meta, data, n + int(sequenced), wire.value_words(n * spec.dim, spec.dtype))
        ids = self.check_ids(spec, payload[:n], "push")
        grads = wire.unpack_values(data, n * spec.dim, spec.dtype).view(n, spec.dim)
        check_push_grads(spec, ids, grads)
        if sequenced:
            session, seq = int(payload[n]), int(meta[wire.W_ARG])
            key = (spec.name, src)
            last = self.last_seq.get(key)
            if last is not None and last[0] == session and seq <= last[1]:
                self.duplicates[spec.name] = self.duplicates.get(spec.name, 0) + 1
                head = wire.header(Op.PUSH, rid, flags=wire.FLAG_DUPLICATE)
                return wire.message(head), _EMPTY_F32
            self.last_seq[key] = (session, seq)
        table.push(ids, grads, checked=spec.nan_policy == "raise")
        return self.push_applied(Op.PUSH, src, rid)

    def pull_many(self, meta: np.ndarray, payload: np.ndarray, data: np.ndarray) -> Any:
        """Several tables' pulls in one request: every part is checked, then served in
        order; the reply carries each part's rows, clocks and positions back to back."""
        k = wire.check_parts(int(meta[wire.W_TABLE]), "pull_many")
        with_state = bool(int(meta[wire.W_FLAGS]) & wire.FLAG_STATE)
        if data.size == 0:
            whole = self.batched.pull_many(k, int(meta[wire.W_ID]), payload, with_state)
            if whole is not None:
                return whole
        toc, types = _toc(payload, k, wire.PULL_PART_WORDS, "pull_many")
        widths = np.where(toc[:, 3] >= 0, 2, 1)  # id words per id: conditional parts send clocks
        _expect_batch(meta, payload, data, int((toc[:, 1] * widths).sum()), k, 0, "pull_many")
        at = k * wire.PULL_PART_WORDS
        parts = []
        for (index, n, dim, bound), row_type in zip(toc.tolist(), types, strict=True):
            spec, table = self.table_at(index, dim, "pull", row_type)
            ids = self.check_ids(spec, payload[at : at + n], "pull")
            at += n
            caller = None
            if bound >= 0:
                caller = check_pull_bound(spec, ids, torch.from_numpy(payload[at : at + n]), bound)
                at += n
            parts.append((spec, table, ids, caller, bound if bound >= 0 else None))
        got = [table.pull(ids, caller, bound) for _, table, ids, caller, bound in parts]
        reply_toc = np.empty((k, wire.REPLY_PART_WORDS), dtype=np.int64)
        words: list[np.ndarray] = [reply_toc]
        data_words: list[np.ndarray] = []  # each part's rows (and state), table after table
        for i, ((spec, table, ids, _, _), g) in enumerate(zip(parts, got, strict=True)):
            reply_toc[i] = (int(g.rows.shape[0]), 0 if g.positions is None else wire.FLAG_POSITIONS)
            words.append(g.clocks.numpy())
            if g.positions is not None:
                words.append(g.positions.numpy())
            state = None
            if with_state:
                state = table.read_state(ids if g.positions is None else ids[g.positions])
            data_words.extend(part_rows(spec, g.rows, state))
        flat = np.concatenate(data_words) if len(data_words) > 1 else data_words[0]
        head = wire.header(Op.PULL_MANY, int(meta[wire.W_ID]), n=k)
        return wire.message(head, *words), flat

    def push_many(
        self, src: int, meta: np.ndarray, payload: np.ndarray, data: np.ndarray
    ) -> tuple[Any, Any] | None:
        """Several tables' pushes in one request, exactly once as one unit: every part
        is checked (ids, shapes, finite gradients) before any table changes."""
        k = wire.check_parts(int(meta[wire.W_TABLE]), "push_many")
        rid = int(meta[wire.W_ID])
        flags = int(meta[wire.W_FLAGS])
        sequenced = bool(flags & wire.FLAG_SEQ)
        counted, wide = bool(flags & wire.FLAG_COUNTED), bool(flags & wire.FLAG_WIDE_COUNTS)
        whole = self.batched.checked_push(k, payload, data, sequenced, counted=counted, wide=wide)
        if whole is not None:
            if sequenced and self.repeated(src, payload, meta, k):
                return _duplicate(rid)
            self.batched.push(whole)
            return self.push_applied(Op.PUSH_MANY, src, rid)
        toc, types = _toc(payload, k, wire.PUSH_PART_WORDS, "push_many")
        n_ids = int(toc[:, 1].sum())
        specs = [
            self.table_at(index, dim, "push", row_type)
            for (index, dim), row_type in zip(toc[:, [0, 2]].tolist(), types, strict=True)
        ]
        # each part's gradients in its table's type (table_at checked the row types)
        sizes = toc[:, 1].tolist()
        grad_words = [
            wire.value_words(n * s.dim, s.dtype) for (s, _), n in zip(specs, sizes, strict=True)
        ]
        floats = sum(grad_words)
        words = n_ids + int(sequenced)
        if counted:  # the counts after the ids, the statistics after the gradients
            words += wire.count_words(n_ids, wide)
            floats += sum(
                n * s.optimizer.stat_dim(s.dim) for (s, _), n in zip(specs, sizes, strict=True)
            )
        _expect_batch(meta, payload, data, words, k, floats, "push_many")
        at, fat = k * wire.PUSH_PART_WORDS, 0
        counts = sat = None
        if counted:
            counts = wire.unpack_counts(payload[at + n_ids :], n_ids, wide)
            sat = sum(grad_words)
        parts = []
        for (spec, table), n, size in zip(specs, sizes, grad_words, strict=True):
            dim = spec.dim
            ids = self.check_ids(spec, payload[at : at + n], "push")
            grads = wire.unpack_values(data[fat : fat + size], n * dim, spec.dtype).view(n, dim)
            check_push_grads(spec, ids, grads)
            part_counted = None
            if counts is not None and sat is not None:
                q = spec.optimizer.stat_dim(dim)
                k_part = torch.from_numpy(counts[at - k * wire.PUSH_PART_WORDS :][:n])
                stats = torch.from_numpy(data[sat : sat + n * q]).view(n, q)
                part_counted = check_counted(spec, ids, k_part, stats, takes=True, where="MPI")
                sat += n * q
            parts.append((spec, table, ids, grads, part_counted))
            at, fat = at + n, fat + size
        if sequenced and self.repeated(src, payload, meta, k):
            return _duplicate(rid)
        for spec, table, ids, grads, part_counted in parts:  # back to back
            table.push(ids, grads, checked=spec.nan_policy == "raise", counted=part_counted)
        return self.push_applied(Op.PUSH_MANY, src, rid)

    def repeated(self, src: int, payload: np.ndarray, meta: np.ndarray, k: int) -> bool:
        """Whether a checked, sequenced ``PUSH_MANY`` of ``k`` tables repeats one this
        server applied (then counted as a duplicate of each of its tables); else it is
        recorded as the worker's last. The session is the payload's last word."""
        session, seq = int(payload[-1]), int(meta[wire.W_ARG])
        key = (_BATCH_KEY, src)
        last = self.last_seq.get(key)
        if last is not None and last[0] == session and seq <= last[1]:
            for index in payload[: k * wire.PUSH_PART_WORDS : wire.PUSH_PART_WORDS].tolist():
                name = self.names[index]
                self.duplicates[name] = self.duplicates.get(name, 0) + 1
            return True
        self.last_seq[key] = (session, seq)
        return False

    def push_applied(self, op: int, src: int, rid: int) -> tuple[Any, Any] | None:
        """The reply to an applied push (None where :meth:`reply_lost` says so)."""
        if self.reply_lost(src, rid):
            return None
        return wire.message(wire.header(op, rid)), _EMPTY_F32

    def write(self, meta: np.ndarray, payload: np.ndarray, data: np.ndarray) -> Any:
        """A batched write (:class:`ps.WriteRequest` of ``k`` tables): the table of
        contents, then every part's ids, then every part's clocks in the payload; every
        part's rows, then every part's state in the data. Checked whole (in the C pass, or
        part by part here) before any table changes."""
        k = wire.check_parts(int(meta[wire.W_N]), "write")
        toc, types = _toc(payload, k, wire.WRITE_PART_WORDS, "write")
        specs = [
            self.table_at(index, dim, "write", row_type)
            for (index, dim), row_type in zip(toc[:, [0, 2]].tolist(), types, strict=True)
        ]
        sizes = toc[:, 1].tolist()
        for (spec, _), s in zip(specs, toc[:, 3].tolist(), strict=True):
            if s != spec.state_dim:
                raise ValueError(
                    f"write table {spec.name!r}: the request carries state of width {s}, the "
                    f"table's optimizer has {spec.state_dim}"
                )
        n_all = sum(sizes)
        row_floats = sum(n * s.dim for (s, _), n in zip(specs, sizes, strict=True))
        floats = row_floats + sum(n * s.state_dim for (s, _), n in zip(specs, sizes, strict=True))
        words = k * wire.WRITE_PART_WORDS + 2 * n_all
        if payload.size != words or data.size != floats:
            raise ValueError(
                f"write: message sizes do not match its table of contents: {payload.size} int64 "
                f"payload words and {data.size} floats, expected {words} and {floats}"
            )
        at = k * wire.WRITE_PART_WORDS
        ids_all, clocks_all = payload[at : at + n_all], payload[at + n_all :]
        rows_all, state_all = data[:row_floats], data[row_floats:]
        reply = wire.message(wire.header(Op.WRITE, int(meta[wire.W_ID]))), _EMPTY_F32
        raw_toc = payload[: k * wire.WRITE_PART_WORDS].reshape(k, wire.WRITE_PART_WORDS)
        if self.batched.write(raw_toc, ids_all, clocks_all, rows_all, state_all):
            return reply  # every part at once, in C
        a, fr, fs, parts = 0, 0, 0, []
        for (spec, table), n in zip(specs, sizes, strict=True):
            d, s = spec.dim, spec.state_dim
            ids = self.check_ids(spec, ids_all[a : a + n], "write")
            clocks = torch.from_numpy(clocks_all[a : a + n])
            rows = torch.from_numpy(rows_all[fr : fr + n * d]).view(n, d)
            state = torch.from_numpy(state_all[fs : fs + n * s]).view(n, s)
            check_write(spec, ids, rows, state, clocks)
            parts.append((table, ids, rows, state, clocks))
            a, fr, fs = a + n, fr + n * d, fs + n * s
        for table, ids, rows, state, clocks in parts:  # back to back
            with table.lock:
                table.write(ids, rows, state, clocks)
        return reply

    def inspect(self, op: int, meta: np.ndarray, payload: np.ndarray, data: np.ndarray) -> Any:
        what = "clocks" if op == Op.CLOCKS else "state"
        spec, table = self.table(meta, what)
        n = int(meta[wire.W_N])
        _expect_sizes(meta, data, n, 0)
        ids = self.check_ids(spec, payload[:n], what)
        rid = int(meta[wire.W_ID])
        if op == Op.CLOCKS:
            clocks = table.read_clocks(ids).numpy()  # [n]
            return wire.message(wire.header(Op.CLOCKS, rid, n=n), clocks), _EMPTY_F32
        state = table.read_state(ids).contiguous()  # [n, S]
        head = wire.header(Op.STATE, rid, n=n, dim=spec.state_dim)
        return wire.message(head), state.numpy()

    # ------------------------------------------------------------ checkpoints

    def save(self, request: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Write this shard's rows of the listed tables into the coordinator's folder.

        ``request``: ``{"dir": tmp folder, "tables": [names, in manifest order]}``;
        returns each table's part entries for the manifest.
        """
        folder = request["dir"]
        out: dict[str, list[dict[str, Any]]] = {}
        for i, name in enumerate(request["tables"]):
            if name not in self.tables:
                raise unknown_table(name, self.tables)
            out[name] = [
                write_part(folder, i, f"s{self.shard:04d}-{k:05d}", part)
                for k, part in enumerate(self.tables[name].parts(PART_ROWS))
            ]
        return out

    def load(self, request: dict[str, Any]) -> list[str]:
        """Two phases, so that no shard changes unless every shard read the checkpoint.

        ``{"phase": "stage", "dir": path}`` reads every part, keeps the rows that
        route to this shard and builds the new tables aside; ``{"phase":
        "commit"}`` swaps them in; ``{"phase": "abort"}`` drops them.
        """
        phase = request.get("phase")
        if phase == "stage":
            self.staged = None
            ckpt = read_checkpoint(request["dir"])
            new: dict[str, tuple[TableSpec, Shard]] = {}
            for spec in ckpt.specs:
                mine = [self.mine(part) for part in ckpt.parts(spec.name)]
                part = TablePart.concat(mine, spec.dim, spec.state_dim)
                check_row_ids(spec, part.ids, f"checkpoint {request['dir']!r}")
                new[spec.name] = (spec, self.new_table(spec, part))
            self.staged = new
            return list(new)
        if phase == "commit":
            staged, self.staged = self.staged, None
            if staged is None:
                raise ValueError(f"load: commit without a staged load on server rank {self.rank}")
            for name, (spec, table) in staged.items():
                self.tables[name] = table
                self.specs[name] = spec
                self.index_of(name)
            self.tables_changed()
            return list(staged)
        if phase == "abort":
            self.staged = None
            return []
        raise ValueError(f"load: unknown phase {phase!r}; expected 'stage', 'commit' or 'abort'")

    def check_ids(self, spec: TableSpec, words: np.ndarray, op: str) -> torch.Tensor:
        """:func:`ps.validate.check_ids`, plus: every id must route to this shard."""
        ids = check_ids(spec, torch.from_numpy(words), op)
        if self.num_shards > 1 and ids.numel() > 0:
            shards = shard_of(ids, self.num_shards)  # [n]
            wrong = torch.nonzero(shards != self.shard)
            if wrong.numel() > 0:
                pos = int(wrong[0, 0])
                raise ValueError(
                    f"{op} table {spec.name!r}: id {int(ids[pos])} at position {pos} belongs "
                    f"to shard {int(shards[pos])}, not to server rank {self.rank} (shard "
                    f"{self.shard} of {self.num_shards}); the worker's routing is out of step"
                )
        return ids

    def mine(self, part: TablePart) -> TablePart:
        """The rows of ``part`` that route to this shard."""
        if self.num_shards == 1:
            return part
        return part.select(shard_of(part.ids, self.num_shards) == self.shard)


def _host_share_of_cores() -> int:
    """This rank's share of the cores it may run on: their count over the ranks on this
    host (at least 1)."""
    return max(1, usable_cores() // max(1, detect_launch().local_size))


def round_robin(workers: list[int], last: int) -> list[int]:
    """``workers`` in the order a server looks at them after serving ``last``: the
    ones after it first, then from the start (``last`` itself comes last)."""
    if last not in workers:
        return list(workers)
    i = workers.index(last) + 1
    return workers[i:] + workers[:i]


def wire_rows(spec: TableSpec, rows: torch.Tensor) -> np.ndarray:
    """Pulled float32 rows ``[m, dim]`` as data words, in the table's type (narrow rows
    were widened from the stored ones, so narrowing them again is exact)."""
    return wire.pack_values(rows.to(spec.torch_dtype) if spec.narrow else rows)


def part_rows(spec: TableSpec, rows: torch.Tensor, state: torch.Tensor | None) -> list[np.ndarray]:
    """A ``PULL_MANY`` part's data words: float32 rows ``[m, dim]``, each followed by its
    ``state`` ``[m, S]`` where given; narrow rows in the table's type, then the state
    (float32) of every row after them."""
    if state is None:
        return [wire_rows(spec, rows)]
    if not spec.narrow:
        return [torch.cat([rows, state], dim=1).reshape(-1).numpy()]
    return [wire_rows(spec, rows), state.contiguous().reshape(-1).numpy()]


def _duplicate(request_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The reply to a repeat of an applied ``PUSH_MANY``: acknowledged, not applied."""
    head = wire.header(Op.PUSH_MANY, request_id, flags=wire.FLAG_DUPLICATE)
    return wire.message(head), _EMPTY_F32


def _text_reply(op: int, request_id: int, text: str, *, table: int = -1) -> Any:
    raw = text.encode("utf-8")
    if len(raw) > wire.MAX_TEXT_BYTES:
        raise ValueError(
            f"op {op}: the reply text has {len(raw)} bytes, more than the protocol's "
            f"{wire.MAX_TEXT_BYTES} (too many tables?)"
        )
    return wire.message(
        wire.header(op, request_id, table=table, arg=len(raw)), wire.pack_bytes(raw)
    ), _EMPTY_F32


def _as_words(raw: np.ndarray, dtype: type[np.generic], what: str) -> np.ndarray:
    """``raw`` bytes as an array of ``dtype``; ValueError if they are not whole words."""
    size = np.dtype(dtype).itemsize
    if raw.size % size:
        raise ValueError(
            f"{what} of {raw.size} bytes is not a whole number of {size}-byte words "
            f"({np.dtype(dtype).name})"
        )
    return raw.view(dtype)


def _toc(payload: np.ndarray, k: int, width: int, what: str) -> tuple[np.ndarray, list[str]]:
    """The ``[k, width]`` table of contents that starts a batched request's payload (a
    copy, each part's width word replaced by its ``dim``), with each part's ``n`` and
    ``dim`` checked, and each part's row type on the wire (:func:`ps.mpi.wire.width_word`)."""
    if payload.size < k * width:
        raise ValueError(
            f"{what}: {payload.size} payload words cannot hold the table of contents of "
            f"{k} tables ({k * width} words)"
        )
    toc = payload[: k * width].reshape(k, width).copy()
    toc[:, 2], types = wire.split_widths(toc[:, 2])
    n, dim = toc[:, 1], toc[:, 2]
    if (n < 0).any() or int(n.sum()) > wire.MAX_IDS or (dim <= 0).any():
        raise ValueError(
            f"{what}: the table of contents says ids {n.tolist()} and dims {dim.tolist()}; "
            f"expected ids >= 0 (at most {wire.MAX_IDS} in all) and dims > 0"
        )
    return toc, types


def _expect_batch(
    meta: np.ndarray,
    payload: np.ndarray,
    data: np.ndarray,
    words: int,
    k: int,
    floats: int,
    what: str,
) -> None:
    """A batched request must carry its table of contents plus exactly ``words`` more
    int64 words and ``floats`` floats."""
    width = wire.PULL_PART_WORDS if int(meta[wire.W_OP]) == Op.PULL_MANY else wire.PUSH_PART_WORDS
    want = k * width + words
    if payload.size != want or data.size != floats:
        raise ValueError(
            f"{what}: message sizes do not match its table of contents: {payload.size} int64 "
            f"payload words and {data.size} floats, expected {want} and {floats}"
        )


def _expect_sizes(meta: np.ndarray, data: np.ndarray, words: int, floats: int) -> None:
    """The request must carry exactly ``words`` int64 payload words and ``floats`` floats."""
    n, dim = int(meta[wire.W_N]), int(meta[wire.W_DIM])
    if not 0 <= n <= wire.MAX_IDS:
        raise ValueError(f"request says n={n} ids; expected 0 <= n <= {wire.MAX_IDS}")
    if dim < 0:
        raise ValueError(f"request says dim={dim}; expected dim >= 0")
    got_words = meta.size - HEADER_LEN
    if got_words != words or data.size != floats:
        raise ValueError(
            f"op {int(meta[wire.W_OP])}: message sizes do not match its header (n={n}): "
            f"{got_words} int64 payload words and {data.size} floats, expected {words} "
            f"and {floats}"
        )
