"""A group request (every table of an id space at once, by packed ids:
:mod:`ps.group_requests`) as the MPI store's batched messages, built in bulk.

The base class cuts a group request into one request per table, and
:meth:`ps.mpi.MPIStore.pull_many_async` / ``push_many_async`` then check, route and
slice each table's part in Python: ~50 us a table, 1-2 ms a step for the 26 tables of
the DLRM job's cache. Here the checks run once over the packed arrays, one routing
orders every table's ids by server at once, and each server's message takes its ids,
clocks, gradients, counts and statistics as slices of them: the words the per-table
path sends for the same request, in the same order.

A request this does not take goes the per-table way, which sends it or raises the
error that names the table and the row: narrow tables (their values travel in their
type), a table with ``max_age_steps`` (its pushes reach every server), tables of
different widths or statistics, a catalogue whose rows are not the space's, and any
value a check would refuse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ps.group_requests import GroupPull, GroupPush, IdSpace
from ps.mpi import wire
from ps.routing import shard_of
from ps.store import PullResult
from ps.table import TableSpec
from ps.validate import all_finite


@dataclass(frozen=True, slots=True)
class Block:
    """One server's share of a group request: ``at`` the packed positions it holds
    (int64 ``[n]``, increasing; None: all of them, one server), ``parts`` its tables'
    runs ``(table, start, count)`` within the block, in the space's table order (each
    run's ids increasing, as the per-table path orders a table's share)."""

    server: int
    at: np.ndarray | None
    parts: list[tuple[int, int, int]]

    @property
    def size(self) -> int:
        return sum(c for _, _, c in self.parts)

    def take(self, x: np.ndarray) -> np.ndarray:
        """The block's rows of ``x`` ``[N, ...]`` (a view for the one-server block)."""
        return x if self.at is None else x[self.at]


def in_bulk(specs: list[TableSpec], space: IdSpace, dim: int) -> bool:
    """Whether tables ``specs`` (the space's, in order) go in bulk: fixed float32 tables
    of width ``dim``, each with as many rows as its run of packed ids, none with
    ``max_age_steps``."""
    rows = np.diff(space.bases).tolist()
    return len(specs) == len(rows) and all(
        s.num_rows == n and not s.narrow and s.dim == dim and s.max_age_steps is None
        for s, n in zip(specs, rows, strict=True)
    )


def blocks(space: IdSpace, packed: np.ndarray, servers: int) -> tuple[np.ndarray, list[Block]]:
    """The table ids int64 ``[N]`` of sorted ``packed`` ids inside ``space``, and each
    server's block (a server with none left out). Row ``id`` lives on server
    ``shard_of(id, servers)``, as for a table's own requests."""
    segments = space.segments(packed)
    local = space.local(packed, segments)  # [N]
    if servers == 1:
        return local, [Block(0, None, [(i, a, b - a) for i, a, b in segments])]
    shards = shard_of(torch.from_numpy(local), servers).numpy()  # [N]
    order = np.argsort(shards, kind="stable")  # [N] server 0's positions first, in order
    counts = np.bincount(shards, minlength=servers).tolist()
    table = np.repeat(
        np.array([i for i, _, _ in segments], dtype=np.int64), [b - a for _, a, b in segments]
    )  # [N] each packed position's table
    out, start = [], 0
    for s, c in enumerate(counts):
        if c:
            at = order[start : start + c]
            t = table[at]  # [c] non-decreasing
            edges = [0, *(np.flatnonzero(t[1:] != t[:-1]) + 1).tolist(), c]
            parts = [(int(t[a]), a, b - a) for a, b in zip(edges[:-1], edges[1:], strict=True)]
            out.append(Block(s, at, parts))
        start += c
    return local, out


# ------------------------------------------------------------------ pushes


@dataclass(frozen=True, slots=True)
class PushMessage:
    """One server's ``PUSH_MANY`` of a group push: its table of contents ``[k, 3]``,
    table ids ``[n]`` and gradients ``[n * D]``; counted: every part's update counts
    ``[n]`` and statistics ``[n * Q]`` (a plain part's ones and zeros)."""

    block: Block
    toc: np.ndarray
    ids: np.ndarray
    grads: np.ndarray
    counted: tuple[np.ndarray, np.ndarray] | None


