"""The cache's settings: capacity, eviction policy, staleness bounds, prefetch checks.

One :class:`CacheConfig` applies to every table of a :class:`cache.CachedStore`;
the capacity is per table (rows, or a fraction of a fixed table's rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ps import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad, TableSpec

POLICIES = ("lru", "lfu", "tinylfu")
LOCAL_STEPS = ("optimizer", "sgd")
PREFETCH = ("auto", "on", "off")
WRITE_BACK = ("auto", "gradients", "values")

#: TinyLFU defaults: sketch counters per cached row (rounded up to a power of 2), hash
#: rows, and ids added between halvings per cached row.
SKETCH_WIDTH_PER_ROW = 1
SKETCH_DEPTH = 4
SKETCH_PERIOD_PER_ROW = 10

#: Rows up to which a fixed table's id -> slot map is a plain array (4 bytes per row)
#: instead of a hash index (``ps.local.dynamic_index.IdIndex``, ~46-92 bytes per cached id).
DENSE_INDEX_MAX_ROWS = 1 << 24


def _int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"CacheConfig: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"CacheConfig: {name} must be >= {low}, got {value}")
    return value


@dataclass(kw_only=True, slots=True)
class CacheConfig:
    """Settings of the worker-side hot-row cache (see ``docs/cache.md``).

    Exactly one of ``capacity_rows`` (rows per table) and ``capacity_fraction``
    (of each fixed table's ``num_rows``, rounded up) sets the size.

    * ``policy``: ``"lru"`` evicts the least recently used rows; ``"lfu"`` the
      least frequently used (uses counted per lookup since the row entered the
      cache), ties broken by recency; ``"tinylfu"`` adds frequency-aware
      admission: a count-min sketch (:mod:`cache.sketch`) counts in how many
      recent batches each id appeared, whether cached or not, and a missed id is
      cached only if its estimate beats that of the row it would evict (the
      least frequent by the same estimate); ids not admitted are served and their
      gradients pushed at once, as when the cache is full. So one-off ids do not
      evict hot rows (``docs/cache_admission.md``).
    * ``sketch_width``, ``sketch_depth``, ``sketch_period`` (``"tinylfu"`` only):
      counters per hash row (a power of 2; None: the capacity rounded up),
      hash rows (1-8, default 4), and ids counted between two halvings of every
      counter (None: ``10 x capacity``). The sketch takes ``4 x width x depth``
      bytes.
    * ``read_bound`` (``s_r``): a cached copy is served while the PS clock is at
      most ``s_r`` ahead of the clock it was read at; 0 = synchronous reads.
    * ``write_bound`` (``s_w``): a row's gradients are pushed once more than
      ``s_w`` updates are pending (and on eviction and ``flush()``); 0 = every
      update is pushed at once.
    * ``counted_pushes``: True (default): a row pushed with ``k`` pending updates says
      so, with the statistic its optimizer's accumulator needs (``ps.PushRequest``
      ``counts`` and ``stats``), so the PS applies ``k`` updates (adaptive optimizers
      then learn under a write bound as without one; ``docs/cache.md``). Where the
      store does not take counted pushes (``ps.Store.counted_pushes``) or the rows
      are on a device, the PS applies one update per push, as with False.
    * ``local_step``: how a cached copy moves with each local update between its
      refreshes. ``"optimizer"`` (the default): the table's own optimizer steps the
      copy, with the row's optimizer state as pulled with the row (one more float32
      per state column in each record), and a refreshed row with pending updates is
      the PS row advanced by them as the PS will apply them; so with one worker and
      no write bound the copy is the PS row. ``"sgd"``: a plain SGD step,
      ``copy -= local_lr * grad`` (HET's rule; no state). None: ``"sgd"`` when
      ``local_lr`` is given, else ``"optimizer"``.
    * ``local_lr`` (``local_step="sgd"`` only): the SGD step size. None: the table
      optimizer's ``lr`` (SGD, RowWiseAdagrad, Adagrad, Adam; 0 for FTRL). 0: a copy
      changes only when it is refreshed from the PS.
    * ``verify_prefetched``: True (default): the pull of a prefetched batch still
      sends one conditional pull with the clocks of all cached ids, so the read
      bound holds exactly when a row is used; only rows that went past it since
      the prefetch come back. False: rows the prefetch checked are served without
      asking the PS again unless this worker pushed them since (saves a round
      trip; with several workers, other workers' pushes during one step may then
      add to ``s_r``).
    * ``prefetch``: what :meth:`cache.CachedStore.prefetch_many` and
      :meth:`~cache.CachedStore.prefetch` do with the next batch's ids. ``"on"``: plan
      and fetch them ahead (their misses ride on the current pull, or go at once).
      ``"off"``: check them and nothing more; the batch's own pull fetches its misses.
      ``"auto"`` (the default): off. A prefetch that rides on the current pull moves
      the next batch's misses in the same request as this batch's rows, so it hides
      no latency (the batch's own pull would move the same rows one request later)
      and plans and admits the batch a second time: in the cache benchmark ~20 % of
      the in-process cached step, ~80 ns of the cache's own time per id over MPI,
      and the DLRM job over MPI on one host trained 1.06-1.16x faster without it.
      ``"on"`` is for the immediate :meth:`~cache.CachedStore.prefetch` of a loop that
      computes while it travels, and for studies of what a prefetch moves.
    * ``sole_writer``: this cache is the only writer of its tables (one worker; what
      :func:`hybridrec.launch.job_cache.with_cache` sets for a job of one worker). The PS then
      applies only this cache's pushes, in order, so a cached row's PS clock is
      exactly its copy clock plus its ``own`` pushes since, and a serving pull asks
      the PS only about the misses and the rows pushed more than ``s_r`` times since
      their read: provably fresh rows cost no request (ids, clocks and round trip).
      Wrong with another writer (the bound would not hold), so False by default.
    * ``write_back``: what a cached row's due updates send to the PS. ``"gradients"``:
      their pending sum (counted, see ``counted_pushes``), which the PS steps with the
      table's optimizer. ``"values"``: the copy itself, its row, optimizer state and
      the clock the PS then has (:class:`ps.WriteRequest`), which the PS stores as they
      are: the copy already took every update, in order, with the optimizer the PS would
      run, so the PS applies no sub-steps and the cache keeps no pending sums; the rows
      end as ``k`` separate pushes would leave them, where a counted push approximates
      them (``docs/cache.md``). It needs a cache that is the rows' only writer
      (``sole_writer``), a store that takes writes (:attr:`ps.Store.value_writes`),
      float32 host records of fixed tables and row-wise Adagrad stepping the copies
      (``local_step="optimizer"``: the records' pass runs the store kernel's step, so a
      copy is the row the PS would hold, bit for bit); a serving pull
      then asks only for misses (a written-back copy is never older than the PS's
      row). Rows not cached are still pushed as gradients. ``"auto"`` (the default):
      ``"values"`` where all of that holds, else ``"gradients"``; ``"values"`` where it
      does not is a ValueError naming what is missing.
    * ``exact_staleness``: also read the PS clocks of served cache hits (one
      extra clocks request per pull; 8 bytes per row) so the staleness histogram
      is exact instead of a lower bound. For tests and diagnosis.
    * ``group_tables``: tables of one ``dim`` and local step size share ONE cache
      (fixed tables first requested together, in one batched request), as FBGEMM's
      table-batched cache does: a step is
      then one plan, one install and one update over every table's ids instead of
      one per table, and the hot rows of all of them compete for the summed
      capacity. Statistics and ``cache_state`` are then per group (named by its
      tables joined with ``+``). False: one cache per table.
    * ``evict_chunk``: rows evicted at least at a time when the cache is full
      (None: ``max(1, capacity // 16)``); the victim search is O(capacity), so
      evicting a chunk amortizes it. 1 = exact LRU/LFU order. TinyLFU evicts only
      rows a candidate beats; for it this is the size of one victim search, kept as
      a pool for the next batches (:mod:`cache.policy`).
    """

    capacity_rows: int | None = None
    capacity_fraction: float | None = None
    policy: Literal["lru", "lfu", "tinylfu"] = "lru"
    read_bound: int = 0
    write_bound: int = 0
    counted_pushes: bool = True
    local_step: Literal["optimizer", "sgd"] | None = None
    local_lr: float | None = None
    verify_prefetched: bool = True
    prefetch: Literal["auto", "on", "off"] = "auto"
    sole_writer: bool = False
    write_back: Literal["auto", "gradients", "values"] = "auto"
    exact_staleness: bool = False
    evict_chunk: int | None = None
    group_tables: bool = False
    sketch_width: int | None = None
    sketch_depth: int | None = None
    sketch_period: int | None = None

    def __post_init__(self) -> None:
        if (self.capacity_rows is None) == (self.capacity_fraction is None):
            raise ValueError(
                "CacheConfig: give exactly one of capacity_rows and capacity_fraction, got "
                f"capacity_rows={self.capacity_rows!r}, "
                f"capacity_fraction={self.capacity_fraction!r}"
            )
        if self.capacity_rows is not None:
            _int("capacity_rows", self.capacity_rows, 0)
        if self.capacity_fraction is not None:
            f = self.capacity_fraction
            if not isinstance(f, int | float) or isinstance(f, bool):
                raise TypeError(
                    f"CacheConfig: capacity_fraction must be a number, got {type(f).__name__}"
                )
            if not (math.isfinite(f) and 0 < f <= 1):
                raise ValueError(f"CacheConfig: capacity_fraction must be in (0, 1], got {f}")
        if self.policy not in POLICIES:
            raise ValueError(f"CacheConfig: policy must be one of {POLICIES}, got {self.policy!r}")
        _int("read_bound", self.read_bound, 0)
        _int("write_bound", self.write_bound, 0)
        if self.local_step is None:
            self.local_step = "sgd" if self.local_lr is not None else "optimizer"
        if self.local_step not in LOCAL_STEPS:
            raise ValueError(
                f"CacheConfig: local_step must be one of {LOCAL_STEPS}, got {self.local_step!r}"
            )
        if self.local_step == "optimizer" and self.local_lr is not None:
            raise ValueError(
                f"CacheConfig: local_lr={self.local_lr!r} sets the step of local_step='sgd', "
                "got local_step='optimizer' (the table's optimizer sets its own step)"
            )
        if self.local_lr is not None:
            lr = self.local_lr
            if not isinstance(lr, int | float) or isinstance(lr, bool):
                raise TypeError(f"CacheConfig: local_lr must be a number, got {type(lr).__name__}")
            if not (math.isfinite(lr) and lr >= 0):
                raise ValueError(f"CacheConfig: local_lr must be a finite number >= 0, got {lr}")
        for name in (
            "counted_pushes",
            "verify_prefetched",
            "sole_writer",
            "exact_staleness",
            "group_tables",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"CacheConfig: {name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        if self.write_back not in WRITE_BACK:
            raise ValueError(
                f"CacheConfig: write_back must be one of {WRITE_BACK}, got {self.write_back!r}"
            )
        if self.prefetch not in PREFETCH:
            raise ValueError(
                f"CacheConfig: prefetch must be one of {PREFETCH}, got {self.prefetch!r}"
            )
        if self.evict_chunk is not None:
            _int("evict_chunk", self.evict_chunk, 1)
        for name in ("sketch_width", "sketch_depth", "sketch_period"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.policy != "tinylfu":
                raise ValueError(
                    f"CacheConfig: {name}={value!r} applies to policy='tinylfu' only, "
                    f"got policy={self.policy!r}"
                )
            _int(name, value, 1)
        w = self.sketch_width
        if w is not None and (w < 16 or w & (w - 1)):
            raise ValueError(f"CacheConfig: sketch_width must be a power of 2 >= 16, got {w}")
        if self.sketch_depth is not None and self.sketch_depth > 8:
            raise ValueError(
                f"CacheConfig: sketch_depth must be in [1, 8], got {self.sketch_depth}"
            )

    def capacity(self, spec: TableSpec) -> int:
        """Cache rows for the table ``spec``."""
        if self.capacity_rows is not None:
            return self.capacity_rows
        assert self.capacity_fraction is not None
        if spec.num_rows is None:
            raise ValueError(
                f"CacheConfig: table {spec.name!r} is dynamic (no num_rows), so "
                f"capacity_fraction={self.capacity_fraction} has no size to scale; "
                "use capacity_rows"
            )
        return math.ceil(self.capacity_fraction * spec.num_rows)

    def prefetches(self) -> bool:
        """Whether the cache fetches announced batches ahead (``prefetch="on"``)."""
        return self.prefetch == "on"

    def chunk(self, capacity: int) -> int:
        """Rows evicted at least at once in a cache of ``capacity`` rows."""
        if self.evict_chunk is not None:
            return self.evict_chunk
        return max(1, capacity // 16)

    def sketch(self, capacity: int) -> tuple[int, int, int]:
        """``(width, depth, period)`` of the TinyLFU sketch of a cache of ``capacity`` rows."""
        width = self.sketch_width
        if width is None:
            # a power of 2, at least one line of 16 counters (cache/sketch.py)
            width = 1 << max(4, (SKETCH_WIDTH_PER_ROW * max(capacity, 1) - 1).bit_length())
        depth = SKETCH_DEPTH if self.sketch_depth is None else self.sketch_depth
        period = self.sketch_period
        if period is None:
            period = SKETCH_PERIOD_PER_ROW * max(capacity, 1)
        return width, depth, period

    def local_optimizer(self, spec: TableSpec) -> Optimizer | None:
        """The optimizer that steps cached copies of ``spec``'s rows, or None where the
        copies take a plain SGD step of :meth:`lr_for` (``local_step="sgd"``, and plain
        SGD, whose optimizer step is that step)."""
        opt = spec.optimizer
        if self.local_step != "optimizer" or (isinstance(opt, SGD) and opt.momentum == 0):
            return None
        return opt

    def lr_for(self, spec: TableSpec) -> float:
        """The step size of the local SGD step on cached copies of ``spec``'s rows (0
        where the table's optimizer steps them: :meth:`local_optimizer`)."""
        if self.local_optimizer(spec) is not None:
            return 0.0
        if self.local_lr is not None:
            return float(self.local_lr)
        opt = spec.optimizer
        if isinstance(opt, SGD | RowWiseAdagrad | Adagrad | Adam):
            return float(opt.lr)
        return 0.0
