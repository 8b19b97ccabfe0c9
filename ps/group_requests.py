"""Requests over several fixed tables of one dim addressed as ONE id space.

A cache that keeps several tables in one set of slots (``cache.table_group``) works on
*packed* ids: table ``i`` of an :class:`IdSpace` owns the packed ids ``bases[i] ..
bases[i + 1] - 1``, packed id ``bases[i] + id``. :class:`GroupPull` and
:class:`GroupPush` carry one step's request for every table of the space at once, with
their packed ids sorted, so each table's part is one slice of them.

:meth:`ps.Store.pull_groups_async` and :meth:`ps.Store.push_groups_async` take them
beside plain requests. The base class cuts each into one request per table
(:func:`split_pull`, :func:`split_push`) and merges the tables' replies into one
(:func:`merge_pull`); the in-process store serves a group request whole, in its batched
C pass, with neither the cut nor the merge (per table, a step of 26 tables paid ~1 ms
of requests built, checked and joined again, and of replies split and joined again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from comm import Handle
from ps.store import (
    PullRequest,
    PullResult,
    PushRequest,
    Store,
    WriteRequest,
    after,
    check_requests,
)


@dataclass(frozen=True, slots=True, eq=False)
class IdSpace:
    """Tables ``names`` (fixed, one dim) as one id space: table ``i`` owns the packed ids
    ``bases[i] .. bases[i + 1] - 1`` (``bases`` int64 ``[k + 1]``, increasing, from 0)."""

    names: tuple[str, ...]
    bases: np.ndarray

    def __post_init__(self) -> None:
        k = len(self.names)
        b = self.bases
        if k == 0 or not all(isinstance(n, str) for n in self.names):
            raise ValueError(f"IdSpace: names must be one or more table names, got {self.names!r}")
        if not isinstance(b, np.ndarray) or b.dtype != np.int64 or b.shape != (k + 1,):
            got = getattr(b, "dtype", type(b).__name__), getattr(b, "shape", None)
            raise ValueError(f"IdSpace: bases must be int64 [{k + 1}], got {got}")
        if b[0] != 0 or bool((b[1:] < b[:-1]).any()):
            raise ValueError(f"IdSpace: bases must rise from 0, got {b.tolist()}")

    def segments(self, packed: np.ndarray) -> list[tuple[int, int, int]]:
        """``(table index, start, end)`` of each table's run in sorted ``packed`` ids
        (tables without ids left out)."""
        cuts = np.searchsorted(packed, self.bases)  # [k + 1]
        return [
            (i, int(cuts[i]), int(cuts[i + 1]))
            for i in range(len(self.names))
            if cuts[i + 1] > cuts[i]
        ]

    def local(self, packed: np.ndarray, segments: list[tuple[int, int, int]]) -> np.ndarray:
        """The table ids int64 ``[N]`` of the sorted ``packed`` ids whose runs are
        ``segments`` (from :meth:`segments`)."""
        bases = self.bases[[i for i, _, _ in segments]]
        return packed - np.repeat(bases, [b - a for _, a, b in segments])

    def inside(self, packed: np.ndarray) -> bool:
        """Whether sorted ``packed`` int64 ``[N]`` ids all lie in the space (its first and
        last do)."""
        return packed.size == 0 or bool(packed[0] >= 0 and packed[-1] < self.bases[-1])

    def check(self, packed: np.ndarray, what: str) -> None:
        """Raise unless ``packed`` int64 ``[N]`` is sorted and inside the space."""
        if packed.size > 1 and not bool((packed[1:] >= packed[:-1]).all()):
            raise ValueError(f"{what} of tables {'+'.join(self.names)}: ids must be sorted")
        if not self.inside(packed):
            lo, hi = int(packed[0]), int(packed[-1])
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{what} of tables {'+'.join(self.names)}: packed id {bad} is outside "
                f"[0, {int(self.bases[-1])})"
            )


@dataclass(frozen=True, slots=True)
class GroupPull:
    """A pull of every table of ``space`` at once: sorted packed ``ids`` int64 ``[N]``;
    with ``clocks`` int64 ``[N]`` and ``bound`` a conditional pull; ``with_state`` as
    :class:`ps.PullRequest`. Its result is one :class:`ps.PullResult` over the packed
    ids (``positions`` index them)."""

    space: IdSpace
    ids: torch.Tensor
    clocks: torch.Tensor | None = None
    bound: int | None = None
    with_state: bool = False

    def __post_init__(self) -> None:
        _check_host("pull", self.space, "ids", self.ids, torch.int64, (-1,))
        if self.clocks is not None:
            _check_host("pull", self.space, "clocks", self.clocks, torch.int64, self.ids.shape)


@dataclass(frozen=True, slots=True)
class GroupPush:
    """A push to every table of ``space`` at once: packed ``ids`` int64 ``[P]`` (any
    order) and ``grads`` float32 ``[P, D]``; ``counts`` and ``stats`` as
    :class:`ps.PushRequest`'s."""

    space: IdSpace
    ids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor | None = None
    stats: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_host("push", self.space, "ids", self.ids, torch.int64, (-1,))
        n = self.ids.shape[0]
        _check_host("push", self.space, "grads", self.grads, None, (n, -1))
        if self.counts is not None:
            _check_host("push", self.space, "counts", self.counts, torch.int64, (n,))
        if self.stats is not None:
            _check_host("push", self.space, "stats", self.stats, None, (n, -1))


