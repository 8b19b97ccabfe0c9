"""Eviction order of cached rows: LRU, LFU or TinyLFU over slots, vectorised (numpy).

One contiguous int64 ``key`` per slot orders the victims (smallest first):

* LRU: key = ``last_use`` (the table's pull tick of the row's last lookup);
* LFU: key = ``min(freq, 2**30) * 2**32 + last_use`` (fewest uses first, ties:
  least recent), rewritten on every use;
* TinyLFU: the same key with ``freq`` = the frequency sketch's estimate of the row
  (:mod:`cache.sketch`) at its last use, halved with the sketch
  (:meth:`EvictionPolicy.halve`), so it is the estimate as the sketch holds it now
  up to collisions;

remaining ties: the smaller row id first. An empty slot holds ``FREE``. The low
32 bits are always ``last_use``, which decides whether a row is evictable at all
(rows used by the current batch, or prefetched for the next, are not). ``freq``
(uses since the row entered the cache) lives in the slot's record
(:mod:`cache.table_cache`) and is passed in.

A search is O(capacity) (one C pass over the keys,
:func:`cache.kernels.victim_pool.search_near`; a few numpy passes without it,
:func:`_smallest_keys`), which is why the cache evicts in chunks
(:meth:`cache.CacheConfig.chunk`); a use is one scatter.
TinyLFU evicts only rows that a candidate beats, so instead of evicting a chunk it
keeps the chunk it found as a *pool* of victims in key order
(:meth:`EvictionPolicy.ordered_victims`): later steps take victims from the pool while
its entries are unchanged (same key: not used, not evicted since), and search again
once it runs dry. Rows cached after the search join the candidates only at the next
search; with ``evict_chunk=1`` every call searches, so the order is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from cache.kernels.victim_pool import halve_keys, pool_valid, search_near
from ps.kernels.rowwise_adagrad import sort_ids

TICK_BITS = 32  # a key's low bits: the last use
_LOW = (1 << TICK_BITS) - 1
FREQ_MAX = 1 << 30  # the largest frequency a key holds
FREE = np.iinfo(np.int64).max  # key of an empty slot: never a victim (its low bits > any tick)


def _smallest_keys(key: np.ndarray, k: int) -> np.ndarray | None:
    """Slots (increasing) of a superset of the ``k`` smallest of ``key`` ``[C]`` (ties at
    the k-th included), for ``1 <= k < C``: those at or below a bound read off a strided
    sample, so one pass over ``key`` replaces partitioning it whole (a victim search of a
    capacity of millions spent most of its ~50-100 ms there). None where that saves
    nothing (``k`` above a quarter of ``C``) or the sample's bound falls short: the
    caller then partitions every key."""
    c = key.size
    if 4 * k > c:
        return None
    step = max(1, c // 65536)
    sample = key[::step]  # [m] one key in `step`
    m = sample.size
    # The rank in the sample of the k-th smallest key, with room for the sample's error.
    rank = min(m - 1, int(1.25 * k * m / c) + 64)
    bound = np.partition(sample, rank)[rank]
    near = np.flatnonzero(key <= bound)
    return near if near.size >= k else None


def _first_k(slots: np.ndarray, keys: np.ndarray, k: int, row_id: np.ndarray) -> np.ndarray:
    """The ``k`` of ``slots`` ``[n]`` (increasing, ``n > k``) with the smallest ``keys``
    ``[n]``, ties at the ``k``-th by the smaller row id (``row_id`` int64 ``[C]``): those
    below the cut in slot order, then those at it."""
    cut = np.partition(keys, k - 1)[k - 1]  # the k-th smallest key
    below, at = slots[keys < cut], slots[keys == cut]
    if below.size + at.size > k:
        at = at[np.argsort(row_id.take(at), kind="stable")][: k - below.size]
    return np.concatenate([below, at])


def key_then_id_order(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The order of ``keys`` ``[K]`` (ties: smaller ``ids`` ``[K]`` first, then the earlier
    entry), as ``np.lexsort((ids, keys))`` gives it, by the stable radix sort of
    :func:`ps.kernels.rowwise_adagrad.sort_ids`: one sort of ``key * span + id`` (both
    less their least) where that fits in int64, as it does for a search's victims (a few
    frequencies and ticks; ~2 ms for ~160 k victims, where two stable torch sorts took
    ~9), else a sort by id, then a stable one by key. Where the ids come in order (as
    TinyLFU's admission candidates do) and the keys span less than 2**15 (their sketch
    estimates), ties are in order already: one stable radix sort of the keys as int16
    (~40 us for a step's ~8 k candidates, where the joined sort took ~130)."""
    if keys.size == 0:
        return np.empty(0, dtype=np.int64)
    keys, ids = keys.astype(np.int64, copy=False), ids.astype(np.int64, copy=False)
    k_lo, k_hi = int(keys.min()), int(keys.max())
    if k_hi - k_lo < 2**15 and bool((ids[1:] >= ids[:-1]).all()):
        return np.argsort((keys - k_lo).astype(np.int16), kind="stable")
    i_lo, i_hi = int(ids.min()), int(ids.max())
    span = i_hi - i_lo + 1
    if (k_hi - k_lo + 1) * span <= np.iinfo(np.int64).max:  # Python ints: no overflow
        joint = (keys - k_lo) * span + (ids - i_lo)  # [K] int64, in range
        return sort_ids(torch.from_numpy(joint))[1].numpy()
    by_id = sort_ids(torch.from_numpy(ids))[1]  # [K]
    by_key = sort_ids(torch.from_numpy(keys)[by_id])[1]  # [K]
    return by_id[by_key].numpy()


