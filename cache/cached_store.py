"""``CachedStore``: a :class:`ps.Store` that keeps hot rows on the worker.

Wrap any store; whatever takes a store (``embedding.EmbeddingCollection``) then
trains through the cache::

    store = cache.CachedStore(ps.InProcessStore(), cache.CacheConfig(
        capacity_fraction=0.1, read_bound=4, write_bound=4))
    emb = EmbeddingCollection(tables, store=store)
    ...
    store.prefetch("items", next_batch_item_ids)   # while this batch computes
    ...
    store.flush()                                   # end of training / before a checkpoint
    print(store.cache_stats()["items"]["hit_rate"])

Semantics (per row, HET-style; the full rules are in ``docs/cache.md``):

* ``pull``: one conditional pull per request carries the copy clocks of the
  cached ids; the PS returns only rows more than ``read_bound`` past their copy,
  plus the misses. Served rows are the copies (PS row + local updates).
* ``push``: gradients go to the cached copy at once (an SGD step of
  ``local_lr``) and into the row's pending sum; a row's sum is pushed when more
  than ``write_bound`` updates are pending, when it is evicted and on
  :meth:`flush`. The PS applies its own optimizer to each pushed sum (one update,
  one clock tick). ``push`` returns once the cache took the update; rows pushed
  to the PS are in flight until :meth:`flush` (or a later request) waits.
* a conditional pull through the cache (``clocks``/``bound`` given), ``clocks``,
  ``state`` and ``stats`` go to the wrapped store: they describe the PS, which
  lacks the pending updates until :meth:`flush`.

Batched requests: :meth:`CachedStore.pull_many_async` plans every table's fetch and
sends them to the wrapped store as ONE batched pull (one message per server);
:meth:`CachedStore.push_many_async` applies every table's gradients to the cache and
sends what is due (and the sums of evicted rows) as ONE batched push. A cache shared by
tables sends its part as a group request over their id space
(:mod:`ps.group_requests`, through ``pull_groups_async`` / ``push_groups_async``). The
per-table ``pull_async`` / ``push_async`` are the same with one table. A step of a
training loop is then one pull and one push message per server::

    store.prefetch_many([ps.PullRequest(t, next_ids[t]) for t in tables])  # rides along
    rows = store.pull_many([ps.PullRequest(t, ids[t]) for t in tables])
    ...
    store.push_many([ps.PushRequest(t, ids[t], grads[t]) for t in tables])

:meth:`prefetch_many` sends nothing: the next batch's ids ride on the next pull of
their table, in the same request as that pull (leaving out the ids that pull asks
for anyway), and are installed right after it. :meth:`prefetch` sends at once, as
its own request, for callers that know the next batch only later.

Requests to the wrapped store are made only from the calling thread (the MPI
store is not thread-safe); a prefetch is an async request that the next
operation on its table completes. Each table's structures are guarded by a lock,
so several threads may use the cache.

It relies on the wrapped store applying one worker's requests in the order they
were issued (the in-process, MPI and Redis stores all do), so a pull issued after
a push sees it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cache.config import CacheConfig
from cache.joined_fetch import Joined, join
from cache.table_cache import Fetch, TableCache
from cache.table_group import GroupClocks, TableGroup
from comm import Handle, boundary
from comm.device import exact_device
from ps import PullRequest, PullResult, PushRequest, Store, TableSpec, WriteRequest
from ps.group_requests import GroupPull, GroupPush, GroupWrite, IdSpace
from ps.store import after, check_requests, first_of
from ps.validate import all_finite, check_grads, check_id_tensor, check_ids, finite_rows


class CachedStore(Store):
    """A hot-row cache in front of ``store`` (see the module docstring).

    ``device``: None (default) keeps each cached row in a record in host memory with its
    metadata (the CPU path). A ``torch.device`` keeps the rows and their pending sums in
    that device's memory (:mod:`cache.device_rows`; a GPU worker's cache in HBM): pulls
    return rows there, pushes take gradients there (host ones are moved), hits never
    leave it, and only the rows due to the store cross to the host. ``cpu`` runs that
    same path on host tensors.

    ``close()`` flushes; it closes ``store`` too only if ``owns_store`` is True.
    """

    def __init__(
        self,
        store: Store,
        config: CacheConfig,
        *,
        owns_store: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"CachedStore: store must be a ps.Store, got {type(store).__name__}")
        if isinstance(store, CachedStore):
            raise TypeError("CachedStore: the store is already a CachedStore; wrap it only once")
        if not isinstance(config, CacheConfig):
            raise TypeError(
                f"CachedStore: config must be a cache.CacheConfig, got {type(config).__name__}"
            )
        self.inner = store
        self.config = config
        # Whether announced batches are fetched ahead (CacheConfig.prefetch): not by
        # default, since riding on the current pull hides no latency.
        self.prefetching = config.prefetches()
        # Where the cached rows live (None: host records); plain "cuda" is the current GPU.
        self.device = None if device is None else exact_device(device)
        self._owns = bool(owns_store)
        self._caches: dict[str, TableCache] = {}  # cache name (table, or group) -> cache
        self._groups: dict[str, TableGroup] = {}  # cache name -> its tables (shared caches)
        self._members: dict[str, str] = {}  # table -> the name of the cache holding it
        self._specs: dict[str, TableSpec] = {}  # table -> its spec (requests are checked on it)
        self._lock = threading.Lock()  # guards the four maps
        self._closed = False

    def __repr__(self) -> str:
        where = "" if self.device is None else f", device={str(self.device)!r}"
        return f"CachedStore({self.inner!r}, {self.config!r}{where})"

    def _cache(self, table: str) -> TableCache:
        return self._member(table)[0]

    def _member(self, table: str) -> tuple[TableCache, TableGroup | None]:
        """The cache holding ``table`` (made now if it has none), and its group if the
        cache is shared."""
        name = self._members.get(table) if isinstance(table, str) else None
        if name is None:
            self._ensure([table])
            name = self._members[table]
        return self._caches[name], self._groups.get(name)

    def _ensure(self, tables: Sequence[str]) -> None:
        """Make the caches of ``tables`` (one request's) that have none yet. With
        ``group_tables`` those of them that are fixed and share a dim, a row type and a
        local step (size, or optimizer; and pushed statistic) share one cache: tables first
        requested together are cached together."""
        with self._lock:
            new: list[str] = []
            for t in tables:
                if (not isinstance(t, str) or t not in self._members) and t not in new:
                    new.append(t)
            specs = [self.inner.spec(t) for t in new]  # raises for an unknown table
            groups: dict[tuple[object, ...], list[TableSpec]] = {}
            for spec in specs:
                if self.config.group_tables and spec.num_rows is not None:
                    # One record layout and local step: the same row type, pushed
                    # statistic (counted pushes) and optimizer stepping the copies.
                    stat = spec.optimizer.stat_dim(spec.dim)
                    step = self.config.local_optimizer(spec)
                    key = (spec.dim, spec.dtype, self.config.lr_for(spec), stat, step)
                    groups.setdefault(key, []).append(spec)
                else:
                    self._register([spec])
            for mates in groups.values():
                self._register(mates)

    def _register(
        self, specs: list[TableSpec], state: dict[str, torch.Tensor] | None = None
    ) -> str:
        """Make the cache of ``specs`` (one table, or a group), filled from ``state``."""
        counted = self.inner.counted_pushes  # the PS applies a pushed row's updates
        values = self.inner.value_writes  # the PS takes rows written back
        if len(specs) == 1:
            tc = TableCache(
                specs[0], self.config, self.inner, device=self.device, counted=counted,
                values=values,
            )  # fmt: skip
            group = None
        else:
            group = TableGroup.of(specs)
            capacity = sum(self.config.capacity(s) for s in specs)
            tc = TableCache(
                group.spec,
                self.config,
                GroupClocks(group, self.inner),
                capacity=capacity,
                largest_table=max(int(s.num_rows or 0) for s in specs),
                device=self.device,
                counted=counted,
                values=values,
            )
            self._groups[tc.name] = group
        if state is not None:
            tc.import_state(state)
        self._caches[tc.name] = tc
        for s in specs:
            self._members[s.name] = tc.name
            self._specs[s.name] = s
        return tc.name

    def _packed(self, table: str, ids: torch.Tensor, what: str) -> torch.Tensor:
        """``ids`` checked against ``table`` and, for a shared cache, packed (int64 CPU)."""
        return self._pack(self._members[table], [(table, ids)], what)[0]

    def _pack(
        self, name: str, parts: list[tuple[str, object]], what: str
    ) -> tuple[torch.Tensor, list[int]]:
        """The ids of ``parts`` (``(table, ids)`` of tables cached by ``name``), checked
        and, for a shared cache, packed, one part after the other: ``(ids [N] int64 CPU,
        sizes)``. A shared cache checks and packs all its tables' parts at once."""
        group = self._groups.get(name)
        if group is not None:
            return group.pack_many(parts, what)
        ids = [check_ids(self._specs[t], x, what).cpu() for t, x in parts]
        return (ids[0] if len(ids) == 1 else torch.cat(ids)), [int(x.numel()) for x in ids]

    @staticmethod
    def _route(
        request: PullRequest, group: TableGroup | None, inner: list[PullRequest | GroupPull]
    ) -> int:
        """Append the store request of a cache's request to ``inner`` (a shared cache's
        request of packed ids: a group request over its id space); its index there."""
        r = request
        if group is None:
            inner.append(r)
        else:
            inner.append(GroupPull(group.space, r.ids, r.clocks, r.bound, r.with_state))
        return len(inner) - 1

    def _settle(self, tc: TableCache, *, pushing: bool = False) -> None:
        """Finish the table's fetch in flight, so nothing else changes its slots meanwhile.

        Rows evicted so far go to the PS now, before any request can read them, unless
        the caller is about to push (the push carries them)."""
        if tc.inflight is not None:
            tc.finish(tc.inflight)
        if not pushing and tc.evicted:
            tc.send_evicted()
            self._send([tc])

    def _send(self, caches: Sequence[TableCache]) -> None:
        """Send what the outboxes of ``caches`` hold as one batched push and one batched
        write of copies (nothing if they are empty; the two hold distinct rows); each
        table keeps the handles for :meth:`flush`."""
        pushes: list[Any] = []  # (cache, ids, grads, counted)
        writes: list[Any] = []  # (cache, ids, rows, (clocks, state))
        senders = []
        for tc in caches:
            box = tc.take_outbox()
            for ids, grads, counted, write in box:
                (writes if write else pushes).append((tc, ids, grads, counted))
            if box:
                senders.append(tc)
        handles = []
        if pushes:
            handles.append(self._send_pushes(pushes))
        if writes:
            handles.append(self._send_writes(writes))
        for handle in handles:
            for tc in senders:
                tc.sent(handle)

    def _send_pushes(self, pushes: list[Any]) -> Handle:
        """One batched push of ``(cache, ids, grads, counted)`` items."""
        # Rows on a device: every table's pushed rows (and statistics) in one copy (host
        # records hold host rows on every worker: nothing crosses).
        stats = {k: c[1] for k, (_, _, _, c) in enumerate(pushes) if c is not None}
        host = [g for _, _, g, _ in pushes] + list(stats.values())
        if self.device is not None:
            host = boundary.to_host(host)
        host_stats = dict(zip(stats, host[len(pushes) :], strict=True))
        requests: list[PushRequest | GroupPush] = []
        for k, (tc, ids, _, counted) in enumerate(pushes):
            grads = host[k]
            counts = None if counted is None else counted[0]
            stat = host_stats.get(k)
            group = self._groups.get(tc.name)
            if group is None:
                requests.append(PushRequest(tc.name, ids, grads, counts, stat))
            else:
                requests.append(GroupPush(group.space, ids, grads, counts, stat))
        return self.inner.push_groups_async(requests)

    def _send_writes(self, writes: list[Any]) -> Handle:
        """One batched write of copies, ``(cache, ids, rows, (clocks, state))`` items
        (host arrays), a shared cache's as a group write over its tables' id space."""
        requests: list[WriteRequest | GroupWrite] = []
        for tc, ids, rows, (clocks, state) in writes:
            group = self._groups.get(tc.name)
            if group is None:
                requests.append(WriteRequest(tc.name, ids, rows, state, clocks))
            else:
                requests.append(GroupWrite(group.space, ids, rows, state, clocks))
        return self.inner.write_groups_async(requests)

    # ------------------------------------------------------------ tables

    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        self.inner.create_table(spec, exist_ok=exist_ok)

    def drop_table(self, table: str) -> None:
        """Drop ``table`` from the inner store, and this client's cache of it (unflushed
        pushes included: the table is gone). A cache shared with other tables is
        flushed first (their pending updates are kept) and made again on next use."""
        name = self._members.get(table) if isinstance(table, str) else None
        if name is not None and name in self._groups:
            self.flush()
        with self._lock:
            if name is not None:
                self._caches.pop(name, None)
                group = self._groups.pop(name, None)
                for t in group.names if group is not None else (table,):
                    self._members.pop(t, None)
                    self._specs.pop(t, None)
        self.inner.drop_table(table)

    def tables(self) -> list[str]:
        return self.inner.tables()

    def spec(self, table: str) -> TableSpec:
        return self.inner.spec(table)

    # ------------------------------------------------------------ rows

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        """Serve ``ids`` from the cache (see the module docstring); ``wait()`` -> PullResult.

        The result's ``clocks`` are the PS clocks the served copies were read at.
        A conditional pull (``clocks``/``bound``) is passed to the wrapped store.
        """
        if clocks is not None or bound is not None:
            return self.inner.pull_async(table, ids, clocks=clocks, bound=bound)
        return first_of(self.pull_many_async([PullRequest(table, ids)]), f"cached pull {table!r}")

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Serve several tables at once: every table's fetch (and a prefetch handed to
        :meth:`prefetch_many` for it) in ONE ``pull_many`` of the wrapped store;
        ``wait()`` gives one :class:`ps.PullResult` per request. Conditional requests
        pass through to the wrapped store in the same batch. A table may appear once."""
        reqs = check_requests(requests, PullRequest, "pull_many")
        self._ensure([r.table for r in reqs if r.clocks is None and r.bound is None])
        # Each request's place: (None, request) passed through, or (cache name, offset,
        # count) into the packed ids the cache is asked for (tables of a shared cache
        # are asked together, one after the other).
        places: list[tuple[str | None, Any, int]] = []
        by_cache: dict[str, list[tuple[str, object]]] = {}  # cache name -> (table, ids)
        seen: set[str] = set()
        for r in reqs:
            if r.clocks is not None or r.bound is not None:
                places.append((None, r, 0))
                continue
            if r.table in seen:
                raise ValueError(
                    f"cached pull_many: table {r.table!r} appears twice; a batch through "
                    "the cache asks each table once (concatenate its ids)"
                )
            seen.add(r.table)
            name = self._members[r.table]
            mine = by_cache.setdefault(name, [])
            places.append((name, len(mine), 0))  # (part number: offsets below)
            mine.append((r.table, r.ids))
        wanted: dict[str, torch.Tensor] = {}  # cache name -> its packed ids, request order
        starts: dict[str, list[int]] = {}  # cache name -> where each part starts, its end
        for name, mine in by_cache.items():
            wanted[name], sizes = self._pack(name, mine, "pull")
            starts[name] = [0, *itertools.accumulate(sizes)]
        for k, (where, part, _) in enumerate(places):
            if where is not None:
                at = starts[where]
                places[k] = (where, at[part], at[part + 1] - at[part])
        return self._serve(wanted, places)

    def pull_groups_async(self, requests: Sequence[PullRequest | GroupPull]) -> Handle:
        """:meth:`pull_many_async` where a request may also be a group request. A lone
        unconditional group request over the id space of one shared cache (its tables in
        its order, with its bases: how the hybrid tables ask for a dim group's rows) is
        that cache's ask as it comes: its packed ids are checked by their ends (sorted,
        inside the space), not cut by table and packed again, and the reply is the
        cache's own ``[U, D]``. Anything else goes the base class's way (each group
        request cut into its tables' requests, one :meth:`pull_many_async`)."""
        if isinstance(requests, Sequence) and len(requests) == 1:
            (r,) = requests
            if (
                isinstance(r, GroupPull)
                and r.clocks is None
                and r.bound is None
                and not r.with_state
            ):
                name = self._cache_of_space(r.space)
                if name is not None:
                    r.space.check(r.ids.numpy(), "cached pull")
                    return self._serve({name: r.ids}, [(name, 0, int(r.ids.numel()))])
        return super().pull_groups_async(requests)

    def _cache_of_space(self, space: IdSpace) -> str | None:
        """The shared cache whose tables are ``space``'s, in its order with its bases
        (made now if none of them has a cache yet), or None."""
        self._ensure(list(space.names))
        name = self._members.get(space.names[0])
        group = self._groups.get(name) if name is not None else None
        if group is None or group.names != space.names:
            return None
        return name if np.array_equal(group.bases, space.bases) else None

    def _serve(
        self, wanted: dict[str, torch.Tensor], places: list[tuple[str | None, Any, int]]
    ) -> Handle:
        """Serve the caches' asks ``wanted`` (cache name -> its packed ids) in ONE batched
        pull of the wrapped store; ``places`` gives each reply: ``(cache name, start,
        count)`` among a cache's ids, or ``(None, request, 0)`` passed through."""
        caches = [self._caches[name] for name in wanted]
        for c in caches:
            with c.lock:
                if c.inflight is not None:
                    c.finish(c.inflight)
                c.send_evicted()  # evicted rows reach the PS before this pull reads
        self._send(caches)
        inner: list[PullRequest | GroupPull] = []
        passed: dict[int, int] = {}  # position in reqs -> index in inner
        for k, (where, r, _) in enumerate(places):
            if where is None:
                passed[k] = len(inner)
                inner.append(r)
        fetches: dict[str, tuple[TableCache, Fetch]] = {}
        # (fetches, how to split a joined reply, index in inner) of each request sent
        routes: list[tuple[list[Fetch], Joined | None, int]] = []
        for name, ids in wanted.items():
            tc, group = self._caches[name], self._groups.get(name)
            with tc.lock:
                f = tc.plan(ids, prefetch=False)
                if tc.deferred is not None:
                    f.follow = tc.plan(tc.deferred, prefetch=True, exclude=f.uniq)
                    tc.deferred = None
                tc.inflight = f
            asks = [g for g in (f, f.follow) if g is not None and g.request is not None]
            reqs = [g.request for g in asks if g.request is not None]
            both = join(reqs[0], reqs[1]) if len(reqs) == 2 else None
            if both is not None:  # one request for the pull and its prefetch
                joined, halves = both
                routes.append((asks, halves, self._route(joined, group, inner)))
            else:
                for g, r in zip(asks, reqs, strict=True):
                    routes.append(([g], None, self._route(r, group, inner)))
            fetches[name] = tc, f
        batch = self.inner.pull_groups_async(inner) if inner else None
        for asked, joined_at, route in routes:
            assert batch is not None  # a request was sent for it
            handle = _nth(batch, route)
            if joined_at is None:
                asked[0].handle = handle
            else:
                asked[0].handle, asked[1].handle = _split_handles(handle, joined_at)

        def finish() -> list[PullResult]:
            served: dict[str, PullResult] = {}
            for key, (owner, fetch) in fetches.items():
                with owner.lock:
                    result = owner.finish(fetch)
                assert result is not None
                served[key] = result
            out = []
            for k, (where, at, n) in enumerate(places):
                if where is None:
                    assert batch is not None
                    out.append(batch.wait()[passed[k]])
                    continue
                got = served[where]
                if n == got.rows.shape[0]:
                    out.append(got)
                else:
                    out.append(PullResult(got.rows[at : at + n], got.clocks[at : at + n]))
            return out

        def test() -> bool:
            return batch is None or batch.is_completed()

        def block(limit: float) -> None:
            if batch is not None:
                batch.wait(None if math.isinf(limit) else limit)

        return Handle(test, finish, what="cached pull_many", timeout_s=math.inf, block=block)

    def prefetch_many(self, requests: Sequence[PullRequest]) -> None:
        """Hand the next batch's ids of several tables to the cache, without sending
        anything: they ride on the next pull of each table (:meth:`pull_many_async`),
        in the same message, and are installed right after it. A later call replaces
        a table's ids that have not ridden yet. Without :attr:`prefetching` the ids are
        checked and nothing more (the batch's own pull then fetches its misses)."""
        by_cache: dict[str, list[tuple[str, object]]] = {}  # cache name -> (table, ids)
        reqs = check_requests(requests, PullRequest, "prefetch_many")
        self._ensure([r.table for r in reqs])
        for r in reqs:
            by_cache.setdefault(self._members[r.table], []).append((r.table, r.ids))
        wanted = {name: self._pack(name, mine, "prefetch")[0] for name, mine in by_cache.items()}
        if not self.prefetching:
            return
        for name, ids in wanted.items():
            tc = self._caches[name]
            with tc.lock:
                tc.deferred = ids if ids.numel() > 0 else None

    def prefetch(self, table: str, ids: torch.Tensor) -> None:
        """Start fetching the rows of ``ids`` (the next batch) into the cache, without waiting.

        The next operation on ``table`` completes it (a pull of those ids then
        finds them cached); rows it fetched count as misses or refreshes of that
        pull in :meth:`cache_stats`, not as hits. Without :attr:`prefetching` the ids
        are checked and nothing more.
        """
        tc, group = self._member(table)
        ids = self._packed(table, ids, "prefetch")
        if not self.prefetching:
            return
        with tc.lock:
            self._settle(tc)
            if ids.numel() > 0:
                f = tc.plan(ids, prefetch=True)
                if f.request is not None:
                    inner: list[PullRequest | GroupPull] = []
                    route = self._route(f.request, group, inner)
                    f.handle = _nth(self.inner.pull_groups_async(inner), route)
                tc.inflight = f

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        """Apply row gradients to the cache (pushed to the PS by the write-bound rule).

        The returned handle is complete: the update is in the cache. Gradients
        are checked like a store checks them; with the table's
        ``nan_policy="skip"`` rows that are not finite are dropped here.
        """
        self.push_many_async([PushRequest(table, ids, grads)])
        return Handle.completed(None, what=f"cached push {table!r}")

    def push_many_async(self, requests: Sequence[PushRequest]) -> Handle:
        """Apply several tables' row gradients to the cache (every request is checked
        first); what is due goes to the PS as ONE ``push_many`` of the wrapped store.
        The returned handle is complete: the updates are in the cache."""
        reqs = check_requests(requests, PushRequest, "push_many")
        self._ensure([r.table for r in reqs])
        specs = [self._specs[r.table] for r in reqs]
        ids_of = [check_id_tensor(s, r.ids, "push").cpu() for s, r in zip(specs, reqs, strict=True)]
        # Every cache's ids range-checked and packed at once: (cache name, packed ids).
        by_cache: dict[str, list[tuple[str, object]]] = {}  # cache name -> (table, ids)
        where = []  # [R] (cache name, part number) of each request
        for r, ids in zip(reqs, ids_of, strict=True):
            mine = by_cache.setdefault(self._members[r.table], [])
            where.append((self._members[r.table], len(mine)))
            mine.append((r.table, ids))
        split = {}
        for name, mine in by_cache.items():
            packed_all, sizes = self._pack(name, mine, "push")
            split[name] = packed_all.split(sizes)  # [R'] views, one per part
        packed_of = [split[name][k] for name, k in where]
        grads_of = [
            check_grads(s, i, r.grads, finite=False).detach()
            for s, i, r in zip(specs, ids_of, reqs, strict=True)
        ]
        grads_of = self._where_rows_are(grads_of)
        skip = [
            s.nan_policy == "skip" and g.numel() > 0 for s, g in zip(specs, grads_of, strict=True)
        ]
        if self.device is None:
            kept = [
                _finite_rows_only(i, g) if k else (i, g)
                for i, g, k in zip(packed_of, grads_of, skip, strict=True)
            ]
        else:  # every table's verdict at once; a non-finite one raises here
            kept = self._finite_on_device(specs, packed_of, grads_of, skip, ids_of)
        # Per cache: (packed ids, grads, spec, ids) of each request, in request order.
        checked: dict[str, list[tuple[torch.Tensor, torch.Tensor, TableSpec, torch.Tensor]]]
        checked = {}
        for (name, _), spec, (packed, grads), ids in zip(where, specs, kept, ids_of, strict=True):
            checked.setdefault(name, []).append((packed, grads, spec, ids))
        # Host records: every cache's gradients are checked finite before any is applied,
        # once per cache (numpy's test over the concatenation); only a failed check
        # looks for the table and row to name.
        merged = []
        for name, parts in checked.items():
            # Views of one tensor where the parts lie back to back: the packed ids are
            # splits of one packing, and the hybrid tables' gradients of one group are
            # slices of its [U, D].
            ids = boundary.joined([p[0] for p in parts])
            grads = boundary.joined([p[1] for p in parts])
            if self.device is None and grads.numel() > 0 and not all_finite(grads):
                for _, g, spec, raw in parts:  # skip-policy parts were filtered above
                    if spec.nan_policy != "skip":
                        check_grads(spec, raw, g, finite=True)  # raises, naming the row
            merged.append((name, ids, grads))
        caches = []
        for name, ids, grads in merged:
            tc = self._caches[name]
            with tc.lock:
                self._settle(tc, pushing=True)
                tc.update(ids, grads.contiguous())
            caches.append(tc)
        self._send(caches)
        return Handle.completed(None, what="cached push_many")

    def push_groups_async(self, requests: Sequence[PushRequest | GroupPush]) -> Handle:
        """:meth:`push_many_async` where a request may also be a group push. A lone
        plain group push over the id space of one shared cache of host records (see
        :meth:`pull_groups_async`) is applied as it comes, its packed ids neither cut by
        table nor packed again; a bad one (an id outside the space, gradients of another
        dtype or shape, or not finite) is cut by table instead, whose checks name the
        table and row, and nothing is applied. Anything else goes the base class's way."""
        if isinstance(requests, Sequence) and len(requests) == 1 and self.device is None:
            (r,) = requests
            if isinstance(r, GroupPush) and r.counts is None and r.stats is None:
                name = self._cache_of_space(r.space)
                if name is not None and self._push_packed(name, r):
                    return Handle.completed(None, what="cached push_groups")
        return super().push_groups_async(requests)

    def _push_packed(self, name: str, r: GroupPush) -> bool:
        """Apply group push ``r`` to shared cache ``name`` (False, nothing done, where
        it is not a checked push of finite float32 ``[P, D]`` to tables without the
        skip policy: the caller then cuts it by table)."""
        group, tc = self._groups[name], self._caches[name]
        ids, grads = r.ids, r.grads
        if any(s.nan_policy == "skip" for s in group.members):
            return False
        if grads.dtype != torch.float32 or tuple(grads.shape) != (ids.numel(), group.spec.dim):
            return False
        packed = ids.numpy()
        if packed.size and (int(packed.min()) < 0 or int(packed.max()) >= int(group.bases[-1])):
            return False
        if grads.numel() > 0 and not all_finite(grads):
            return False
        with tc.lock:
            self._settle(tc, pushing=True)
            tc.update(ids, grads.contiguous())
        self._send([tc])
        return True

    def _where_rows_are(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` where the cached rows are: the host for host records, else the cache's
        device. The hybrid tables hand them there already; others cross in one copy."""
        if self.device is None:
            if all(g.is_cpu for g in grads):
                return grads
            return boundary.to_host(grads)
        dev = self.device
        host = [k for k, g in enumerate(grads) if g.is_cpu and g.device != dev]
        out = [g if g.is_cpu or g.device == dev else g.to(dev) for g in grads]
        if host:
            for k, g in zip(host, boundary.to_device([grads[k] for k in host], dev), strict=True):
                out[k] = g
        return out

    def _finite_on_device(
        self,
        specs: list[TableSpec],
        ids: list[torch.Tensor],
        grads: list[torch.Tensor],
        skip: list[bool],
        named: list[torch.Tensor],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every request's ``(ids, grads)`` once checked finite, for gradients on the
        cache's device: a ``nan_policy="skip"`` table's non-finite rows dropped, any other
        table's raising, naming the row (its id among the request's own ids ``named``),
        before anything is applied. The verdicts (one
        for all the other tables' gradients together, one per skip table, whose per-row
        test stays on the device) are read back at once: one host sync on a GPU for
        every table. Only a non-finite gradient costs more (its table's row mask to the
        host, or the search for the row to name)."""
        strict = [g.reshape(-1) for g, dropping in zip(grads, skip, strict=True) if not dropping]
        rows_ok = {k: torch.isfinite(g).all(dim=1) for k, g in enumerate(grads) if skip[k]}
        flags = [ok.all() for ok in rows_ok.values()]  # 0-d each
        if any(g.numel() for g in strict):
            flags.append(torch.isfinite(torch.cat(strict) if len(strict) > 1 else strict[0]).all())
        if not flags:
            return list(zip(ids, grads, strict=True))
        verdicts = boundary.read(torch.stack(flags))  # [skip tables (+ 1)]
        if len(verdicts) > len(rows_ok) and not verdicts[-1]:
            for spec, i, g, dropping in zip(specs, named, grads, skip, strict=True):
                if not dropping:
                    check_grads(spec, i, g, finite=True)  # raises, naming the row
        out = list(zip(ids, grads, strict=True))
        for (k, ok), fine in zip(rows_ok.items(), verdicts, strict=False):
            if not fine:
                (ok_host,) = boundary.to_host([ok])  # [N] on the host, as the ids are
                out[k] = (ids[k][ok_host], grads[k][ok])
        return out

    def flush(self) -> None:
        """Push every pending update of every table (one batched push) and wait until
        the PS applied them."""
        caches = list(self._caches.values())
        for tc in caches:
            with tc.lock:
                self._settle(tc, pushing=True)
                tc.flush()
        self._send(caches)
        for tc in caches:
            with tc.lock:
                handles, tc.push_handles = tc.push_handles, []
            for h in handles:
                h.wait()

    # ------------------------------------------------------------ inspection

    def cache_stats(self) -> dict[str, dict[str, Any]]:
        """Per cache: hit rate, rows/bytes moved, staleness served, evictions, ...

        See :mod:`cache.stats` for every key. Tables not used yet are absent; tables
        sharing a cache (``group_tables``) appear once, under the group's name
        (their names joined by ``+``).
        """
        out = {}
        for name, tc in list(self._caches.items()):
            with tc.lock:
                out[name] = tc.snapshot()
        return out

    def cached_ids(self, table: str) -> torch.Tensor:
        """Ids of ``table``'s cached rows, sorted (int64; empty if the table was not used)."""
        name = self._members.get(table) if isinstance(table, str) else None
        if name is None:
            self.inner.spec(table)  # unknown table: the store's error
            return torch.empty(0, dtype=torch.int64)
        tc, group = self._caches[name], self._groups.get(name)
        with tc.lock:
            self._settle(tc)
            ids = tc.cached_ids()
        return ids if group is None else group.unpack(table, ids)

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """PS clocks (of the wrapped store)."""
        return self.inner.clocks(table, ids)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """PS optimizer state; pending updates are not in it until :meth:`flush`."""
        return self.inner.state(table, ids)

    def request_counts(self) -> dict[str, int]:
        """The wrapped store's message counts (what the cache sent)."""
        return self.inner.request_counts()

    def stats(self) -> dict[str, dict[str, int | float]]:
        """The wrapped store's counters (the PS side); see :meth:`cache_stats` for the cache."""
        return self.inner.stats()

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Flush, then save the wrapped store (the checkpoint holds every update)."""
        self.flush()
        self.inner.save(path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Flush, load into the wrapped store, and empty the cache (its copies are void)."""
        self.flush()
        self.inner.load(path)
        with self._lock:
            self._forget()

    def clear(self) -> None:
        """Flush, then empty every cache: the next reads pull the store's rows. What
        scoring the model the store holds wants (a held-out split, an evaluation of a
        checkpoint), where copies within the read bound would give values that depend
        on when each was read."""
        self.flush()
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        """Drop every cache (their copies are void)."""
        self._caches.clear()
        self._groups.clear()
        self._members.clear()
        self._specs.clear()

    def cache_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Flush, then every used table's cache contents (cached ids, copies, counters and
        eviction keys; see :meth:`cache.table_cache.TableCache.export_state`), so a
        resumed run continues with the same cache instead of a cold one."""
        self.flush()
        out = {}
        for name, tc in list(self._caches.items()):
            with tc.lock:
                out[name] = tc.export_state()
            group = self._groups.get(name)
            if group is not None:  # the tables sharing it, as JSON bytes
                text = json.dumps(list(group.names)).encode("utf-8")
                out[name]["tables"] = torch.tensor(list(text), dtype=torch.uint8)
        return out

    def load_cache_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the cache contents by ``state`` (from :meth:`cache_state`; tables the
        store lacks raise, tables absent from it start empty). Pending updates are
        dropped, not pushed: call it after loading the store the state belongs to."""
        with self._lock:
            self._forget()
            for name, saved in state.items():
                names = [name]
                if "tables" in saved:  # a shared cache
                    names = json.loads(bytes(saved["tables"].tolist()).decode("utf-8"))
                self._register([self.inner.spec(t) for t in names], saved)

    def close(self) -> None:
        """Flush; close the wrapped store too if this cache owns it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self._owns:
            self.inner.close()

    def __enter__(self) -> CachedStore:
        return self


def _finite_rows_only(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``nan_policy="skip"`` table's host ``ids`` ``[N]`` and ``grads`` ``[N, D]`` without
    the rows holding NaN or Inf."""
    ok = finite_rows(grads)  # [N]
    return (ids, grads) if bool(ok.all()) else (ids[ok], grads[ok])


def _split_handles(joined: Handle, where: Joined) -> tuple[Handle, Handle]:
    """The replies to the two requests of a joined one (``joined``: its reply), split once."""
    parts: list[tuple[PullResult, PullResult]] = []

    def part(k: int) -> Handle:
        def block(limit: float) -> None:
            joined.wait(None if math.isinf(limit) else limit)

        def finish() -> PullResult:
            if not parts:
                parts.append(where.split(joined.wait()))
            return parts[0][k]

        return Handle(joined.is_completed, finish, what="cached pull", timeout_s=math.inf,
                      block=block)  # fmt: skip

    return part(0), part(1)


def _nth(batch: Handle, k: int) -> Handle:
    """The reply to one cache request within the batched pull ``batch``: its ``k``-th
    result (the wrapped store's own handle applies its timeout)."""
    return after(batch, lambda: batch.wait()[k], "cached pull")
