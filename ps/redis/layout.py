"""Where a Redis table lives: its keys, its metadata, and this client's view of it.

Key layout (``P`` = the store's ``prefix``, ``T`` = table name, ``b`` = bucket)::

    P:tables            list    table names in creation order
    P:table:T           string  JSON {"format", "spec": TableSpec.to_json(), "buckets",
                                "incarnation"}   (written with SET NX: creation is atomic)
    P:table:T:inc       string  the incarnation token (chosen once, before the meta)
    {P:T:b}:w           hash    id (int64 LE, 8 bytes) -> row float32[D] LE | clock int64 LE
                                (fp16/bf16 tables: row uint16[D] LE, ps.redis.narrow),
                                "@inc" -> the incarnation token, "@enc" -> 1 KiB of zeros
    {P:T:b}:s           hash    id -> optimizer state float32[S] LE,    (tables with S > 0)
                                "@enc" -> 1 KiB of zeros
    {P:T:b}:t           zset    id -> table step of its last touch      (tables with eviction)
    {P:T:b}:q           hash    worker id -> applied push numbers; @applied, @dup counters
    {P:T}:step          string  pushes applied to the table             (tables with eviction)

Buckets: ``b = ps.routing.shard_of(id, buckets)`` (``buckets`` per table, fixed at
creation and stored in the meta). The ``{...}`` hash tag keeps a bucket's keys on
one Redis Cluster slot, so one script may touch all of them; different buckets
spread over the cluster's nodes. Hashing (rather than ``id // rows_per_bucket``)
bounds the commands per request by ``buckets`` whatever the ids (dynamic tables
use arbitrary int64 ids), spreads a hot id range over all nodes, and gives a
known set of keys (save and stats walk ``buckets`` keys, never KEYS/SCAN).

The "@enc" fields keep every bucket's hashes Redis hash tables (``ps.redis.lua.WIDE``):
a small hash of short values would be a flat list that each id looks up by a scan.

Rows that are not in Redis read as their initial row (``TableSpec.initial_rows``,
computed by the client; a narrow table's rounded to the nearest narrow value, as it
would be stored), clock 0, initial state, on fixed and dynamic tables alike:
a fixed table costs Redis memory only for the rows that were ever pushed. The
incarnation token tells such rows from rows that were lost (``docs/ps_protocol.md``).

The meta's ``format`` is the layout version: :data:`META_FORMAT` since rows may be
narrow. A client refuses a meta of another version, naming both, so a client of an
earlier layout (which would read a narrow row as float32) refuses every table this
one writes; this one still opens tables of :data:`FP32_FORMAT`, the same layout with
fp32 rows only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from ps.local.table import COUNTERS, WRITE_COUNTERS
from ps.redis.hints import AbsentHints
from ps.redis.narrow import stored_bytes, widen
from ps.redis.sequencing import PushNumbers, PushSettle
from ps.table import TableSpec

META_FORMAT = "hybridrec-redis/3"
#: The layout before narrow rows: the same keys and fp32 rows; still opened.
FP32_FORMAT = "hybridrec-redis/2"

#: This client's counters per table: the in-process store's, and the exactly-once ones.
CLIENT_COUNTERS = (*COUNTERS, *WRITE_COUNTERS, "push_calls", "push_retries")


def check_key_part(what: str, value: object) -> str:
    """``value`` if it may be part of a key (prefix, table name); else ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"RedisStore: {what} must be a non-empty string, got {value!r}")
    bad = [c for c in value if c in "{}" or ord(c) < 32]
    if bad:
        raise ValueError(
            f"RedisStore: {what} {value!r} contains {bad[0]!r}; braces and control "
            "characters are not allowed (braces would break the cluster hash tags)"
        )
    return value


