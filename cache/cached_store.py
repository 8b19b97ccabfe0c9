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
sends them to the wrapped store as ONE ``pull_many`` (one message per server);
:meth:`CachedStore.push_many_async` applies every table's gradients to the cache and
sends what is due (and the sums of evicted rows) as ONE ``push_many``. The per-table
``pull_async`` / ``push_async`` are the same with one table. A step of a training
loop is then one pull and one push message per server::

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

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from cache.config import CacheConfig
from cache.table_cache import Fetch, TableCache
from comm import Handle
from ps import PullRequest, PullResult, PushRequest, Store, TableSpec
from ps.store import _requests
from ps.validate import check_grads, check_ids, finite_rows


class CachedStore(Store):
    """A hot-row cache in front of ``store`` (see the module docstring).

    ``close()`` flushes; it closes ``store`` too only if ``owns_store`` is True.
    """

    def __init__(self, store: Store, config: CacheConfig, *, owns_store: bool = False) -> None:
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
        self._owns = bool(owns_store)
        self._caches: dict[str, TableCache] = {}
        self._lock = threading.Lock()  # guards _caches
        self._closed = False

    def __repr__(self) -> str:
        return f"CachedStore({self.inner!r}, {self.config!r})"

    def _cache(self, table: str) -> TableCache:
        tc = self._caches.get(table)
        if tc is None:
            with self._lock:
                tc = self._caches.get(table)
                if tc is None:
                    spec = self.inner.spec(table)  # raises for an unknown table
                    tc = TableCache(spec, self.config, self.inner)
                    self._caches[table] = tc
        return tc

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
        """Send what the outboxes of ``caches`` hold as one batched push (nothing if
        they are empty); each table keeps the handle for :meth:`flush`."""
        requests, senders = [], []
        for tc in caches:
            box = tc.take_outbox()
            requests += [PushRequest(tc.name, ids, grads) for ids, grads in box]
            if box:
                senders.append(tc)
        if not requests:
            return
        handle = self.inner.push_many_async(requests)
        for tc in senders:
            tc.sent(handle)

    # ------------------------------------------------------------ tables

    def create_table(self, spec: TableSpec, *, exist_ok: bool = False) -> None:
        self.inner.create_table(spec, exist_ok=exist_ok)

    def drop_table(self, table: str) -> None:
        """Drop ``table`` from the inner store, and this client's cache of it (unflushed
        pushes included: the table is gone)."""
        with self._lock:
            self._caches.pop(table, None)
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
        batch = self.pull_many_async([PullRequest(table, ids)])
        return Handle(
            batch.is_completed,
            lambda: batch.wait()[0],
            what=f"cached pull {table!r}",
            timeout_s=math.inf,  # the wrapped store's handle applies its timeout
            block=lambda limit: batch.wait(None if math.isinf(limit) else limit),
        )

    def pull_many_async(self, requests: Sequence[PullRequest]) -> Handle:
        """Serve several tables at once: every table's fetch (and a prefetch handed to
        :meth:`prefetch_many` for it) in ONE ``pull_many`` of the wrapped store;
        ``wait()`` gives one :class:`ps.PullResult` per request. Conditional requests
        pass through to the wrapped store in the same batch. A table may appear once."""
        reqs = _requests(requests, PullRequest, "pull_many")
        plans: list[tuple[TableCache | None, Any]] = []  # (cache, ids) or (None, request)
        seen: set[str] = set()
        for r in reqs:
            if r.clocks is not None or r.bound is not None:
                plans.append((None, r))
                continue
            cache_of = self._cache(r.table)
            if r.table in seen:
                raise ValueError(
                    f"cached pull_many: table {r.table!r} appears twice; a batch through "
                    "the cache asks each table once (concatenate its ids)"
                )
            seen.add(r.table)
            plans.append((cache_of, check_ids(cache_of.spec, r.ids, "pull").cpu()))
        caches = [c for c, _ in plans if c is not None]
        for c in caches:
            with c.lock:
                if c.inflight is not None:
                    c.finish(c.inflight)
                c.send_evicted()  # evicted rows reach the PS before this pull reads
        self._send(caches)
        inner: list[PullRequest] = []
        parts: list[tuple[TableCache | None, Any]] = []  # (cache, fetch) or (None, index)
        asked: list[tuple[Fetch, int]] = []  # fetches with a request: (fetch, its index)
        for tc, what in plans:
            if tc is None:
                parts.append((None, len(inner)))
                inner.append(what)
                continue
            with tc.lock:
                f = tc.plan(what, prefetch=False)
                if tc.deferred is not None:
                    f.follow = tc.plan(tc.deferred, prefetch=True, exclude=f.uniq)
                    tc.deferred = None
                tc.inflight = f
            for g in (f, f.follow):
                if g is not None and g.request is not None:
                    asked.append((g, len(inner)))
                    inner.append(g.request)
            parts.append((tc, f))
        batch = self.inner.pull_many_async(inner) if inner else None
        for g, index in asked:
            g.handle = _part_handle(batch, index, g.request.table if g.request else "")

        def finish() -> list[PullResult]:
            out = []
            for tc, f in parts:
                if tc is None:
                    assert batch is not None
                    out.append(batch.wait()[f])
                    continue
                with tc.lock:
                    result = tc.finish(f)
                assert result is not None
                out.append(result)
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
        a table's ids that have not ridden yet."""
        for r in _requests(requests, PullRequest, "prefetch_many"):
            tc = self._cache(r.table)
            ids = check_ids(tc.spec, r.ids, "prefetch").cpu()
            with tc.lock:
                tc.deferred = ids if ids.numel() > 0 else None

    def prefetch(self, table: str, ids: torch.Tensor) -> None:
        """Start fetching the rows of ``ids`` (the next batch) into the cache, without waiting.

        The next operation on ``table`` completes it (a pull of those ids then
        finds them cached); rows it fetched count as misses or refreshes of that
        pull in :meth:`cache_stats`, not as hits.
        """
        tc = self._cache(table)
        ids = check_ids(tc.spec, ids, "prefetch").cpu()
        with tc.lock:
            self._settle(tc)
            if ids.numel() > 0:
                f = tc.plan(ids, prefetch=True)
                if f.request is not None:
                    batch = self.inner.pull_many_async([f.request])
                    f.handle = _part_handle(batch, 0, table)
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
        checked = []
        for r in _requests(requests, PushRequest, "push_many"):
            tc = self._cache(r.table)
            spec = tc.spec
            ids = check_ids(spec, r.ids, "push").cpu()
            finite = spec.nan_policy == "raise"
            grads = check_grads(spec, ids, r.grads, finite=finite).detach().cpu()
            if spec.nan_policy == "skip" and grads.numel() > 0:
                ok = finite_rows(grads)
                if not bool(ok.all()):
                    ids, grads = ids[ok], grads[ok]
            checked.append((tc, ids, grads.contiguous()))
        for tc, ids, grads in checked:
            with tc.lock:
                self._settle(tc, pushing=True)
                tc.update(ids, grads)
        self._send([tc for tc, _, _ in checked])
        return Handle.completed(None, what="cached push_many")

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
        """Per table: hit rate, rows/bytes moved, staleness served, evictions, ...

        See :mod:`cache.stats` for every key. Tables not used yet are absent.
        """
        out = {}
        for name, tc in list(self._caches.items()):
            with tc.lock:
                out[name] = tc.snapshot()
        return out

    def cached_ids(self, table: str) -> torch.Tensor:
        """Ids of ``table``'s cached rows, sorted (int64; empty if the table was not used)."""
        tc = self._caches.get(table)
        if tc is None:
            self.inner.spec(table)  # unknown table: the store's error
            return torch.empty(0, dtype=torch.int64)
        with tc.lock:
            self._settle(tc)
            return tc.cached_ids()

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
            self._caches.clear()

    def cache_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Flush, then every used table's cache contents (cached ids, copies, counters and
        eviction keys; see :meth:`cache.table_cache.TableCache.export_state`), so a
        resumed run continues with the same cache instead of a cold one."""
        self.flush()
        out = {}
        for name, tc in list(self._caches.items()):
            with tc.lock:
                out[name] = tc.export_state()
        return out

    def load_cache_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the cache contents by ``state`` (from :meth:`cache_state`; tables the
        store lacks raise, tables absent from it start empty). Pending updates are
        dropped, not pushed: call it after loading the store the state belongs to."""
        fresh = {}
        for name, tables in state.items():
            tc = TableCache(self.inner.spec(name), self.config, self.inner)
            tc.import_state(tables)
            fresh[name] = tc
        with self._lock:
            self._caches = fresh

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


def _part_handle(batch: Handle | None, index: int, table: str) -> Handle:
    """The handle of request ``index`` of the batched pull ``batch``."""
    assert batch is not None

    def block(limit: float) -> None:
        batch.wait(None if math.isinf(limit) else limit)

    # Infinite default: the wrapped store's own handle applies its timeout.
    return Handle(
        batch.is_completed,
        lambda: batch.wait()[index],
        what=f"cached pull {table!r}",
        timeout_s=math.inf,
        block=block,
    )
