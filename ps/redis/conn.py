"""Connections of the Redis store: one server or a Redis Cluster, pipelined raw commands.

The store sends many commands per request (one per bucket) and their arguments
are mostly fixed-width binary blobs, so it packs the RESP protocol itself (with
numpy for the per-id parts) and writes each node's commands in one ``sendall``;
replies are parsed by redis-py's connection (hiredis when installed). redis-py
still does everything else: connecting, AUTH (password or ACL user), TLS,
timeouts, the cluster's slot map.

A request is *started* (all commands written, connections held) and *finished*
later (replies read), which is what makes the store's handles asynchronous.
Writing one node its share of a batch is one *round trip*; a batch given a
``label`` adds its round trips (one per node it reaches, and one per resend) to
:meth:`RedisLink.round_trips` under that label (the store's request counts).
Replies that mean "not executed" are retried transparently: ``NOSCRIPT`` (the
script cache was flushed: load the script, resend), ``MOVED``/``ASK``/``TRYAGAIN``
(cluster slots moving: refresh the slot map or follow the redirect, resend).

Failures become :class:`RedisUnavailableError` (the server cannot be reached or
did not answer within ``socket_timeout``) or :class:`RedisAuthError`, both
naming the address, so a dead Redis is an error within seconds, never a hang.
redis-py's own retries are switched off for that reason.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from ps.redis.lua import sha1

_MAX_REDIRECTS = 8


class RedisUnavailableError(ConnectionError):
    """Redis could not be reached or did not answer in time (the message names the address)."""


class RedisAuthError(PermissionError):
    """Redis refused the credentials (or needs some and got none)."""


def _is_auth_error(err: BaseException) -> bool:
    if isinstance(err, AuthenticationError | redis.exceptions.NoPermissionError):
        return True  # NoPermissionError: an ACL user without rights on the keys (NOPERM)
    text = str(err)
    return isinstance(err, ResponseError) and text.startswith(("NOAUTH", "WRONGPASS", "NOPERM"))


def translate(err: BaseException, address: str, what: str) -> BaseException:
    """The store's exception for a redis-py exception ``err`` (others are returned as they are)."""
    if _is_auth_error(err):
        return RedisAuthError(
            f"{what}: Redis at {address} refused access ({err}); check the store's "
            "username/password (ACL user) settings"
        )
    if isinstance(err, redis.TimeoutError):
        return RedisUnavailableError(
            f"{what}: Redis at {address} did not answer in time ({err}); is it overloaded "
            "or gone? (see RedisStore(socket_timeout=...))"
        )
    if isinstance(err, redis.ConnectionError | OSError):
        return RedisUnavailableError(f"{what}: cannot reach Redis at {address}: {err}")
    return err


# ---------------------------------------------------------------- RESP packing