def push_messages(
    request: GroupPush, specs: list[TableSpec], index: list[list[int]], servers: int
) -> list[PushMessage] | None:
    """The messages of ``request`` (its ids sorted: :func:`ps.group_requests.sorted_push`)
    to the tables ``specs`` of its space, table ``i`` being number ``index[i][s]`` on
    server ``s``; None where the per-table path must take it (see the module)."""
    r, space = request, request.space
    packed = r.ids.numpy()
    n = packed.size
    if n == 0 or r.grads.dtype != torch.float32 or (r.counts is None) != (r.stats is None):
        return None
    dim = int(r.grads.shape[1])
    if not in_bulk(specs, space, dim) or not space.inside(packed):
        return None
    if not all_finite(r.grads.detach()):
        return None  # the per-table path names the row (or drops it: nan_policy "skip")
    grads = r.grads.detach().numpy()  # [N, D]
    plain = _plain_tables(r, specs, packed)
    if plain is None:
        return None
    local, parts = blocks(space, packed, servers)
    width = wire.width_word(dim, "fp32")
    out = []
    for b in parts:
        toc = np.array([(index[i][b.server], c, width) for i, _, c in b.parts], dtype=np.int64)
        counted = None
        if r.counts is not None and not all(plain[i] for i, _, _ in b.parts):
            assert r.stats is not None  # counts and stats come together (checked above)
            counts = b.take(r.counts.numpy()).copy()  # [n]
            stats = b.take(r.stats.detach().numpy()).copy()  # [n, Q]
            for i, a, c in b.parts:
                if plain[i]:  # as one update each: the per-table path's ones and zeros
                    counts[a : a + c] = 1
                    stats[a : a + c] = 0.0
            counted = (counts, stats.reshape(-1))
        ids = b.take(local)
        out.append(PushMessage(b, toc, ids, b.take(grads).reshape(-1), counted))
    return out


def _plain_tables(r: GroupPush, specs: list[TableSpec], packed: np.ndarray) -> list[bool] | None:
    """Per table of the space, whether its part of the push is a plain one (every table
    for a push without counts; else :func:`ps.validate.plain_counted` of its part); None
    where a count or statistic fails the checks (the per-table path says which)."""
    if r.counts is None:
        return [True] * len(specs)
    assert r.stats is not None
    counts, stats = r.counts.numpy(), r.stats.detach()
    q = {s.optimizer.stat_dim(s.dim) for s in specs}
    if stats.dtype != torch.float32 or q != {int(stats.shape[1])} or int(counts.min()) < 1:
        return None
    values = stats.numpy()
    if values.size and not (float(values.min()) >= 0 and float(values.max()) < math.inf):
        return None
    # A part is counted where a count is not 1 or an id repeats (ids of different tables
    # differ, so a repeat is within one part).
    counted = counts != 1  # [N]
    counted[1:] |= packed[1:] == packed[:-1]
    before = np.concatenate([[0], np.cumsum(counted)])  # [N + 1]
    cuts = np.searchsorted(packed, r.space.bases)  # [k + 1]
    return [
        s.optimizer.sums_exactly() or int(before[cuts[i + 1]] - before[cuts[i]]) == 0
        for i, s in enumerate(specs)
    ]


# ------------------------------------------------------------------ pulls


@dataclass(frozen=True, slots=True)
class PullMessage:
    """One server's ``PULL_MANY`` of a group pull: its payload (table of contents ``[k,
    4]``, then the ids, each part's clocks after its ids when conditional) and the reply's
    size."""

    block: Block
    words: tuple[np.ndarray, ...]
    reply_words: int
    floats: int


@dataclass(frozen=True, slots=True)
class PullPlan:
    """A group pull's messages and what reads their replies into one result."""

    messages: list[PullMessage]
    size: int  # N, the packed ids
    dim: int
    width: int  # floats a row comes back in: dim (+ the state riding along)
    conditional: bool
    names: tuple[str, ...]

    def result(self, replies: list[tuple[np.ndarray, np.ndarray, int]]) -> PullResult:
        """The group's result from each message's ``(reply words, reply data, server
        rank)``, in the packed request's order (a conditional pull's rows by position)."""
        got = [
            _read_reply(m, *reply, self.width, self.conditional, self.names)
            for m, reply in zip(self.messages, replies, strict=True)
        ]
        if self.conditional:
            pos = np.concatenate([p for p, _, _ in got])  # [M] packed positions
            clocks = np.concatenate([c for _, c, _ in got])
            rows = np.concatenate([r for _, _, r in got])
            if len(got) > 1:
                order = np.argsort(pos, kind="stable")
                pos, clocks, rows = pos[order], clocks[order], rows[order]
            positions: torch.Tensor | None = torch.from_numpy(pos)
        elif len(got) == 1 and self.messages[0].block.at is None:
            _, clocks, rows = got[0]
            positions = None
        else:
            rows = np.empty((self.size, self.width), dtype=np.float32)
            clocks = np.empty(self.size, dtype=np.int64)
            for m, (_, c, r) in zip(self.messages, got, strict=True):
                rows[m.block.at] = r
                clocks[m.block.at] = c
            positions = None
        state = None
        if self.width > self.dim:  # each row's optimizer state rode along after its values
            state = torch.from_numpy(np.ascontiguousarray(rows[:, self.dim :]))
            rows = np.ascontiguousarray(rows[:, : self.dim])
        return PullResult(torch.from_numpy(rows), torch.from_numpy(clocks), positions, state)