@dataclass(frozen=True, slots=True, eq=False)
class GroupWrite:
    """A write (:class:`ps.WriteRequest`) of every table of ``space`` at once: ``rows``
    float32 ``[P, D]``, ``state`` float32 ``[P, S]`` and ``clocks`` int64 ``[P]`` of the
    distinct packed ``ids`` ``[P]``."""

    space: IdSpace
    ids: torch.Tensor
    rows: torch.Tensor
    state: torch.Tensor
    clocks: torch.Tensor


def _check_host(
    what: str,
    space: IdSpace,
    name: str,
    t: object,
    dtype: torch.dtype | None,
    shape: tuple[int, ...] | torch.Size,
) -> None:
    """Raise unless ``t`` is a host tensor of ``dtype`` (None: any) and ``shape`` (-1:
    any size there): a group request is cut and read on the host."""
    if not isinstance(space, IdSpace):
        raise TypeError(f"group {what}: space must be a ps.group_requests.IdSpace, got "
                        f"{type(space).__name__}")  # fmt: skip
    where = f"group {what} of tables {'+'.join(space.names)}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: {name} must be on the host, got {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{where}: {name} must be {dtype}, got {t.dtype}")
    ok = t.dim() == len(shape) and all(s in (-1, g) for s, g in zip(shape, t.shape, strict=True))
    if not ok:
        want = "[" + ", ".join("*" if s == -1 else str(s) for s in shape) + "]"
        raise ValueError(f"{where}: {name} must have shape {want}, got {list(t.shape)}")


def split_pull(request: GroupPull) -> list[tuple[int, PullRequest]]:
    """The per-table requests of ``request``: ``(start, request)`` with ``start`` the
    position of the table's first id among the packed ids."""
    space = request.space
    packed = request.ids.numpy()
    space.check(packed, "pull")
    segments = space.segments(packed)
    local = torch.from_numpy(space.local(packed, segments))  # [N] table ids
    out = []
    for i, a, b in segments:
        clocks = None if request.clocks is None else request.clocks[a:b]
        req = PullRequest(space.names[i], local[a:b], clocks, request.bound, request.with_state)
        out.append((a, req))
    return out


def merge_pull(parts: list[tuple[int, PullResult]], dim: int) -> PullResult:
    """One result, in the packed request's order, from the per-table results of
    :func:`split_pull`'s requests."""
    if not parts:
        empty = torch.empty(0, dtype=torch.int64)
        return PullResult(torch.empty(0, dim), empty, empty)
    rows = torch.cat([r.rows for _, r in parts])
    clocks = torch.cat([r.clocks for _, r in parts])
    states = [r.state for _, r in parts if r.state is not None]
    state = torch.cat(states) if len(states) == len(parts) else None
    if parts[0][1].positions is None:
        return PullResult(rows, clocks, None, state)
    pos = [r.positions + a for a, r in parts if r.positions is not None]
    return PullResult(rows, clocks, torch.cat(pos), state)


