"""A vectorised int64 -> int64 hash map: the id -> row-slot index of a dynamic table.

Open addressing with linear probing over one array of buckets::

    kv  int64 [cap, 2]   kv[b, 0]: the id stored in bucket b
                         kv[b, 1]: its value (a row slot >= 0), or EMPTY (-1), or TOMBSTONE (-2)

(key and value side by side: a probe costs one cache miss, not two).

``cap`` is a power of two and the home bucket of an id is
``splitmix64(id ^ salt) & (cap - 1)`` (salted so that it is independent of the
shard routing, which uses the unsalted hash). Every operation works on a whole
batch of ids at once: one probe *round* handles every id still searching, and
only the ids whose bucket held another key go on to the next bucket, so the
Python loop runs once per probe round (a handful), never once per id.

The arrays are numpy (a probe round is ~8 small array operations, and numpy's
per-call overhead is a fraction of torch's); the interface takes and returns
int64 torch tensors (zero-copy views).

Any int64 is a valid key (no sentinel keys: emptiness lives in ``vals``).
Deleted buckets become tombstones that lookups step over and inserts reuse; the
table is rebuilt when live + tombstone buckets pass 35 % of ``cap``, which keeps
probe sequences short.
"""

from __future__ import annotations

import numpy as np
import torch

EMPTY = -1
TOMBSTONE = -2
_SALT = np.uint64(0x5851F42D4C957F2D)  # decorrelates buckets from shards (unsalted hash)
_MAX_LOAD = 0.35  # probe chains stay short; index costs 46-92 bytes per id
_MIN_CAP = 64
_U64 = np.uint64


def _mix(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of ``ids ^ salt`` as uint64 ``[N]`` (wrapping arithmetic)."""
    x = ids.view(np.uint64) ^ _SALT
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


class IdIndex:
    """Maps int64 ids to int64 values (row slots >= 0); batched, no per-id Python loop."""

    def __init__(self, expected: int = 0) -> None:
        cap = max(_MIN_CAP, _next_pow2(int(expected / _MAX_LOAD) + 1))
        self._alloc(cap)
        self._live = 0
        self._tombs = 0

    def _alloc(self, cap: int) -> None:
        self._cap = cap
        self._mask = _U64(cap - 1)
        self._kv = np.zeros((cap, 2), dtype=np.int64)  # [cap, 2]: key, value
        self._kv[:, 1] = EMPTY

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        """Number of buckets (a power of two, at least live keys / 0.35)."""
        return self._cap

    @property
    def nbytes(self) -> int:
        return 16 * self._cap

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (_mix(ids) & self._mask).astype(np.int64)  # [N]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(bucket, value)`` of each id, both int64 ``[N]`` and -1 where the id is absent."""
        n = ids.size
        bucket = np.full(n, -1, dtype=np.int64)
        value = np.full(n, -1, dtype=np.int64)
        if n == 0 or self._live == 0:
            return bucket, value
        mask = self._cap - 1
        pos = self._home(ids)  # [A] bucket probed by each still-active id
        active = np.arange(n)  # [A] which request entries are still searching
        keys = ids
        while active.size > 0:
            entry = np.take(self._kv, pos, axis=0)  # [A, 2]
            v = entry[:, 1]
            hit = (v >= 0) & (entry[:, 0] == keys)
            where = active[hit]
            bucket[where] = pos[hit]
            value[where] = v[hit]
            go_on = ~hit & (v != EMPTY)  # another key or a tombstone: probe the next bucket
            active, keys = active[go_on], keys[go_on]
            pos = (pos[go_on] + 1) & mask
        return bucket, value

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Value of each id (int64 ``[N]``), -1 where the id is absent. Repeats are fine."""
        return torch.from_numpy(self._find(_np(ids))[1])

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``ids`` (int64 ``[K]``, distinct, none present yet) with ``values`` (>= 0)."""
        k = ids.numel()
        if k == 0:
            return
        if self._live + self._tombs + k > _MAX_LOAD * self._cap:
            self._rebuild(self._live + k)
        self._place(_np(ids), _np(values))
        self._live += k

    def _place(self, ids: np.ndarray, values: np.ndarray) -> None:
        # Each round, every id still looking whose bucket is free (empty or tombstone)
        # competes for it; the lowest request index wins the bucket, the rest move on.
        mask = self._cap - 1
        pos = self._home(ids)
        active = np.arange(ids.size)
        while active.size > 0:
            v = self._kv[pos, 1]
            cand = np.flatnonzero(v < 0)  # [C] entries of `active` whose bucket is free
            won = np.zeros(active.size, dtype=bool)
            if cand.size > 0:
                _, first = np.unique(pos[cand], return_index=True)
                winners = cand[first]  # [W] entries of `active`, one per bucket
                self._tombs -= int(np.count_nonzero(v[winners] == TOMBSTONE))
                self._kv[pos[winners], 0] = ids[active[winners]]
                self._kv[pos[winners], 1] = values[active[winners]]
                won[winners] = True
            go_on = ~won
            active = active[go_on]
            pos = (pos[go_on] + 1) & mask

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Delete ``ids`` (distinct); returns their old values (-1 for ids that were absent)."""
        slot, old = self._find(_np(ids))
        hit = slot >= 0
        self._kv[slot[hit], 1] = TOMBSTONE
        n = int(np.count_nonzero(hit))
        self._live -= n
        self._tombs += n
        return torch.from_numpy(old)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``(ids [L], values [L])`` pairs, in bucket order."""
        live = self._kv[:, 1] >= 0
        return torch.from_numpy(self._kv[live, 0]), torch.from_numpy(self._kv[live, 1])

    def clear(self) -> None:
        self._alloc(_MIN_CAP)
        self._live = 0
        self._tombs = 0

    def _rebuild(self, live_after: int) -> None:
        live = self._kv[:, 1] >= 0
        ids, vals = self._kv[live, 0], self._kv[live, 1]
        self._alloc(max(_MIN_CAP, _next_pow2(int(live_after / _MAX_LOAD) + 1)))
        self._tombs = 0
        self._place(ids, vals)
