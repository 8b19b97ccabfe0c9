"""The id -> cache slot map of one table, batched (no per-id Python loop), on numpy arrays.

Two layouts behind one interface (ids and slots are int64 numpy arrays):

* ``DenseSlotIndex`` (fixed tables up to :data:`cache.config.DENSE_INDEX_MAX_ROWS`
  rows): an int32 array ``[num_rows]`` holding each id's slot or -1 (4 bytes per
  table row); a lookup is one ``take``, ~100x cheaper than hashing;
* ``HashSlotIndex`` (dynamic or very large tables): ``ps.local.dynamic_index.IdIndex``,
  a vectorised open-addressing hash map (~46-92 bytes per cached id).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from cache.config import DENSE_INDEX_MAX_ROWS
from ps.local.dynamic_index import IdIndex


class SlotIndex(Protocol):
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slots int64 ``[N]`` of ``ids`` int64 ``[N]`` (-1 where not cached)."""
        ...

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map distinct, absent ``ids`` ``[K]`` to ``slots`` ``[K]``."""
        ...

    def remove(self, ids: np.ndarray) -> None:
        """Forget distinct, present ``ids``."""
        ...


class DenseSlotIndex:
    def __init__(self, num_rows: int) -> None:
        self._slot = np.full(num_rows, -1, dtype=np.int32)  # [num_rows]

    @property
    def map(self) -> np.ndarray:
        """int32 ``[num_rows]``: each id's slot or -1 (for a C pass that looks ids up)."""
        return self._slot

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._slot.take(ids).astype(np.int64)

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self._slot[ids] = slots

    def remove(self, ids: np.ndarray) -> None:
        self._slot[ids] = -1


class HashSlotIndex:
    def __init__(self, capacity: int) -> None:
        self._index = IdIndex(expected=capacity)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._index.lookup(torch.from_numpy(ids)).numpy()

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self._index.insert(torch.from_numpy(ids), torch.from_numpy(slots))

    def remove(self, ids: np.ndarray) -> None:
        self._index.remove(torch.from_numpy(ids))


def make_slot_index(
    num_rows: int | None, capacity: int, *, largest_table: int | None = None
) -> SlotIndex:
    """The cheaper index for a table of ``num_rows`` (None: dynamic) and ``capacity`` slots.

    ``largest_table``: for tables sharing one cache, the rows of the largest of them;
    the dense index then costs what their own dense indices would have together, so
    it is used when each of them would have had one."""
    rows = num_rows if largest_table is None else largest_table
    if num_rows is not None and rows is not None and rows <= DENSE_INDEX_MAX_ROWS:
        return DenseSlotIndex(num_rows)
    return HashSlotIndex(capacity)
