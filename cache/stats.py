"""Per-table cache counters and the histogram of served staleness.

``CacheStats.snapshot()`` is what :meth:`cache.CachedStore.cache_stats` returns
per table (JSON-ready: ints, floats, a ``{staleness: count}`` dict). Key meanings:

=========================  ==========================================================
``lookups``                distinct ids served by pulls (per request)
``hits``                   served from a copy cached before this batch, not re-pulled
``misses``                 not cached: pulled (at use, or by the batch's prefetch)
``refreshes``              cached but past the read bound: re-pulled
``prefetched``             misses + refreshes whose rows the prefetch brought
``hit_rate``               ``hits / lookups``
``pass_through``           served rows the full cache could not keep (pushed directly)
``pull_requests``          requests sent to the PS (pulls and prefetches)
``ids_sent``               ids (with clocks) sent in those requests
``rows_pulled``            rows the PS sent back; ``bytes_pulled`` = rows x (4 dim + 8)
``rows_saved_by_bound``    cached ids a conditional pull did not return (fresh enough)
``updates``                row gradients received by ``push`` (per distinct id)
``rows_pushed``            row gradients sent to the PS; ``bytes_pushed`` = rows x 4 dim
``push_requests``          push requests sent to the PS
``evictions``              rows evicted; ``evicted_pending`` of them had pending updates
``rejected``               misses TinyLFU did not admit (served, pushed through; also in
                           ``pass_through``)
``prefetch_rejected``      rows a prefetch fetched that TinyLFU then did not admit
``sketch_halvings``        times TinyLFU's frequency sketch was halved (aged)
``pending_rows``           rows holding unpushed updates now
``cached_rows``            rows cached now (of ``capacity``)
``staleness_served``       {s: rows served whose PS clock was s ahead of the copy}
``staleness_exact``        True: exact PS clocks; False: lower bounds (see docs/cache.md)
``max_staleness_served``   largest key of ``staleness_served``
=========================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "refreshes",
    "prefetched",
    "pass_through",
    "pull_requests",
    "ids_sent",
    "rows_pulled",
    "bytes_pulled",
    "rows_saved_by_bound",
    "updates",
    "rows_pushed",
    "bytes_pushed",
    "push_requests",
    "evictions",
    "evicted_pending",
    "rejected",
    "prefetch_rejected",
    "sketch_halvings",
)


@dataclass(slots=True)
class CacheStats:
    dim: int
    exact: bool
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    staleness: np.ndarray = field(default_factory=lambda: np.zeros(8, dtype=np.int64))

    def add(self, name: str, n: int) -> None:
        self.counters[name] += n

    def pulled(self, asked: int, returned: int, cached_asked: int) -> None:
        c = self.counters
        c["pull_requests"] += 1
        c["ids_sent"] += asked
        c["rows_pulled"] += returned
        c["bytes_pulled"] += returned * (4 * self.dim + 8)
        c["rows_saved_by_bound"] += cached_asked

    def pushed(self, rows: int) -> None:
        c = self.counters
        c["push_requests"] += 1
        c["rows_pushed"] += rows
        c["bytes_pushed"] += rows * 4 * self.dim

    def served(self, fresh: int, staleness: np.ndarray) -> None:
        """Count ``fresh`` rows served at staleness 0 and rows of ``staleness`` (int64, >= 0)."""
        self.staleness[0] += fresh
        if staleness.size == 0:
            return
        counts = np.bincount(staleness)
        if counts.size > self.staleness.size:
            grown = np.zeros(max(counts.size, 2 * self.staleness.size), dtype=np.int64)
            grown[: self.staleness.size] = self.staleness
            self.staleness = grown
        self.staleness[: counts.size] += counts

    def snapshot(self, *, cached_rows: int, pending_rows: int, capacity: int) -> dict[str, Any]:
        c = self.counters
        out: dict[str, Any] = dict(c)
        out["hit_rate"] = c["hits"] / c["lookups"] if c["lookups"] else 0.0
        out["cached_rows"] = cached_rows
        out["pending_rows"] = pending_rows
        out["capacity"] = capacity
        seen = np.flatnonzero(self.staleness)
        out["staleness_served"] = {int(s): int(self.staleness[s]) for s in seen}
        out["staleness_exact"] = self.exact
        out["max_staleness_served"] = int(seen[-1]) if seen.size else 0
        return out
