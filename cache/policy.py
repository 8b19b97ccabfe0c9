"""Eviction order of cached rows: LRU or LFU over slots, vectorised (numpy).

One contiguous int64 ``key`` per slot orders the victims (smallest first):

* LRU: key = ``last_use`` (the table's pull tick of the row's last lookup);
* LFU: key = ``min(freq, 2**30) * 2**32 + last_use`` (fewest uses first, ties:
  least recent), rewritten on every use;

remaining ties: the smaller row id first. An empty slot holds ``FREE``. The low
32 bits are always ``last_use``, which decides whether a row is evictable at all
(rows used by the current batch, or prefetched for the next, are not). ``freq``
(uses since the row entered the cache) lives in the slot's record
(:mod:`cache.table_cache`) and is passed in.

A search is O(capacity) (one ``np.partition`` over the keys), which is why the
cache evicts in chunks (:meth:`cache.CacheConfig.chunk`); a use is one scatter.
"""

from __future__ import annotations

import numpy as np

_TICK_BITS = 32
_LOW = (1 << _TICK_BITS) - 1
_FREQ_MAX = 1 << 30
FREE = np.iinfo(np.int64).max  # key of an empty slot: never a victim (its low bits > any tick)


class EvictionPolicy:
    def __init__(self, capacity: int, kind: str) -> None:
        self.lfu = kind == "lfu"
        self.key = np.full(capacity, FREE, dtype=np.int64)  # [C]

    def use(self, slots: np.ndarray, freq: np.ndarray | None, tick: int) -> None:
        """Distinct ``slots`` were looked up (or admitted) at ``tick``; ``freq`` ``[K]``
        is their use count now (LFU only; None for LRU)."""
        if freq is None:
            self.key[slots] = tick
        else:
            self.key[slots] = (np.minimum(freq, _FREQ_MAX) << _TICK_BITS) + tick

    def free(self, slots: np.ndarray) -> None:
        """``slots`` were emptied."""
        self.key[slots] = FREE

    def evictable(self, tick: int) -> np.ndarray:
        """bool ``[C]``: cached rows last used before ``tick``."""
        last = self.key & _LOW if self.lfu else self.key
        return last < tick

    def victims(
        self, k: int, tick: int, protect: np.ndarray | None, row_id: np.ndarray
    ) -> np.ndarray:
        """Up to ``k`` slots to evict among the rows last used before ``tick`` and not in
        ``protect``; ties of the key go to the smaller row id (``row_id`` int64 ``[C]``),
        so the order is fully defined. O(capacity)."""
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        key = np.where(self.evictable(tick), self.key, FREE)  # [C]; FREE: not evictable
        if protect is not None and protect.size > 0:
            key[protect] = FREE
        cand = int(np.count_nonzero(key != FREE))
        if k >= cand:
            return np.flatnonzero(key != FREE)
        cut = np.partition(key, k - 1)[k - 1]  # the k-th smallest key
        below = np.flatnonzero(key < cut)
        at = np.flatnonzero(key == cut)
        if below.size + at.size > k:
            at = at[np.argsort(row_id.take(at), kind="stable")][: k - below.size]
        return np.concatenate([below, at])
