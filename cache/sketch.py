"""A count-min sketch of recent id frequencies with periodic halving (TinyLFU's filter).

``depth * width`` int32 counters (one flat torch tensor), read as lines of 16 (64 bytes,
one cache line). Id ``x`` (int64, a packed id for a shared cache) has ``depth`` counters,
all in ONE line, so counting or estimating it costs one cache miss where ``depth``
separate rows cost ``depth`` (the sketch is larger than the CPU caches; Caffeine's
TinyLFU sketch blocks its counters the same way). With ``h_d = (x * A_d) mod 2**64`` for
fixed odd 64-bit multipliers ``A_d`` (:data:`MULTIPLIERS`)::

    line(x)   = ((h_0 >> 32) * lines) >> 32                     lines = depth * width / 16
    slot_d(x) = d * k + ((((h_d >> 16) & 0xffff) * k) >> 16)    k = 16 // depth
    counter   = 16 * line(x) + slot_d(x)

Each hash row owns ``k`` slots of a line, so an id's counters are distinct. The same id
lands on the same counters in every run and the tests' per-id model can recompute them.

* :meth:`add` counts each id once (a batch's distinct ids: the frequency is the number
  of batches an id appeared in, which is what a cached row saves: one pull per batch);
  duplicates in one call count each time. One pass of a C kernel over the ids
  (:mod:`cache.kernels.sketch`), else one ``index_add_`` over ``depth x N`` positions;
  never a Python loop per id.
* :meth:`estimate` is the minimum of an id's ``depth`` counters: never below the true
  count since the last halving, above it only by collisions.
* :meth:`count` is :meth:`add` then :meth:`estimate` of the same ids (a serving pull's
  batch: counted, then its estimates decide admissions).
* Aging: once ``period`` ids were added since the last halving, every counter is
  halved (``c >> 1``) and the addition count restarts (:meth:`add` says so, so the
  cache halves the frequencies it keeps too). Old popularity fades by half per
  period, so the sketch follows a changing id law, and counters stay bounded
  (at most ``2 * period``).

Memory: ``4 * depth * width`` bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from cache.kernels.sketch import add_counts, min_counts
from ps.local.table import table_array

#: Odd 64-bit multipliers of the hash rows (from the SplitMix64 and Murmur3 finalizers
#: and the golden ratio); ``depth`` <= 8.
MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xBF58476D1CE4E5B9,
    0x94D049BB133111EB,
    0xFF51AFD7ED558CCD,
    0xC4CEB9FE1A85EC53,
    0xD6E8FEB86659FD93,
    0xA0761D6478BD642F,
    0xE7037ED1A0B428DB,
)


class FrequencySketch:
    """``depth * width`` counters (lines of 16) of ids added in the last ``period``
    additions or so."""

    def __init__(self, width: int, depth: int, period: int) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError(f"FrequencySketch: width must be a power of 2 >= 16, got {width}")
        if not 1 <= depth <= len(MULTIPLIERS):
            raise ValueError(
                f"FrequencySketch: depth must be in [1, {len(MULTIPLIERS)}], got {depth}"
            )
        if period < 1:
            raise ValueError(f"FrequencySketch: period must be >= 1, got {period}")
        self.width, self.depth, self.period = width, depth, period
        self.lines = depth * width // 16  # 64-byte lines of 16 counters
        self.per_row = 16 // depth  # slots of a line each hash row owns
        self.mult = np.array(MULTIPLIERS[:depth], dtype=np.uint64)[:, None]  # [depth, 1]
        self.mult_flat = np.ascontiguousarray(self.mult[:, 0])  # [depth], for the kernels
        self.first = (np.arange(depth, dtype=np.uint64) * np.uint64(self.per_row))[:, None]
        # [depth * width], zeros starting on a cache line (so each line of 16 is one)
        self.counters = table_array((depth * width,), torch.int32)
        self.added = 0  # ids added since the last halving
        self.halvings = 0

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Flat counter positions int64 ``[depth, N]`` of ``ids`` int64 ``[N]``."""
        h = ids.astype(np.uint64)[None, :] * self.mult  # [depth, N], wraps mod 2**64
        u32, u16 = np.uint64(32), np.uint64(16)
        line = ((h[0] >> u32) * np.uint64(self.lines)) >> u32  # [N]
        k = np.uint64(self.per_row)
        slot = self.first + ((((h >> u16) & np.uint64(0xFFFF)) * k) >> u16)  # [depth, N]
        return (line[None, :] * np.uint64(16) + slot).astype(np.int64)

    def add(self, ids: np.ndarray) -> bool:
        """Count ``ids`` int64 ``[N]`` once each; True if the sketch was halved after."""
        if ids.size == 0:
            return False
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not add_counts(ids, self.mult_flat, self.lines, self.counters):
            pos = torch.from_numpy(self.positions(ids).reshape(-1))
            self.counters.index_add_(0, pos, torch.ones(pos.numel(), dtype=torch.int32))
        return self.counted(int(ids.size))

    def kernel_view(self) -> tuple[np.ndarray, int, np.ndarray]:
        """``(mult [depth], lines, counters [16 * lines])`` as numpy arrays (the counters a
        view), for a C pass that counts ids as :meth:`add` does
        (:mod:`cache.kernels.plan_pull`) and then calls :meth:`counted`."""
        return self.mult_flat, self.lines, self.counters.numpy()

    def halves_after(self, n: int) -> bool:
        """Whether counting ``n`` more ids brings a halving (:meth:`counted` then says
        True)."""
        return self.added + n >= self.period

    def counted(self, n: int) -> bool:
        """``n`` ids were counted into the counters (by :meth:`add`, or a caller's pass
        over :meth:`kernel_view`); True if the sketch was halved after."""
        if not self.halves_after(n):
            self.added += n
            return False
        self.counters.bitwise_right_shift_(1)
        self.added = 0
        self.halvings += 1
        return True

    def count(self, ids: np.ndarray) -> tuple[np.ndarray, bool]:
        """``(estimates [N], halved)``: :meth:`add` of ``ids`` int64 ``[N]``, then their
        :meth:`estimate` (after the halving, if the addition brought one)."""
        halved = self.add(ids)
        return self.estimate(ids), halved

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Estimated counts int64 ``[N]`` of ``ids`` int64 ``[N]``."""
        if ids.size == 0:
            return np.empty(0, dtype=np.int64)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        got_c = min_counts(ids, self.mult_flat, self.lines, self.counters)
        if got_c is not None:
            return got_c
        pos = torch.from_numpy(self.positions(ids).reshape(-1))
        got = self.counters.take(pos).view(self.depth, ids.size)  # [depth, N]
        return got.amin(dim=0).numpy().astype(np.int64)

    def state(self) -> dict[str, torch.Tensor]:
        """Counters and addition count, for a checkpoint of the cache."""
        return {
            "counters": self.counters.clone(),
            "added": torch.tensor([self.added, self.halvings], dtype=torch.int64),
        }

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state` (same width and depth)."""
        counters = state["counters"]
        if counters.shape != self.counters.shape:
            raise ValueError(
                f"FrequencySketch: saved counters {tuple(counters.shape)}, expected "
                f"{tuple(self.counters.shape)} (depth {self.depth} x width {self.width})"
            )
        self.counters.copy_(counters.to(torch.int32))
        self.added, self.halvings = (int(v) for v in state["added"].tolist())
