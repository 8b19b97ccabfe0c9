"""A Redis table's rows to and from checkpoint parts (:mod:`ps.checkpoint`).

Save writes the rows present in Redis (a fixed table's untouched rows are left out
and read back as initial rows by every store's load), each bucket read in atomic
chunks by a script (HSCAN cursor, rows and state together, the bucket's incarnation
marker checked); a save during concurrent pushes is consistent per row, not across
the table. Load empties the table's buckets and writes the checkpoint's rows with
HSET (and ZADD for tables with eviction).

A narrow (fp16/bf16) table's parts hold its rows widened to float32 (exact; the spec
in the manifest records the dtype), and loading rounds float32 rows to the nearest
narrow value (exact for rows saved from a table of that dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from ps.checkpoint import TablePart
from ps.redis.conn import Command, RedisLink, bulk_rows, evalsha, pack_fixed, raw
from ps.redis.layout import RedisTable
from ps.redis.lua import SNAPSHOT

#: Rows per checkpoint part file written by ``RedisStore.save``.
PART_ROWS = 1 << 20
_WRITE_ROWS = 1000  # rows per HSET when loading
_SCAN_COUNT = 1000  # HSCAN COUNT hint when saving
_BATCH_COMMANDS = 256  # commands written in one go when loading


def bucket_rows(
    link: RedisLink, sha: str, t: RedisTable, b: int, what: str, gone: Callable[[int], Exception]
) -> Iterator[TablePart]:
    """The rows of bucket ``b`` in chunks, each chunk read atomically (``sha``: the
    SNAPSHOT script); ``gone(b)`` is raised when the bucket's marker is not the table's."""
    cursor = b"0"
    s, wb = t.spec.state_dim, t.wb
    has_state = b"1" if s else b"0"
    seen: set[int] = set()
    while True:
        cmd = evalsha(
            sha,
            SNAPSHOT,
            [t.w_keys[b], t.s_keys[b]],
            [cursor, _SCAN_COUNT, has_state, t.state0, t.token],
        )
        cursor, ids_b, vals_b, st_b, ok = link.run([cmd], what)[0]
        if int(ok) != 1:
            raise gone(b)
        ids = np.frombuffer(ids_b, dtype="<i8").astype(np.int64)
        if ids.size:
            vals = np.frombuffer(vals_b, dtype=np.uint8).reshape(-1, wb + 8)
            state = np.frombuffer(st_b, dtype="<f4").reshape(ids.size, s)
            keep = np.fromiter((int(i) not in seen for i in ids), dtype=bool, count=ids.size)
            seen.update(ids.tolist())  # HSCAN may return an entry twice
            yield TablePart(
                ids=torch.from_numpy(ids[keep].copy()),
                weights=torch.from_numpy(t.widen(vals[keep, :wb].copy())),
                state=torch.from_numpy(state[keep].astype(np.float32)),
                clocks=torch.from_numpy(vals[keep, wb:].copy().view("<i8").reshape(-1)),
            )
        if cursor in (b"0", 0, "0"):
            return


def table_parts(
    link: RedisLink, sha: str, t: RedisTable, what: str, gone: Callable[[int], Exception]
) -> Iterator[TablePart]:
    """All rows of ``t`` in parts of about :data:`PART_ROWS` rows."""
    buf: list[TablePart] = []
    rows = 0
    for b in range(t.buckets):
        for part in bucket_rows(link, sha, t, b, what, gone):
            buf.append(part)
            rows += part.num_rows
            if rows >= PART_ROWS:
                yield TablePart.concat(buf, t.spec.dim, t.spec.state_dim)
                buf, rows = [], 0
    if buf or rows == 0:
        yield TablePart.concat(buf, t.spec.dim, t.spec.state_dim)


def write_rows(
    link: RedisLink,
    t: RedisTable,
    part: TablePart,
    order: torch.Tensor,
    calls: list[tuple[int, int, int]],
    what: str,
) -> None:
    """Write ``part``'s rows (weights | clock, state, touch stamp 0) into their buckets;
    ``order`` sorts them by bucket and ``calls`` are the ``(bucket, lo, hi)`` runs."""
    cmds = row_commands(t, part, order, calls)
    for start in range(0, len(cmds), _BATCH_COMMANDS):
        link.run(cmds[start : start + _BATCH_COMMANDS], what)


def row_commands(
    t: RedisTable, part: TablePart, order: torch.Tensor, calls: list[tuple[int, int, int]]
) -> list[Command]:
    """The commands of :func:`write_rows` (``HSET`` of the rows with their clocks and of
    their state, ``ZADD`` of a touch stamp 0 where the table evicts), not sent."""
    n = part.num_rows
    if n == 0:
        return []
    ids = part.ids[order].numpy().astype("<i8").view(np.uint8).reshape(n, 8)
    w = t.stored(part.weights[order])  # [n, wb] (narrow tables: rounded to nearest)
    c = part.clocks[order].numpy().astype("<i8").view(np.uint8).reshape(n, 8)
    w_rows = bulk_rows([ids, np.concatenate([w, c], axis=1)])
    s_rows = None
    if t.spec.state_dim:
        st = part.state[order].numpy().astype("<f4").view(np.uint8).reshape(n, t.s4)
        s_rows = bulk_rows([ids, st])
    z_rows = bulk_rows([np.broadcast_to(np.frombuffer(b"0", np.uint8), (n, 1)), ids])
    cmds: list[Command] = []
    for b, lo, hi in calls:
        for s in range(lo, hi, _WRITE_ROWS):
            e = min(hi, s + _WRITE_ROWS)
            cmds.append(raw(t.w_keys[b], pack_fixed(["HSET", t.w_keys[b]], w_rows[s:e], 2)))
            if s_rows is not None:
                cmds.append(raw(t.s_keys[b], pack_fixed(["HSET", t.s_keys[b]], s_rows[s:e], 2)))
            if t.evicts:
                cmds.append(raw(t.t_keys[b], pack_fixed(["ZADD", t.t_keys[b]], z_rows[s:e], 2)))
    return cmds