@dataclass(slots=True)
class RedisTable:
    """A table as this client sees it: spec, bucket keys, scripts, counters."""

    spec: TableSpec
    buckets: int
    w_keys: list[bytes]  # [B]
    s_keys: list[bytes]  # [B]
    t_keys: list[bytes]  # [B]
    q_keys: list[bytes]  # [B] exactly-once records
    step_key: bytes
    push_src: str
    push_sha: str
    counted_src: str  # the push script of counted pushes (ps.redis.lua.counted_push_script)
    counted_sha: str
    state0: bytes  # float32[S] of a fresh row
    token: bytes  # the incarnation token every bucket's marker must hold
    numbers: PushNumbers  # exactly-once numbers of this client's pushes, per bucket
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLIENT_COUNTERS, 0))
    # Pushes of this client whose replies were not processed yet, in issue order (see
    # RedisStore._settle): each one's completion (replies, second round, eviction).
    pending: list[PushSettle] = field(default_factory=list)
    # Ids this client's reads found missing from Redis (ps.redis.hints): its next push of
    # them sends their initial rows in the first round (no second round). ``push_epoch``
    # counts the pushes built; a read issued before a push adds no hints after it
    # (RedisStore._note_absent).
    absent: AbsentHints = field(default_factory=AbsentHints)
    push_epoch: int = 0

    def next_numbers(self, buckets: list[int]) -> list[tuple[int, int]]:
        """Numbers and watermarks of calls to ``buckets`` (:meth:`PushNumbers.take`),
        counted in ``push_calls``. The caller holds the store's lock."""
        self.counters["push_calls"] += len(buckets)
        return self.numbers.take(buckets)

    @property
    def evicts(self) -> bool:
        return self.spec.max_age_steps is not None or self.spec.capacity is not None

    @property
    def d4(self) -> int:
        """Bytes of a float32 row: a gradient, an initial row as the client computes it."""
        return 4 * self.spec.dim

    @property
    def wb(self) -> int:
        """Bytes of a stored row's weights (2 or 4 per element); its clock follows."""
        return (2 if self.spec.narrow else 4) * self.spec.dim

    def widen(self, raw: np.ndarray) -> np.ndarray:
        """Stored weights uint8 ``[N, wb]`` as float32 ``[N, D]`` (exact)."""
        return widen(raw, self.spec.dtype)

    def stored(self, rows: torch.Tensor) -> np.ndarray:
        """float32 ``rows`` ``[N, D]`` as stored, uint8 ``[N, wb]`` (narrow: rounded to
        nearest; rows read from a narrow table come back exactly)."""
        return stored_bytes(rows, self.spec.dtype)

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``[N, D]`` float32 that ``ids`` ``[N]`` not in Redis read as: their
        initial rows as stored (narrow: rounded to nearest)."""
        rows = self.spec.initial_rows(ids)
        if not self.spec.narrow:
            return rows
        return rows.to(self.spec.torch_dtype).to(torch.float32)

    @property
    def s4(self) -> int:
        return 4 * self.spec.state_dim


def bucket_keys(prefix: str, name: str, buckets: int) -> dict[str, list[bytes]]:
    """The per-bucket keys of table ``name``: ``{"w": [B], "s": [B], "t": [B], "q": [B]}``."""
    tags = [f"{{{prefix}:{name}:{b}}}" for b in range(buckets)]
    return {kind: [f"{t}:{kind}".encode() for t in tags] for kind in ("w", "s", "t", "q")}


def step_key(prefix: str, name: str) -> bytes:
    return f"{{{prefix}:{name}}}:step".encode()


def meta_json(spec: TableSpec, buckets: int, token: bytes) -> str:
    """The text of ``P:table:T``."""
    return json.dumps(
        {
            "format": META_FORMAT,
            "spec": spec.to_json(),
            "buckets": buckets,
            "incarnation": token.decode(),
        }
    )


def parse_meta(name: str, text: bytes, where: str) -> tuple[TableSpec, int, bytes]:
    """``(spec, buckets, token)`` from the text of ``P:table:T``; ValueError naming ``where``
    (the key and the Redis address) if it is not a hybridrec table's meta."""
    try:
        meta = json.loads(text)
        fmt = meta.get("format")
        if fmt not in (META_FORMAT, FP32_FORMAT):
            raise ValueError(
                f"layout version {fmt!r}; this client reads {META_FORMAT!r} (and "
                f"{FP32_FORMAT!r}, fp32 rows only): open it with a hybridrec of that "
                "layout, or save it there and load the checkpoint here"
            )
        token = meta["incarnation"]
        if not isinstance(token, str) or not token:
            raise ValueError(f"incarnation {token!r} is not a token")
        spec = TableSpec.from_json(meta["spec"])
        if fmt == FP32_FORMAT and spec.narrow:
            raise ValueError(
                f"layout version {fmt!r} has fp32 rows only, got dtype {spec.dtype!r} "
                f"(narrow rows are {META_FORMAT!r})"
            )
        return spec, int(meta["buckets"]), token.encode()
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"table {name!r}: the metadata at {where} is not a hybridrec table: {err}"
        ) from None
