"""The ids a client read as missing from Redis, kept as hints for its next push of them.

A row exists in Redis once a push created it. A push that names a missing row without
its initial value costs a second round (the script reports the row, the client sends it
again with the initial row), so a pull that finds rows missing remembers them and the
next push of each sends its initial row in the first round. With a cache in front, that
push comes when the row's pending updates are due or when it is evicted, often many
reads later, so hints are kept per id, up to :data:`MAX_ABSENT_HINTS` ids per table (the
oldest reads' ids drop out first), not for the last few reads only.

Only a hint: a row created meanwhile by another client ignores the initial row it is
sent with; a row missing without a hint costs the second round.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ps.local.dynamic_index import IdIndex

#: Ids remembered per table as missing from Redis: at most 32 MiB of index.
MAX_ABSENT_HINTS = 1 << 20


class AbsentHints:
    """A bounded set of int64 ids (vectorised: one hash probe round per batch)."""

    def __init__(self, limit: int = MAX_ABSENT_HINTS) -> None:
        self.limit = limit
        self._index = IdIndex()
        self._reads: deque[np.ndarray] = deque()  # ids added per read, oldest first
        self._kept = 0  # ids in _reads (an upper bound of the live ones: taken ids stay)

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:
        return len(self._index) > 0

    def add(self, ids: np.ndarray) -> None:
        """Remember distinct ``ids`` int64 ``[A]`` (those already held keep their age)."""
        ids = np.ascontiguousarray(ids[: self.limit], dtype=np.int64)
        if ids.size == 0:
            return
        new = ids[self._index.lookup(torch.from_numpy(ids)).numpy() < 0]
        if new.size == 0:
            return
        self._index.insert(torch.from_numpy(new), torch.zeros(new.size, dtype=torch.int64))
        self._reads.append(new)
        self._kept += new.size
        while self._kept > self.limit:  # the oldest read's ids drop out
            old = self._reads.popleft()
            self._kept -= old.size
            self._index.remove(torch.from_numpy(old))

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Positions int64 ``[H]`` (increasing) of the distinct ``ids`` ``[N]`` that are
        hinted; those hints are used up."""
        if ids.size == 0 or not self:
            return np.empty(0, dtype=np.int64)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        held = np.flatnonzero(self._index.lookup(torch.from_numpy(ids)).numpy() >= 0)
        if held.size:
            self._index.remove(torch.from_numpy(ids[held]))
        return held