def sorted_push(request: GroupPush) -> GroupPush:
    """``request`` with its ids in increasing order (one stable sort, none when they
    come in order): by table, then by id, so each table's run is a slice in id order,
    as every store walks a push, and repeats of an id keep their order (a store sums
    them so)."""
    packed = request.ids.numpy()
    if packed.size < 2 or bool((packed[1:] >= packed[:-1]).all()):
        return request
    order = torch.from_numpy(np.argsort(packed, kind="stable"))  # [P]
    counts, stats = request.counts, request.stats
    if counts is not None and stats is not None:
        counts, stats = counts[order], stats.index_select(0, order)
    return GroupPush(
        request.space, request.ids[order], request.grads.index_select(0, order), counts, stats
    )


def split_push(request: GroupPush) -> list[PushRequest]:
    """The per-table pushes of ``request``, each a slice of its ids sorted
    (:func:`sorted_push`)."""
    request = sorted_push(request)
    space, counts, stats, grads = request.space, request.counts, request.stats, request.grads
    packed = request.ids.numpy()
    space.check(packed, "push")
    segments = space.segments(packed)
    local = torch.from_numpy(space.local(packed, segments))  # [P] table ids
    return [
        PushRequest(
            space.names[i],
            local[a:b],
            grads[a:b],
            None if counts is None else counts[a:b],
            None if stats is None else stats[a:b],
        )
        for i, a, b in segments
    ]


def split_write(request: GroupWrite) -> list[WriteRequest]:
    """The per-table writes of ``request``, each a slice of its ids in id order (sorted
    here where they are not)."""
    r = request
    ids, rows, state, clocks = r.ids, r.rows, r.state, r.clocks
    packed = ids.numpy()
    if packed.size > 1 and not bool((packed[1:] > packed[:-1]).all()):
        order = torch.from_numpy(np.argsort(packed))  # [P]
        ids, rows, clocks = ids[order], rows.index_select(0, order), clocks[order]
        state = state.index_select(0, order)
        packed = ids.numpy()
    space = r.space
    space.check(packed, "write")
    segments = space.segments(packed)
    local = torch.from_numpy(space.local(packed, segments))  # [P] table ids
    return [
        WriteRequest(space.names[i], local[a:b], rows[a:b], state[a:b], clocks[a:b])
        for i, a, b in segments
    ]


def write_by_table(store: Store, requests: Sequence[WriteRequest | GroupWrite]) -> Handle:
    """:meth:`ps.Store.write_groups_async` for any store: each group write cut into its
    tables' writes, everything sent as one :meth:`ps.Store.write_many_async`."""
    reqs: list[WriteRequest] = []
    for r in check_requests(requests, (WriteRequest, GroupWrite), "write_groups"):
        reqs += split_write(r) if isinstance(r, GroupWrite) else [r]
    return store.write_many_async(reqs)


def pull_by_table(store: Store, requests: Sequence[PullRequest | GroupPull]) -> Handle:
    """:meth:`ps.Store.pull_groups_async` for any store: each group request cut into its
    tables' requests, everything sent as ONE ``pull_many_async``, each group's replies
    merged into its result."""
    items = check_requests(requests, (PullRequest, GroupPull), "pull_groups")
    flat: list[PullRequest] = []
    routes: list[list[tuple[int, int]] | int] = []  # a group's (start, index) parts, or an index
    for r in items:
        if isinstance(r, GroupPull):
            parts = split_pull(r)
            routes.append([(a, len(flat) + j) for j, (a, _) in enumerate(parts)])
            flat += [p for _, p in parts]
        else:
            routes.append(len(flat))
            flat.append(r)
    batch = store.pull_many_async(flat)

    def finish() -> list[PullResult]:
        results = batch.wait()
        out = []
        for r, route in zip(items, routes, strict=True):
            if isinstance(route, int):
                out.append(results[route])
                continue
            dim = store.spec(r.space.names[0]).dim if not route else 0
            out.append(merge_pull([(a, results[i]) for a, i in route], dim))
        return out

    return after(batch, finish, "pull_groups")


def push_by_table(store: Store, requests: Sequence[PushRequest | GroupPush]) -> Handle:
    """:meth:`ps.Store.push_groups_async` for any store: each group request cut into its
    tables' pushes, everything sent as ONE ``push_many_async``."""
    items = check_requests(requests, (PushRequest, GroupPush), "push_groups")
    flat: list[PushRequest] = []
    for r in items:
        flat += split_push(r) if isinstance(r, GroupPush) else [r]
    return store.push_many_async(flat)