def pack(args: Sequence[bytes | str | int]) -> bytes:
    """One command in RESP (``*<n>`` then ``$<len>`` bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def bulk_rows(columns: Sequence[np.ndarray]) -> np.ndarray:
    """RESP bulk strings for fixed-width items, vectorised.

    ``columns``: uint8 arrays ``[n, w_k]``; row ``i`` of the result (uint8
    ``[n, sum_k (len("$w_k\\r\\n") + w_k + 2)]``) is the bulk strings of
    ``columns[0][i], columns[1][i], ...`` one after the other.
    """
    n = columns[0].shape[0]
    heads = [b"$%d\r\n" % col.shape[1] for col in columns]
    width = sum(len(h) + col.shape[1] + 2 for h, col in zip(heads, columns, strict=True))
    out = np.empty((n, width), dtype=np.uint8)
    at = 0
    for head, col in zip(heads, columns, strict=True):
        out[:, at : at + len(head)] = np.frombuffer(head, dtype=np.uint8)
        at += len(head)
        out[:, at : at + col.shape[1]] = col
        at += col.shape[1]
        out[:, at : at + 2] = np.frombuffer(b"\r\n", dtype=np.uint8)
        at += 2
    return out


def pack_fixed(head: Sequence[bytes | str | int], rows: np.ndarray, items_per_row: int) -> bytes:
    """A command of ``head`` arguments followed by the bulk strings in ``rows`` (from
    :func:`bulk_rows`, ``items_per_row`` arguments per row)."""
    n_args = len(head) + rows.shape[0] * items_per_row
    first = pack(head)
    return b"*%d\r\n" % n_args + first[first.index(b"\r\n") + 2 :] + rows.tobytes()


# ---------------------------------------------------------------- nodes and batches


@dataclass(slots=True)
class Command:
    """One command of a batch: the key that routes it, its packed bytes, the script it runs."""

    key: bytes
    data: bytes
    script: str | None = None
    asking: str | None = None  # node name of an ASK redirect


@dataclass(slots=True, eq=False)
class _Slot:
    """The replies one batch expects on one channel, in the order they were written."""

    index: list[int]  # positions in the batch's command list
    asking: list[bool]  # per command: an ASKING was written before it
    replies: list[Any] = field(default_factory=list)  # values or ResponseError objects
    error: BaseException | None = None  # the channel broke before all replies came
    done: bool = False


class _Channel:
    """One connection to one node, shared by every request of a store, in FIFO order.

    Requests write their commands under the lock and queue a :class:`_Slot`;
    whoever waits reads replies from the head of the queue, also on behalf of
    requests issued earlier (their replies are kept in their slots). One
    connection per node means Redis applies a store's requests in the order they
    were issued, whatever order their handles are waited in.
    """

    def __init__(self, link: RedisLink, node: str) -> None:
        self.link = link
        self.node = node
        self.lock = threading.Lock()
        self.conn: Any = None
        self.fifo: deque[_Slot] = deque()

    def _connection(self, what: str) -> Any:
        if self.conn is None:
            client = self.link.client_of(self.node)
            try:
                self.conn = client.connection_pool.get_connection()  # connects and AUTHs
            except BaseException as err:
                raise translate(err, self.node, what) from err
        return self.conn

    def send(self, chunks: list[bytes], slot: _Slot, what: str) -> None:
        with self.lock:
            conn = self._connection(what)
            try:
                conn.send_packed_command([b"".join(chunks)])  # one syscall per node
            except BaseException as err:
                self._break(err, what)
                raise translate(err, self.node, what) from err
            self.fifo.append(slot)

    def wait(self, slot: _Slot, deadline: float | None, what: str) -> None:
        """Read replies until ``slot`` has all of its own."""
        while not slot.done:
            with self.lock:
                if slot.done:
                    break
                head = self.fifo[0]
                try:
                    for ask in head.asking:
                        if ask:
                            self._read(deadline)  # +OK of ASKING
                        try:
                            head.replies.append(self._read(deadline))
                        except ResponseError as err:  # an error reply: the connection is fine
                            head.replies.append(err)
                except BaseException as err:
                    self._break(err, what)
                    break
                head.done = True
                self.fifo.popleft()
        if slot.error is not None:
            raise slot.error

    def _read(self, deadline: float | None) -> Any:
        if deadline is None:
            return self.conn.read_response()
        left = deadline - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError(f"no reply within the wait limit from {self.node}")
        if left >= self.link.socket_timeout:  # the socket's own timeout is the tighter bound
            return self.conn.read_response()
        return self.conn.read_response(timeout=left)

    def _break(self, err: BaseException, what: str) -> None:
        """The connection failed: every request still waiting on it fails (lock held)."""
        failure = translate(err, self.node, what)
        for slot in self.fifo:
            slot.error, slot.done = failure, True
        self.fifo.clear()
        if self.conn is not None:
            client = self.link.client_of(self.node)
            self.conn.disconnect()
            client.connection_pool.release(self.conn)
            self.conn = None

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.link.client_of(self.node).connection_pool.release(self.conn)
                self.conn = None


class Batch:
    """Commands written to their nodes' channels; :meth:`finish` gives the replies in order.

    Replies that say a command did not run (NOSCRIPT, MOVED, ASK, TRYAGAIN) make
    ``finish`` resend that command; any other error reply raises once all
    replies are read.
    """

    def __init__(
        self, link: RedisLink, cmds: list[Command], what: str, label: str | None = None
    ) -> None:
        self._link = link
        self._what = what
        self._label = label
        self._cmds = list(cmds)
        self._replies: list[Any] = [None] * len(cmds)
        self._waiting: list[tuple[_Channel, _Slot]] = []
        self._done = False
        self._reached: set[str] = set()  # nodes this batch's first round has written to
        self._send(list(range(len(cmds))), first=True)

    def extend(self, cmds: list[Command]) -> None:
        """Write ``cmds`` too, as part of this batch (before :meth:`finish`): a caller
        that builds a long batch part by part sends each part as it is built, so Redis
        runs the first parts while the client builds the next. Still one round trip per
        node (the replies are read once, by :meth:`finish`)."""
        assert not self._done, "extend a batch before finishing it"
        start = len(self._cmds)
        self._cmds.extend(cmds)
        self._replies.extend([None] * len(cmds))
        self._send(list(range(start, len(self._cmds))), first=True)

    def _send(self, index: list[int], *, first: bool = False) -> None:
        by_node: dict[str, list[int]] = {}
        for i in index:
            c = self._cmds[i]
            node = c.asking if c.asking is not None else self._link.node_of(c.key)
            by_node.setdefault(node, []).append(i)
        if first:  # a round trip per node reached, however many parts were written to it
            self._link.count(self._label, len(by_node.keys() - self._reached))
            self._reached.update(by_node)
        else:
            self._link.count(self._label, len(by_node))
        for node, idx in by_node.items():
            chunks: list[bytes] = []
            asking = []
            for i in idx:
                ask = self._cmds[i].asking is not None
                if ask:
                    chunks.append(b"*1\r\n$6\r\nASKING\r\n")
                chunks.append(self._cmds[i].data)
                asking.append(ask)
            slot = _Slot(index=idx, asking=asking)
            channel = self._link.channel(node)
            channel.send(chunks, slot, self._what)
            self._waiting.append((channel, slot))

    def finish(self, limit_s: float | None = None) -> list[Any]:
        """The replies, retrying commands whose reply says they did not run; raises on errors."""
        if self._done:
            return self._replies
        deadline = None if limit_s is None else time.monotonic() + limit_s
        for _round in range(_MAX_REDIRECTS):
            retry = self._collect(deadline)
            if not retry:
                self._done = True
                return self._replies
            self._send(retry)
        raise RedisUnavailableError(
            f"{self._what}: Redis kept redirecting or rejecting commands after "
            f"{_MAX_REDIRECTS} tries (is the cluster resharding?)"
        )

    def _collect(self, deadline: float | None) -> list[int]:
        waiting, self._waiting = self._waiting, []
        first_error: BaseException | None = None
        for channel, slot in waiting:  # wait for every slot, even after an error
            try:
                channel.wait(slot, deadline, self._what)
            except BaseException as err:
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        retry: list[int] = []
        for channel, slot in waiting:
            for i, reply in zip(slot.index, slot.replies, strict=True):
                cmd = self._cmds[i]
                cmd.asking = None
                if isinstance(reply, NoScriptError):
                    assert cmd.script is not None, "NOSCRIPT for a command without a script"
                    self._link.load_script(channel.node, cmd.script)
                    retry.append(i)
                elif isinstance(reply, MovedError):
                    self._link.refresh()
                    retry.append(i)
                elif isinstance(reply, AskError):
                    cmd.asking = f"{reply.host}:{reply.port}"
                    retry.append(i)
                elif isinstance(reply, TryAgainError):
                    time.sleep(0.05)
                    retry.append(i)
                elif isinstance(reply, ResponseError):
                    failure = translate(reply, channel.node, self._what)
                    if failure is reply:
                        failure = ResponseError(
                            f"{self._what}: Redis at {channel.node} answered an error: {reply}"
                        )
                    first_error = first_error or failure
                else:
                    self._replies[i] = reply
        if first_error is not None:
            raise first_error
        return retry


class RedisLink:
    """The client side of one Redis deployment (a server, or a cluster's masters)."""

    def __init__(
        self,
        *,
        url: str | None,
        host: str,
        port: int,
        db: int,
        username: str | None,
        password: str | None,
        ssl: bool,
        ssl_ca_certs: str | None,
        ssl_certfile: str | None,
        ssl_keyfile: str | None,
        ssl_cert_reqs: str,
        cluster: bool,
        socket_timeout: float,
        connect_timeout: float,
    ) -> None:
        opts: dict[str, Any] = {
            "username": username,
            "password": password,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "retry": Retry(NoBackoff(), 0),  # fail fast: the store names the address
            "health_check_interval": 0,
            "socket_read_size": 1 << 18,  # replies of many rows: fewer, larger reads
        }
        if ssl:
            opts.update(
                ssl=True,
                ssl_ca_certs=ssl_ca_certs,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
                ssl_cert_reqs=ssl_cert_reqs,
            )
        self.cluster = cluster
        self.socket_timeout = socket_timeout
        self._scripts: dict[str, str] = {}  # sha -> source
        self._clients: dict[str, redis.Redis] = {}
        self._channels: dict[str, _Channel] = {}
        self._channels_lock = threading.Lock()
        self._trips: dict[str, int] = {}  # label -> round trips (see round_trips)
        self._trips_lock = threading.Lock()
        self._rc: redis.cluster.RedisCluster | None = None
        if url is not None:
            parsed = redis.connection.parse_url(url)
            host = parsed.get("host", host)
            port = int(parsed.get("port", port))
            db = int(parsed.get("db", db))
            username = username if username is not None else parsed.get("username")
            password = password if password is not None else parsed.get("password")
            opts["username"], opts["password"] = username, password
            if url.startswith("rediss://"):
                opts.setdefault("ssl", True)
        self.address = f"{host}:{port}"
        self.db = db
        self._opts = opts
        if cluster:
            if db != 0:
                raise ValueError(f"RedisStore: Redis Cluster has only db 0, got db={db}")
            try:
                self._rc = redis.cluster.RedisCluster(host=host, port=port, **opts)
            except BaseException as err:
                raise translate(err, self.address, "connect to the Redis Cluster") from err
            for node in self._rc.get_primaries():
                self._clients[node.name] = node.redis_connection
        else:
            self._clients[self.address] = redis.Redis(host=host, port=port, db=db, **opts)

    # ------------------------------------------------------------ routing

    def node_of(self, key: bytes) -> str:
        """Name ``host:port`` of the node that holds ``key``."""
        if self._rc is None:
            return self.address
        node = self._rc.get_node_from_key(key)
        return str(node.name)

    def client_of(self, node: str) -> redis.Redis:
        client = self._clients.get(node)
        if client is None:
            host, port = node.rsplit(":", 1)
            client = redis.Redis(host=host, port=int(port), **self._opts)
            self._clients[node] = client
        return client

    def channel(self, node: str) -> _Channel:
        """The ordered connection to ``node`` (see :class:`_Channel`)."""
        ch = self._channels.get(node)
        if ch is None:
            with self._channels_lock:
                ch = self._channels.setdefault(node, _Channel(self, node))
        return ch

    def masters(self) -> list[str]:
        if self._rc is None:
            return [self.address]
        return [str(n.name) for n in self._rc.get_primaries()]

    def refresh(self) -> None:
        """Re-read the cluster's slot map (after a MOVED reply)."""
        if self._rc is not None:
            self._rc.nodes_manager.initialize()
            for node in self._rc.get_primaries():
                self._clients.setdefault(node.name, node.redis_connection)

    # ------------------------------------------------------------ commands

    def count(self, label: str | None, trips: int) -> None:
        """Add ``trips`` round trips under ``label`` (None: not counted)."""
        if label is not None and trips:
            with self._trips_lock:
                self._trips[label] = self._trips.get(label, 0) + trips

    def round_trips(self) -> dict[str, int]:
        """Round trips so far per label: each is one node's share of one batch written
        (and its replies read), or one command through redis-py."""
        with self._trips_lock:
            return dict(self._trips)

    def command(self, key: bytes | None, *args: Any, what: str, label: str | None = None) -> Any:
        """One command through redis-py (to the node of ``key``, or the first master)."""
        node = self.masters()[0] if key is None else self.node_of(key)
        self.count(label, 1)
        try:
            return self.client_of(node).execute_command(*args)
        except MovedError:
            self.refresh()
            return self.command(key, *args, what=what, label=label)
        except BaseException as err:
            raise translate(err, node, what) from err

    def ping(self, what: str) -> None:
        for node in self.masters():
            try:
                self.client_of(node).ping()
            except BaseException as err:
                raise translate(err, node, what) from err

    def register_script(self, source: str) -> str:
        """Remember ``source`` and load it on every master; returns its SHA1."""
        sha = sha1(source)
        if sha not in self._scripts:
            for node in self.masters():
                self.load_script(node, source)
            self._scripts[sha] = source
        return sha

    def load_script(self, node: str, source: str) -> None:
        try:
            self.client_of(node).script_load(source)
        except BaseException as err:
            raise translate(err, node, "SCRIPT LOAD") from err

    def start(self, cmds: list[Command], what: str, label: str | None = None) -> Batch:
        return Batch(self, cmds, what, label)

    def run(self, cmds: list[Command], what: str, label: str | None = None) -> list[Any]:
        return self.start(cmds, what, label).finish()

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        for client in self._clients.values():
            try:
                client.close()
            except Exception:
                pass
        if self._rc is not None:
            try:
                self._rc.close()
            except Exception:
                pass
        self._clients.clear()


def evalsha(
    sha: str, script: str, keys: Sequence[bytes], args: Sequence[bytes | str | int]
) -> Command:
    """An EVALSHA command routed by its first key (all keys share one hash slot)."""
    data = pack(["EVALSHA", sha, len(keys), *keys, *args])
    return Command(key=keys[0], data=data, script=script)


def raw(key: bytes, data: bytes) -> Command:
    """An already packed command routed by ``key``."""
    return Command(key=key, data=data)