def pull_plan(
    request: GroupPull, specs: list[TableSpec], index: list[list[int]], servers: int
) -> PullPlan | None:
    """The messages of ``request`` to the tables ``specs`` of its space (``index`` as for
    :func:`push_messages`); None where the per-table path must take it."""
    r, space = request, request.space
    packed = r.ids.numpy()
    n = packed.size
    if n == 0 or not specs or (r.clocks is None) != (r.bound is None):
        return None
    bound = r.bound
    if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
        return None
    dim = specs[0].dim
    states = {s.state_dim for s in specs}
    if not in_bulk(specs, space, dim) or len(states) != 1:
        return None
    if n > 1 and not bool((packed[1:] >= packed[:-1]).all()) or not space.inside(packed):
        return None
    width = dim + (states.pop() if r.with_state else 0)
    conditional = r.clocks is not None
    clocks = r.clocks.numpy() if r.clocks is not None else None
    local, parts = blocks(space, packed, servers)
    code = wire.width_word(dim, "fp32")
    messages = []
    for b in parts:
        toc = np.array(
            [(index[i][b.server], c, code, -1 if bound is None else bound) for i, _, c in b.parts],
            dtype=np.int64,
        )
        ids = b.take(local)
        words: list[np.ndarray] = [toc]
        if clocks is None:
            words.append(ids)
        else:  # each part's ids, then its caller clocks
            clk = b.take(clocks)
            for _, a, c in b.parts:
                words += [ids[a : a + c], clk[a : a + c]]
        size = b.size
        reply = len(b.parts) * wire.REPLY_PART_WORDS + size * (2 if conditional else 1)
        messages.append(PullMessage(b, tuple(words), reply, size * width))
    return PullPlan(messages, n, dim, width, conditional, space.names)


def _read_reply(
    m: PullMessage,
    reply: np.ndarray,
    data: np.ndarray,
    server: int,
    width: int,
    conditional: bool,
    names: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One server's reply as ``(packed positions [M] (conditional; else empty), clocks
    [M], rows [M, width])``, checked against what was asked."""
    parts = m.block.parts
    k = len(parts)
    body, toc = wire.pull_reply_parts(reply, k, server)
    got, flags = toc[:, 0], toc[:, 1]  # [k] rows each part returned, and its flags
    asked = np.array([c for _, _, c in parts], dtype=np.int64)
    has_positions = (flags & wire.FLAG_POSITIONS) != 0
    ok = ((got >= 0) & (got <= asked)) if conditional else got == asked
    ok &= has_positions == conditional
    if not bool(ok.all()):
        j = int(np.flatnonzero(~ok)[0])
        raise wire.pull_part_error(
            server, int(got[j]), bool(has_positions[j]), names[parts[j][0]], int(asked[j])
        )
    total = int(got.sum())
    rows = data[: total * width].reshape(total, width)
    start = k * wire.REPLY_PART_WORDS
    if not conditional:
        return np.empty(0, dtype=np.int64), body[start : start + total], rows
    # Part p's clocks sit at start + 2 (m_0 + .. + m_{p-1}), its positions right after:
    # row j of part p at start + 2 before_p + j, where arange gives before_p + j.
    before = np.cumsum(got) - got  # [k]
    at = np.arange(total) + np.repeat(start + before, got)  # [M]
    clocks = body[at]
    inside = body[at + np.repeat(got, got)]  # [M] positions within each part
    pos = inside + np.repeat(np.array([a for _, a, _ in parts], dtype=np.int64), got)
    return (pos if m.block.at is None else m.block.at[pos]), clocks, rows