class EvictionPolicy:
    def __init__(self, capacity: int, kind: str) -> None:
        self.lfu = kind in ("lfu", "tinylfu")  # a frequency in the high bits of the key
        self.key = np.full(capacity, FREE, dtype=np.int64)  # [C]
        self.pool = np.empty(0, dtype=np.int64)  # TinyLFU: victims found, in key order
        self.pool_key = np.empty(0, dtype=np.int64)  # their keys when found
        self.pool_at = 0  # entries of the pool used up
        # [n] positions in ``pool`` of the entries the last ``_from_pool`` gave, so that
        # ``consumed`` moves ``pool_at`` past them without scanning the pool
        self.taken = np.empty(0, dtype=np.int64)
        self.marked = np.zeros(capacity, dtype=bool)  # [C] scratch: the protected slots

    def use(self, slots: np.ndarray, freq: np.ndarray | None, tick: int) -> None:
        """Distinct ``slots`` were looked up (or admitted) at ``tick``; ``freq`` ``[K]``
        is their use count now (LFU only; None for LRU)."""
        if freq is None:
            self.key[slots] = tick
        else:
            self.key[slots] = (np.minimum(freq, FREQ_MAX) << TICK_BITS) + tick

    def taken_frequency(self) -> np.ndarray:
        """The frequencies ``[K]`` (LFU, TinyLFU: the keys' high bits) of the victims the
        last :meth:`ordered_victims` gave, in its order: read from the keys the pool kept,
        in pool order, not gathered from ``key`` at random (a valid entry's key is the
        one it was found with)."""
        return self.pool_key.take(self.taken) >> TICK_BITS

    def halve(self) -> None:
        """Halve the frequency of every cached row (the sketch was halved): one C pass
        over the keys, else numpy."""
        self.pool_at = self.pool.size  # the keys change: search again
        if halve_keys(self.key, FREE, TICK_BITS):
            return
        used = self.key != FREE
        k = self.key[used]
        self.key[used] = (((k >> TICK_BITS) >> 1) << TICK_BITS) + (k & _LOW)

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
        low = _LOW if self.lfu else -1  # the bits of a key that hold its last use
        got = search_near(self.key, low, tick, protect, self.marked, k)  # one C pass
        if got is not None:
            near, cand = got  # [>= min(k, cand)] increasing
            if k >= cand:
                return near
            return _first_k(near, self.key.take(near), k, row_id)
        key = np.where(self.evictable(tick), self.key, FREE)  # [C]; FREE: not evictable
        if protect is not None and protect.size > 0:
            key[protect[protect >= 0]] = FREE
        cand = int(np.count_nonzero(key != FREE))
        if k >= cand:
            return np.flatnonzero(key != FREE)
        bounded = _smallest_keys(key, k)  # [>= k] every slot whose key is among the k smallest
        if bounded is None:
            return _first_k(np.arange(key.size), key, k, row_id)
        return _first_k(bounded, key.take(bounded), k, row_id)

    def ordered_victims(
        self, k: int, tick: int, protect: np.ndarray | None, row_id: np.ndarray, chunk: int
    ) -> np.ndarray:
        """Up to ``k`` slots in eviction order (smallest key first, ties: smaller row id)
        among rows last used before ``tick`` and not in ``protect``, without evicting
        them: entries of the pool still valid (key unchanged since the search), after a
        new search of ``max(k, chunk)`` rows when the pool cannot give ``k``; with
        ``chunk`` 1, a new search every time (the exact order)."""
        if k <= 0:
            self.taken = np.empty(0, dtype=np.int64)
            return self.taken
        got = self._from_pool(k, tick, protect) if chunk > 1 else self.pool[:0]
        if got.size < k:
            found = self.victims(max(k, chunk), tick, protect, row_id)
            self.pool = found.take(key_then_id_order(self.key.take(found), row_id.take(found)))
            self.pool_key = self.key.take(self.pool)
            self.pool_at = 0
            got = self._from_pool(k, tick, protect)
        return got

    def _from_pool(self, k: int, tick: int, protect: np.ndarray | None) -> np.ndarray:
        """The first ``k`` pool entries still valid (skipping used-up ones for good).

        One C pass (:mod:`cache.kernels.victim_pool`) where it is available. Else numpy:
        the pool can hold a chunk of the capacity while a step wants a few thousand
        victims, so it is read in windows that double until they hold ``k`` valid
        entries, and ``protect`` is looked up in a mark array (a set lookup per entry,
        where ``np.isin`` would sort or hash both arrays every call)."""
        rest = self.pool[self.pool_at :]
        keys_then = self.pool_key[self.pool_at :]
        at = pool_valid(rest, keys_then, self.key, _LOW, tick, protect, self.marked, k)
        if at is None:
            at = self._valid_numpy(rest, keys_then, k, tick, protect)
        self.taken = at + self.pool_at
        return rest.take(at)

    def _valid_numpy(
        self, rest: np.ndarray, keys_then: np.ndarray, k: int, tick: int, protect: np.ndarray | None
    ) -> np.ndarray:
        """:func:`cache.kernels.victim_pool.pool_valid` on numpy: positions ``[<= k]`` in
        ``rest``."""
        marks = protect is not None and protect.size > 0
        if marks:
            assert protect is not None
            protect = protect[protect >= 0]  # slots only (pool entries are never negative)
            self.marked[protect] = True
        try:
            found: list[np.ndarray] = []
            have, lo, window = 0, 0, max(2 * k, 1024)
            while have < k and lo < rest.size:
                part = rest[lo : lo + window]
                key = self.key.take(part)
                ok = (key == keys_then[lo : lo + window]) & ((key & _LOW) < tick)
                if marks:
                    ok &= ~self.marked.take(part)
                valid = np.flatnonzero(ok) + lo  # [v] positions in rest
                found.append(valid[: k - have])
                have += min(valid.size, k - have)
                lo += window
                window *= 2
        finally:
            if marks:
                self.marked[protect] = False
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def consumed(self, slots: np.ndarray) -> None:
        """``slots`` (the first valid pool entries, as :meth:`ordered_victims` gave them)
        were evicted: later calls start after them."""
        if slots.size == 0 or self.pool_at >= self.pool.size:
            return
        last = int(slots[-1])
        n = slots.size
        if n <= self.taken.size:  # the usual case: a prefix of what the pool last gave
            j = int(self.taken[n - 1])
            if self.pool_at <= j < self.pool.size and int(self.pool[j]) == last:
                self.pool_at = j + 1
                return
        where = np.flatnonzero(self.pool[self.pool_at :] == last)
        if where.size:
            self.pool_at += int(where[0]) + 1
