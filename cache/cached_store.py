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
from typing import Any

import torch

from cache.config import CacheConfig
from cache.table_cache import Fetch, TableCache
from comm import Handle
from ps import PullResult, Store, TableSpec
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

    @staticmethod
    def _settle(tc: TableCache, *, pushing: bool = False) -> None:
        """Finish the table's fetch in flight, so nothing else changes its slots meanwhile.

        Rows it evicted go to the PS now, before any request can read them, unless
        the caller is about to push (the push carries them)."""
        if tc.inflight is not None:
            tc.finish(tc.inflight)
        if not pushing:
            tc.send_evicted()

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
        tc = self._cache(table)
        ids = check_ids(tc.spec, ids, "pull").cpu()
        with tc.lock:
            self._settle(tc)
            f = tc.plan(ids, prefetch=False)
            tc.inflight = f
        return _fetch_handle(tc, f, f"cached pull {table!r}")

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
                tc.inflight = tc.plan(ids, prefetch=True)

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        """Apply row gradients to the cache (pushed to the PS by the write-bound rule).

        The returned handle is complete: the update is in the cache. Gradients
        are checked like a store checks them; with the table's
        ``nan_policy="skip"`` rows that are not finite are dropped here.
        """
        tc = self._cache(table)
        spec = tc.spec
        ids = check_ids(spec, ids, "push").cpu()
        grads = check_grads(spec, ids, grads, finite=spec.nan_policy == "raise").detach().cpu()
        if spec.nan_policy == "skip" and grads.numel() > 0:
            ok = finite_rows(grads)
            if not bool(ok.all()):
                ids, grads = ids[ok], grads[ok]
        with tc.lock:
            self._settle(tc, pushing=True)
            tc.update(ids, grads.contiguous())
        return Handle.completed(None, what=f"cached push {table!r}")

    def flush(self) -> None:
        """Push every pending update of every table and wait until the PS applied them."""
        for tc in list(self._caches.values()):
            with tc.lock:
                self._settle(tc)
                tc.flush()

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


def _fetch_handle(tc: TableCache, f: Fetch, what: str) -> Handle:
    """A handle whose ``wait()`` installs the reply of ``f`` and gives the served rows."""

    def test() -> bool:
        return f.done or f.handle is None or f.handle.is_completed()

    def block(limit: float) -> None:
        if f.handle is not None and not f.done:
            f.handle.wait(None if math.isinf(limit) else limit)

    def finish() -> PullResult:
        with tc.lock:
            result = tc.finish(f)
            tc.send_evicted()  # before any later request reads an evicted row
        assert result is not None
        return result

    # Infinite default: the wrapped store's own handle applies its timeout.
    return Handle(test, finish, what=what, timeout_s=math.inf, block=block)
