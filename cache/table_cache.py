"""The cache of one table: preallocated slots, each one record of row, pending sum and
metadata.

Layout (``C`` = capacity, ``D`` = dim). The hot state is ONE numpy array of records,
``slab`` float32 ``[C, W]`` (``W`` = 2 D + 16 words rounded up to 64 bytes, records
aligned to cache lines)::

    slab[s, 0:D]        float32   row      the copy served: PS row at CLOCK + local updates
    slab[s, D:2D]       float32   pend     sum of the gradients not pushed yet (0 if COUNT = 0)
    slab[s, 2D:2D+16]   int64 x 8 meta:
        CLOCK    PS clock of the row when the copy was read
        OWN      pushes of the row by this cache since the copy was read
        COUNT    updates in `pend` (pushed when > write bound)
        FREQ     lookups since the row entered the cache (LFU)
        PF       4 * tick + kind of the last prefetch that checked the row for batch `tick`
                 (kind 0 checked, 1 fetched a miss, 2 refreshed; 0: none)
        CHECKED  request number of the last PS answer about the row
        PUSHED   request number of the row's last push
        (spare)  two float32: counted pushes of row-wise Adagrad, the sum of mean(g^2)
                 of `pend`; and a state of one float (row-wise Adagrad's accumulator)
    slab[s, 2D+16:3D+16]  float32  counted pushes of element-wise optimizers (Adagrad,
                                   Adam, FTRL): the sums of g^2 of `pend`
    then S floats          float32  the optimizer's local step (:mod:`cache.local_step`):
                                    the row's optimizer state, as pulled plus the
                                    local updates since (a state of one float with at
                                    most one statistic float: in the spare word, so
                                    a record of row-wise Adagrad at dim 16 is three
                                    lines, the three a push's pass touches)

A table of fp16 or bf16 rows (``spec.narrow``) keeps its row in its type: ``R`` =
ceil(D / 2) words of ``D`` 2-byte values at ``slab[s, 0:R]``, everything after it moved
up by ``D - R`` words (pend at ``R``, meta at ``R + D``). Reads widen exactly; the store's
rows are installed as they are; a row the cache computes (refreshed, or stepped locally)
is rounded stochastically (:mod:`cache.narrow_records`, the same bits in the C kernels).

The statistics exist only where pushes are counted (``CacheConfig.counted_pushes`` and a
store that takes them, :attr:`ps.Store.counted_pushes`): a due row is then pushed with
its update count ``COUNT`` and statistic, so the PS applies that many updates.

plus ``own8`` uint8 ``[C]``, every record's OWN capped at 255 (a dense copy for the
sole writer's asks, :func:`cache.kernels.records.sole_writer_asks`, which read OWN for
every id of a step: one byte a slot stays in the CPU caches), ``row_id`` int64 ``[C]``
(-1: free), the id -> slot map (:mod:`cache.slot_index`: a
plain int32 array for fixed tables), the eviction keys (:mod:`cache.policy`, int64
``[C]``) and a stack of free slots.

With the rows on a device (``TableCache(..., device=...)``) a record holds the metadata
alone (the layout above with a row width ``sd`` of 0: ``W`` = 16) and the rows and
pending sums are tensors on that device (:class:`cache.device_rows.DeviceRows`). Every
decision below reads only metadata, so both layouts run the same plan, the same C
kernels and the same bookkeeping; where a step reads or writes rows, the device layout
does the same with gathers and scatters at the plan's slots.

Why records: a batch's ids hit random slots, so the cost of a step is the memory
traffic of its random record accesses, not the number of calls. Everything about a
slot sits in one record, and the per-row passes of a step (the clocks of a planned pull,
the served rows, the update of a push) are C kernels (:mod:`cache.kernels.records`) that
touch only the words they need, in place; rows that change for other reasons (refreshed,
admitted, marked by a prefetch) are few and written by numpy fancy indexing. Nothing
loops over ids in Python, and nothing scans all ``C`` slots except a victim search
(amortised by evicting in chunks).

A fetch (a serving pull or a prefetch) is planned into ONE conditional pull request
carrying the copy clocks of the cached ids (misses carry ``-1 - bound`` so they
always come back), which the owner (:class:`cache.CachedStore`) sends together with
the other tables' requests of the step, and installed when its reply arrives.
Nothing else may touch the table in between: the owner finishes a table's in-flight
fetch before any other operation on that table. A prefetch planned together with a
serving pull (the next batch's ids riding on this batch's request) leaves out the
serving pull's ids and *reserves* the slots of its cached ids, so the serving pull's
admissions cannot evict them before the prefetch is installed right after it. A serving
pull marks its own cached rows in use when it is planned (their eviction keys, and
``touched``), so no victim search from then on takes them and a prefetch planned after
it does not count them as room.

With TinyLFU (``policy="tinylfu"``) every serving pull also counts its distinct ids in
a frequency sketch (:mod:`cache.sketch`) when it is planned, and a miss is admitted only
if its estimate beats the frequency of the row it would evict (:meth:`TableCache._choose`);
a refused miss is served and pushed through like one that finds no slot, and a prefetch
fetches only the misses it would admit. A fetch carries the estimates of its plan
(``Fetch.est``) to its install: nothing counts in between.

Pushes are not sent by the table either: the rows due (and the sums of evicted rows)
go to :attr:`TableCache.outbox`, which the owner sends with the other tables' as one
batched push.

A cache that writes its copies back (``values``, ``CacheConfig.write_back``: a sole
writer of row-wise Adagrad rows on a store that takes writes) uses the same records
without their pending sums and statistics: a row due, evicted or flushed goes to the
outbox as a write of its row, state and the clock the PS then has (``CLOCK + OWN +
1``), and a serving pull asks only for misses (the copy is never older than the PS's
row). Rows not cached are still pushed, as plain pushes of one update.

Not thread-safe by itself: the owner holds :attr:`TableCache.lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from cache.config import CacheConfig
from cache.device_rows import DeviceRows
from cache.kernels.admit import Records, admit_rows
from cache.kernels.plan_pull import plan_pull
from cache.kernels.records import (
    OWN8_MAX,
    ROW_KINDS,
    Evicted,
    copy_clocks,
    evict_rows,
    install_rows,
    pass_through,
    row_words,
    serve_rows,
    sole_writer_asks,
    update_rows,
)
from cache.kernels.sorted_ids import sorted_difference
from cache.local_step import LocalStep
from cache.memory import record_floats, state_in_spare_word
from cache.narrow_records import exact, rounded, widen
from cache.policy import FREE, EvictionPolicy, key_then_id_order
from cache.sketch import FrequencySketch
from cache.slot_index import DenseSlotIndex, make_slot_index
from cache.stats import CacheStats
from comm import Handle
from ps import PullRequest, PullResult, RowWiseAdagrad, Store, TableSpec
from ps.local.table import coalesce

CLOCK, OWN, COUNT, FREQ, PF, CHECKED, PUSHED = range(7)
_META_WORDS = 16  # 8 int64 fields, as float32 words
_MISS, _REFRESH = 1, 2
_EMPTY_I64 = np.empty(0, dtype=np.int64)
_NO_ROWS = np.empty((0, 0), dtype=np.float32)  # the rows of a record slab of row width 0


class ClockSource(Protocol):
    """What a cache asks of its store besides requests: PS clocks (``exact_staleness``)
    and optimizer state (a loaded checkpoint without it); the store, or a group's router."""

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor: ...

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True, eq=False)
class Fetch:
    """One planned request for a table's rows (a serving pull or a prefetch)."""

    uniq: np.ndarray  # [U] distinct ids, the order results come in
    counts: np.ndarray | None  # [U] occurrences in the request (None: once each)
    inverse: np.ndarray | None  # [N] position in uniq of each requested id (None: N = U)
    slots: np.ndarray  # [U] slot of each id at planning, -1 if not cached
    hit: np.ndarray  # [U] slots >= 0
    misses_only: bool  # a prefetch asking only for misses (a plain pull)
    asked: np.ndarray | None  # [A] indices into uniq sent to the PS (None: all of them)
    request: PullRequest | None  # what to ask the PS (None: nothing)
    seq: int  # request number (orders PS answers against this cache's pushes)
    tick: int  # the batch the rows are for
    prefetch: bool
    done: bool = False
    result: PullResult | None = None  # a serving pull's rows, once installed
    handle: Handle | None = None  # the reply to ``request``, once the owner sent it
    follow: Fetch | None = None  # a prefetch sent with this pull, installed right after it
    # TinyLFU: sketch estimates [U] of ``uniq`` as planned: a serving pull's after its
    # batch was counted; a prefetch's for its misses (0 at its cached ids). Nothing
    # counts between a plan and its install, so the install decides by these.
    est: np.ndarray | None = None
    # A serving pull whose plan pass gave its cached rows their eviction keys with
    # ``est`` already (TinyLFU, a sole writer; not where its count halved the sketch):
    # serving writes only the other rows' keys.
    keyed: bool = False


@dataclass(slots=True, eq=False)
class _Known:
    """Slots of a batch's ids as of index generation ``gen`` (saves a map lookup)."""

    uniq: np.ndarray  # [U]
    slots: np.ndarray  # [U], -1 not cached
    gen: int
    tick: int
    complete: bool  # every id was cached


def _increasing(ids: np.ndarray) -> bool:
    return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())


def _aligned_records(rows: int, words: int) -> np.ndarray:
    """Zeroed float32 ``[rows, words]`` whose rows start on 64-byte boundaries."""
    buf = np.zeros(rows * words + 16, dtype=np.float32)
    start = (-buf.ctypes.data % 64) // 4
    return buf[start : start + rows * words].reshape(rows, words)


#: One push of a table's cache as the owner sends it: ``(ids [P], grads [P, D], counted,
#: write)`` with ``counted`` the ``(counts [P], stats [P, Q])`` of a counted push, or None;
#: ``write`` True for a write of copies (``grads`` the rows, ``counted`` their ``(clocks
#: [P], state [P, S])``).
Pushed = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, bool]

#: A sole writer's asks in value mode: no count of its own writes makes a copy stale.
_NEVER = 1 << 62


@dataclass(slots=True)
class _Due:
    """Rows to push: ``ids`` ``[P]``, ``grads`` ``[P, D]`` (numpy, or a tensor on the rows'
    device) and, where pushes are counted, ``counts`` ``[P]`` and ``stats`` ``[P, Q]``.
    A write of copies (``write``): ``grads`` the rows, ``counts`` their clocks and
    ``stats`` their optimizer state ``[P, S]``."""

    ids: np.ndarray
    grads: Any
    counts: np.ndarray | None = None
    stats: Any = None  # numpy, or a tensor on the rows' device
    write: bool = False

    @staticmethod
    def join(parts: list[_Due], *, on_device: bool = False) -> _Due:
        def cat(xs: list[Any]) -> Any:
            return torch.cat(xs) if on_device else np.concatenate(xs)

        ids = np.concatenate([p.ids for p in parts])
        grads = cat([p.grads for p in parts])
        if parts[0].counts is None:
            return _Due(ids, grads)
        counts = np.concatenate([p.counts for p in parts if p.counts is not None])
        return _Due(ids, grads, counts, cat([p.stats for p in parts]), parts[0].write)

    def sorted(self) -> _Due:
        """The rows in increasing id order (host arrays; the ids are distinct), as every
        store walks a request."""
        if _increasing(self.ids):
            return self
        o = np.argsort(self.ids)
        if self.counts is None:
            return _Due(self.ids[o], self.grads[o], write=self.write)
        return _Due(self.ids[o], self.grads[o], self.counts[o], self.stats[o], self.write)

    def take(self, at: np.ndarray, *, write: bool) -> _Due:
        """The rows at positions ``at`` ``[K]`` (host arrays), as a write or a plain push."""
        ids, grads = self.ids.take(at), self.grads.take(at, axis=0)
        if not write:
            return _Due(ids, grads)
        assert self.counts is not None
        return _Due(ids, grads, self.counts.take(at), self.stats.take(at, axis=0), True)

    def tensors(self, *, on_device: bool) -> Pushed:
        def tensor(x: Any) -> torch.Tensor:
            return x if on_device else torch.from_numpy(x)

        counted = None
        if self.counts is not None:
            counted = (torch.from_numpy(self.counts), tensor(self.stats))
        return torch.from_numpy(self.ids), tensor(self.grads), counted, self.write


class TableCache:
    """Rows of one table cached under ``config``; see the module docstring."""

    def __init__(
        self,
        spec: TableSpec,
        config: CacheConfig,
        store: Store | ClockSource,
        *,
        capacity: int | None = None,
        largest_table: int | None = None,
        device: torch.device | None = None,
        counted: bool = False,
        values: bool = False,
    ) -> None:
        """``counted``: the store takes counted pushes; ``values``: it takes writes of
        rows (see the module docstring)."""
        cap = config.capacity(spec) if capacity is None else capacity
        d = spec.dim
        self.spec, self.name, self.dim = spec, spec.name, d
        # Rows on a device: the records keep only metadata (a row width of 0 in the slab).
        self.write_bound = config.write_bound
        # A sole writer's copies written back (CacheConfig.write_back): rows not cached
        # are still pushed, one update each, as plain pushes.
        self.values = _writes_values(config, spec, values=values, host=device is None)
        counted = counted and not self.values
        # Counted pushes (a write bound, a store that takes them): Q statistic floats per
        # row; with host rows in the record at float `stat_at` (Q = 1: the spare meta
        # word; Q = D: after the metadata), else on the rows' device.
        self.counted = counted and config.counted_pushes and self.write_bound > 0
        self.push_q = spec.optimizer.stat_dim(d) if self.counted else 0
        # The optimizer's local step (None: an SGD step of `lr`): S state floats per row.
        opt = config.local_optimizer(spec)
        self.local = None if opt is None else LocalStep(opt, d)
        self.opt_dim = 0 if self.local is None else self.local.state_dim
        self.with_state = self.opt_dim > 0  # pulls bring the rows' state (PullRequest)
        self.seed = spec.init.seed if spec.init is not None else 0  # rounding's key
        # A narrow table's rows stay in its type: in the host records (kind 1 fp16, 2
        # bf16: `rw` = ceil(D / 2) words), or on the device (the records there hold no
        # row: kind 0).
        row_dtype = spec.torch_dtype if ROW_KINDS[spec.dtype] else torch.float32
        self.data = (
            None
            if device is None
            else DeviceRows(
                cap, d, device, self.push_q, self.opt_dim, dtype=row_dtype, seed=self.seed
            )
        )
        sd = d if self.data is None else 0  # elements of row (and floats of pend) in a record
        self.sd = sd
        self.kind = ROW_KINDS[spec.dtype] if sd else 0
        self.rw = row_words(sd, self.kind)  # floats of the row in a record
        self.meta_at = self.rw + sd  # the metadata's first float in a record
        self.store = store
        self.capacity = cap
        self.read_bound = config.read_bound
        self.lr = config.lr_for(spec)
        self.lfu = config.policy == "lfu"  # FREQ counts lookups in the record
        # TinyLFU: the sketch of recent batches' ids decides admissions (see _choose).
        self.sketch = FrequencySketch(*config.sketch(cap)) if config.policy == "tinylfu" else None
        self.verify_prefetched = config.verify_prefetched
        self.sole_writer = config.sole_writer
        self.exact = config.exact_staleness
        self.chunk = config.chunk(cap)
        q = self.push_q if self.data is None else 0
        self.stat_dim = q
        self.stat_at = self.meta_at + (_META_WORDS - 2 if q == 1 else _META_WORDS)
        # Host records: the optimizer state after the statistics, at float `state_at`.
        self.state_dim = self.opt_dim if self.data is None else 0
        self.state_at = self.meta_at + _META_WORDS + (q if q > 1 else 0)
        if state_in_spare_word(q, self.state_dim):  # the spare word's second float
            self.state_at = self.meta_at + _META_WORDS - 1
        self.width = record_floats(sd, q, self.state_dim, row_words=self.rw)  # W: 64-byte lines
        self.slab = _aligned_records(cap, self.width)  # [C, W]
        self._void = np.dtype((np.void, 4 * self.width))
        self.vslab = self.slab.view(self._void).reshape(cap)  # [C] one item per record
        m = self.meta_at
        self.meta = self.slab[:, m : m + _META_WORDS].view(np.int64)  # [C, 8] view
        self.own8 = np.zeros(cap, dtype=np.uint8)  # [C] min(OWN, OWN8_MAX) of each record
        self.row_id = np.full(cap, -1, dtype=np.int64)  # [C]
        self.free = np.arange(cap - 1, -1, -1, dtype=np.int64)  # stack: free[:n_free], top last
        self.n_free = cap
        self.index = make_slot_index(spec.num_rows, cap, largest_table=largest_table)
        self.policy = EvictionPolicy(cap, config.policy)
        self.stats = CacheStats(dim=d, exact=self.exact)
        self.lock = threading.RLock()
        self.tick = 0  # serving pulls so far; the current batch's tick
        self.seq = 0  # requests and pushes so far
        self.gen = 0  # changes of the id -> slot map so far
        self.touched = 0  # slots given last use >= tick (an upper bound; see _admittable)
        self.prefetched: _Known | None = None  # the last prefetch's ids and slots
        self.served: _Known | None = None  # the last serving pull's ids and slots
        self.inflight: Fetch | None = None
        self.deferred: torch.Tensor | None = None  # next batch's ids for the next pull
        self.reserved: np.ndarray | None = None  # slots a planned prefetch counts as cached
        # Pushes due (gradients numpy, or tensors on the rows' device).
        self.outbox: list[_Due] = []
        self.push_handles: list[Handle] = []
        # Pending sums of evicted rows not sent yet: [K] ids, [K, D] sums, and with counted
        # pushes their [K] counts and [K, Q] statistics. They ride on the next push (the
        # batch's update follows the eviction at once in a training step), saving a
        # request; see :meth:`send_evicted`.
        self.evicted: list[_Due] = []

    # ------------------------------------------------------------ records

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        """Records of ``slots`` ``[K]`` (-1 reads the last slot): float32 ``[K, W]``."""
        return self.vslab.take(slots).view(np.float32).reshape(-1, self.width)

    def _scatter(self, slots: np.ndarray, rec: np.ndarray) -> None:
        """Write records ``rec`` ``[K, W]`` (C-contiguous) to distinct ``slots`` ``[K]``."""
        self.vslab[slots] = rec.view(self._void).reshape(-1)

    def _meta(self, rec: np.ndarray) -> np.ndarray:
        """The int64 ``[K, 8]`` metadata view of records ``rec`` ``[K, W]``."""
        m = self.meta_at
        return rec[:, m : m + _META_WORDS].view(np.int64)

    def _pend(self, rec: np.ndarray) -> np.ndarray:
        """The float32 ``[K, D]`` pending-sum view of records ``rec`` ``[K, W]``."""
        return rec[:, self.rw : self.meta_at]

    def _rec_rows(self, rec: np.ndarray) -> np.ndarray:
        """The rows of records ``rec`` ``[K, W]`` as float32 ``[K, D]`` (a copy; a narrow
        row widened)."""
        if self.kind == 0:
            return rec[:, : self.sd].copy()
        return widen(rec.view(np.uint16)[:, : self.sd], self.kind)

    def _set_rec_rows(
        self, rec: np.ndarray, rows: np.ndarray, ids: np.ndarray | None = None, seq: int = 0
    ) -> None:
        """Write float32 ``rows`` ``[K, D]`` into records ``rec`` ``[K, W]`` (a view or
        copy), as they are (``ids`` None: the store's rows, values of a narrow type
        already), else rounded stochastically for the table's rows ``ids`` ``[K]``
        written by request ``seq`` (:mod:`cache.narrow_records`)."""
        if self.kind == 0:
            rec[:, : self.sd] = rows
        elif ids is None:
            rec.view(np.uint16)[:, : self.sd] = exact(rows, self.kind)
        else:
            bits = rounded(rows, self.kind, seed=self.seed, ids=ids, seq=seq)
            rec.view(np.uint16)[:, : self.sd] = bits

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` ``[K]`` as float32 ``[K, D]`` (a copy)."""
        if self.kind == 0:
            return self.slab[slots, : self.sd]
        return widen(self.slab.view(np.uint16)[slots, : self.sd], self.kind)

    def _set_rows(self, slots: np.ndarray, rows: np.ndarray, seq: int) -> None:
        """The cached rows of ``slots`` ``[K]`` := float32 ``rows`` ``[K, D]`` the cache
        computed (request ``seq``), rounded stochastically for a narrow table."""
        if self.kind == 0:
            self.slab[slots, : self.sd] = rows
            return
        bits = rounded(rows, self.kind, seed=self.seed, ids=self.row_id[slots], seq=seq)
        self.slab.view(np.uint16)[slots, : self.sd] = bits

    def _copy_own(self, slots: np.ndarray) -> None:
        """``own8`` of ``slots`` ``[K]`` := their records' OWN (capped), after numpy
        wrote those records."""
        self.own8[slots] = np.minimum(self.meta[slots, OWN], OWN8_MAX)

    def _slots_of(self, uniq: np.ndarray, known: _Known | None, tick: int | None) -> np.ndarray:
        """Slots of ``uniq``: from ``known`` when it holds the same ids and is current.

        ``known`` is current if the map did not change since, or (with ``tick``: the slots
        of the current batch, which no eviction may take before the next serving pull)
        if it had every id cached, so no admission could have changed them."""
        if (
            known is not None
            and (tick is None or known.tick == tick)
            and (known.gen == self.gen or (tick is not None and known.complete))
            and known.uniq.size == uniq.size
            and np.array_equal(known.uniq, uniq)
        ):
            return known.slots
        return self.index.lookup(uniq)

    # ------------------------------------------------------------ sizes

    @property
    def cached_rows(self) -> int:
        return self.capacity - self.n_free

    @property
    def pending_rows(self) -> int:
        return int(np.count_nonzero(self.meta[:, COUNT]))

    def cached_ids(self) -> torch.Tensor:
        """Ids of the cached rows, sorted: int64 ``[cached_rows]``."""
        return torch.from_numpy(np.sort(self.row_id[self.row_id >= 0]))

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot(
            cached_rows=self.cached_rows, pending_rows=self.pending_rows, capacity=self.capacity
        )

    # ------------------------------------------------------------ state (checkpoints)

    def export_state(self) -> dict[str, torch.Tensor]:
        """The cached rows with everything that decides what the cache serves and evicts
        next, after a flush (nothing pending, nothing in flight; the owner settles):

        * ``ids`` int64 ``[K]``: the cached ids, in eviction-key order (least kept first);
        * ``rows`` float32 ``[K, D]``: their copies (PS row at CLOCK + local updates);
        * ``meta`` int64 ``[K, 8]``: CLOCK, OWN, COUNT, FREQ, PF, CHECKED, PUSHED, spare;
        * ``keys`` int64 ``[K]``: their eviction keys (:mod:`cache.policy`);
        * ``counters`` int64 ``[2]``: the table's ``tick`` and ``seq`` (PF, CHECKED and
          PUSHED are counted in them);
        * with the optimizer's local step, ``opt_state`` float32 ``[K, S]``: the state
          the copies step with.
        """
        if self.inflight is not None or self.evicted or self.pending_rows:
            raise RuntimeError(
                f"cache of table {self.name!r}: export_state needs a flushed cache "
                "(CachedStore.cache_state flushes first)"
            )
        slots = np.flatnonzero(self.row_id >= 0)
        order = np.lexsort((self.row_id[slots], self.policy.key[slots]))
        slots = slots[order]  # [K] least kept first (the victim order)
        rec = self._gather(slots)  # [K, W]
        rows = (
            torch.from_numpy(self._rec_rows(rec)) if self.data is None else self.data.read(slots)
        )  # [K, D]
        out = {
            "ids": torch.from_numpy(self.row_id[slots].copy()),
            "rows": rows,
            "meta": torch.from_numpy(self._meta(rec).copy()),
            "keys": torch.from_numpy(self.policy.key[slots].copy()),
            "counters": torch.tensor([self.tick, self.seq], dtype=torch.int64),
        }
        if self.local is not None:
            if self.data is not None:
                out["opt_state"] = self.data.read_state(slots)
            else:
                sa = self.state_at
                out["opt_state"] = torch.from_numpy(rec[:, sa : sa + self.state_dim].copy())
        if self.sketch is not None:  # TinyLFU: the frequencies it admits by
            sk = self.sketch.state()
            out["sketch_counters"], out["sketch_added"] = sk["counters"], sk["added"]
        return out

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Fill this empty cache from :meth:`export_state` (same dim; at most
        ``capacity`` rows are kept, the most kept ones by eviction key). The cache then
        serves and evicts exactly as the exporting one would have."""
        if self.cached_rows or self.tick or self.seq:
            raise RuntimeError(f"cache of table {self.name!r}: import_state needs a new cache")
        ids, rows, meta, keys = (state[k] for k in ("ids", "rows", "meta", "keys"))
        k = int(ids.numel())
        if rows.shape != (k, self.dim) or meta.shape != (k, 8) or keys.shape != (k,):
            raise ValueError(
                f"cache of table {self.name!r}: saved cache of {k} rows has rows "
                f"{tuple(rows.shape)}, meta {tuple(meta.shape)}, keys {tuple(keys.shape)}; "
                f"expected ({k}, {self.dim}), ({k}, 8), ({k},)"
            )
        keep = slice(max(0, k - self.capacity), k)  # the last ones are the most kept
        ids_np = ids[keep].numpy().astype(np.int64)
        if ids_np.size:
            check = torch.from_numpy(ids_np)
            if self.spec.num_rows is not None and (
                int(check.min()) < 0 or int(check.max()) >= self.spec.num_rows
            ):
                raise ValueError(
                    f"cache of table {self.name!r}: saved ids outside [0, {self.spec.num_rows})"
                )
        # [K'] (the cache is empty: no eviction)
        slots = self._admit(ids_np, self._victims_for(ids_np.size, None), pooled=False)
        rec = np.zeros((slots.size, self.width), dtype=np.float32)
        sd = self.sd
        # saved copies of a narrow table are its values widened: written back exactly
        self._set_rec_rows(rec, rows[keep].to(torch.float32).numpy()[:, :sd])
        self._meta(rec)[:] = meta[keep].numpy()
        self._meta(rec)[:, COUNT] = 0  # a saved cache was flushed: nothing pending
        self._pend(rec)[:] = 0.0
        self._scatter(slots, rec)
        self._copy_own(slots)
        opt_state = self._saved_state(state.get("opt_state"), keep, ids_np)
        if self.state_dim and opt_state is not None:
            self.slab[slots, self.state_at : self.state_at + self.state_dim] = opt_state.numpy()
        if self.data is not None:
            (at,) = self.data.indices(slots)
            self.data.write(at, rows[keep].to(torch.float32), opt_state)
        self.policy.key[slots] = keys[keep].numpy()
        self.tick, self.seq = (int(v) for v in state["counters"].tolist())
        if self.sketch is not None and "sketch_counters" in state:
            self.sketch.load({"counters": state["sketch_counters"], "added": state["sketch_added"]})
        self.touched = slots.size  # an upper bound of the slots in use (see _admittable)

    def _saved_state(
        self, saved: torch.Tensor | None, keep: slice, ids: np.ndarray
    ) -> torch.Tensor | None:
        """The optimizer state ``[K', S]`` of the loaded copies of ``ids`` ``[K']``: as
        saved, or read from the store where the saved cache has none (it stepped its
        copies by SGD, or had another optimizer); None without the optimizer's step."""
        if self.local is None:
            return None
        if saved is not None and saved.dim() == 2 and saved.shape[1] == self.opt_dim:
            return saved[keep].to(torch.float32).contiguous()
        if ids.size == 0 or self.opt_dim == 0:
            return torch.zeros(ids.size, self.opt_dim, dtype=torch.float32)
        return self.store.state(self.name, torch.from_numpy(ids))

    # ------------------------------------------------------------ fetch

    def plan(
        self, ids: torch.Tensor, *, prefetch: bool, exclude: np.ndarray | None = None
    ) -> Fetch:
        """Plan the PS request for ``ids`` int64 ``[N]`` (a pull or a prefetch); the
        owner sends ``Fetch.request`` and sets ``Fetch.handle``.

        ``exclude`` (a prefetch planned with a serving pull: that pull's distinct ids,
        sorted) leaves those ids out and reserves the slots of the prefetch's cached
        ids until it is installed (see the module docstring).

        A serving pull asks for every id (cached ones with their copy clocks; see the
        module docstring). A prefetch with ``verify_prefetched`` asks only for the misses
        that free or evictable slots can take, with a plain pull (the serving pull checks
        every cached row anyway); without it, it also checks the cached rows, and the
        serving pull trusts that check. A sole writer's serving pull
        (``CacheConfig.sole_writer``) asks only about the misses and the cached rows
        pushed more than ``s_r`` times since their read; its prefetch asks only for
        misses.
        """
        counts = inverse = None
        uniq = ids.numpy()
        if not _increasing(uniq):
            u, inv, cnt = torch.unique(ids, return_inverse=True, return_counts=True)
            uniq, inverse, counts = u.numpy(), inv.numpy(), cnt.numpy()
        if exclude is not None and exclude.size and uniq.size:
            rest = sorted_difference(uniq, exclude)  # [U'] not in the serving pull
            if rest is None:
                at = np.minimum(np.searchsorted(exclude, uniq), exclude.size - 1)
                rest = uniq[exclude[at] != uniq]
            uniq = rest
            counts = inverse = None  # a prefetch returns no rows
        self.seq += 1
        # A sole writer's serving pull: its slots and asks (and the sketch's count) in one
        # pass where the kernel runs (None: the passes below). With TinyLFU that pass
        # also gives the cached rows their keys with their estimates, unless the count
        # halves the sketch (the keys are halved then, the estimates after it).
        fused, keyed = None, False
        if not prefetch and self.sole_writer:
            keyed = self.sketch is not None and not self.sketch.halves_after(uniq.size)
            fused = self._plan_pass(uniq, keyed)
            keyed = keyed and fused is not None
        est = None
        if self.sketch is not None and not prefetch:
            # A batch counts once, when its serving pull is planned: the prefetch planned
            # with it and both installs then see the same counts (docs/cache_admission.md).
            if fused is None:
                est, halved = self.sketch.count(uniq)  # [U]
            else:  # counted and then estimated by the pass, as count() does
                halved = self.sketch.counted(uniq.size)
                est = fused[3]
                assert est is not None
                if halved:  # estimates after the halving: min(c >> 1) == min(c) >> 1
                    est >>= 1
            if halved:
                self.policy.halve()
                self.stats.add("sketch_halvings", 1)
        if prefetch:
            tick = self.tick + 1  # for the next batch
            slots = self.index.lookup(uniq)  # [U], -1: not cached
        else:
            self.tick += 1
            tick = self.tick
            slots = self._slots_of(uniq, self.prefetched, None) if fused is None else fused[0]
        hit = slots >= 0
        if not prefetch:
            # This batch's cached rows are in use from now: no victim search (of this
            # batch's misses, or of a prefetch planned after it) takes them, and a
            # prefetch planned after it counts them in use (touched). LFU and TinyLFU
            # keys get their frequency when the rows are served.
            if fused is None:  # (the pass marked them)
                self.policy.use(slots[hit], None, tick)
            self.touched = int(np.count_nonzero(hit))
        if exclude is not None:
            self.reserved = slots[hit]
        fill = -1 - self.read_bound  # misses always come back
        if not prefetch and self.sole_writer:
            asks = None if fused is None else fused[1:3]
            return self._plan_sole_writer(
                uniq, counts, inverse, slots, hit, tick, fill, est, asks, keyed
            )  # fmt: skip
        if prefetch and (self.verify_prefetched or self.sole_writer):
            # (a sole writer's serving pull asks about its cached rows only when needed)
            asked, est = self._admittable(uniq, hit, slots, misses_only=True)
            assert asked is not None
            request = None
            if asked.size > 0:
                request = PullRequest(
                    self.name, torch.from_numpy(uniq.take(asked)), with_state=self.with_state
                )
            return Fetch(
                uniq, counts, inverse, slots, hit, True, asked, request, self.seq, tick, True,
                est=est,
            )  # fmt: skip
        asked = None
        if not prefetch and not self.verify_prefetched:
            # Trust what this batch's prefetch checked, unless this cache pushed it since.
            meta = self.meta[slots]  # [U, 8] (garbage where not cached)
            ok = hit & (meta[:, PF] >> 2 == tick) & (meta[:, PUSHED] < meta[:, CHECKED])
            if ok.any():
                asked = np.flatnonzero(~ok)  # [A]
        if prefetch:
            asked, est = self._admittable(uniq, hit, slots, misses_only=False)
        copy_clock = copy_clocks(self.slab, self.sd, slots, fill, kind=self.kind)  # [U]
        if copy_clock is None:
            copy_clock = np.where(hit, self.meta[slots, CLOCK], fill)
        ask_ids, ask_clock = uniq, copy_clock
        if asked is not None:
            ask_ids, ask_clock = uniq.take(asked), copy_clock.take(asked)
        request = None
        if ask_ids.size > 0:
            request = PullRequest(
                self.name,
                torch.from_numpy(ask_ids),
                clocks=torch.from_numpy(ask_clock),
                bound=self.read_bound,
                with_state=self.with_state,
            )
        return Fetch(
            uniq, counts, inverse, slots, hit, False, asked, request, self.seq, tick, prefetch,
            est=est,
        )  # fmt: skip

    def _plan_sole_writer(
        self,
        uniq: np.ndarray,
        counts: np.ndarray | None,
        inverse: np.ndarray | None,
        slots: np.ndarray,
        hit: np.ndarray,
        tick: int,
        fill: int,
        est: np.ndarray | None,
        asks: tuple[np.ndarray, np.ndarray] | None,
        keyed: bool,
    ) -> Fetch:
        """A serving pull of the tables' only writer: ask about the misses and the rows
        pushed more than ``s_r`` times since their read (``PS clock = CLOCK + OWN``
        exactly), nothing about the rest. ``asks``: ``(asked, clocks)`` found by
        :meth:`_plan_pass` already; ``keyed``: it gave the hits their keys too."""
        found = asks
        # Written back, a copy is the newest value of its row: only misses are asked for.
        bound = _NEVER if self.values else self.read_bound
        if found is None:
            found = sole_writer_asks(
                self.slab, self.sd, slots, self.own8, bound, fill, kind=self.kind
            )
        if found is None:
            meta = self.meta[slots]  # [U, 8] (garbage where not cached)
            asked = np.flatnonzero(~hit | (meta[:, OWN] > bound))  # [A]
            clock = np.where(hit, meta[:, CLOCK], fill).take(asked)  # [A]
        else:
            asked, clock = found
        request = None
        if asked.size > 0:
            request = PullRequest(
                self.name,
                torch.from_numpy(uniq.take(asked)),
                clocks=torch.from_numpy(clock),
                bound=self.read_bound,
                with_state=self.with_state,
            )
        return Fetch(
            uniq, counts, inverse, slots, hit, False, asked, request, self.seq, tick, False,
            est=est, keyed=keyed,
        )  # fmt: skip

    def _plan_pass(
        self, uniq: np.ndarray, keyed: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
        """A sole writer's serving pull of the distinct ``uniq`` ``[U]`` planned in one C
        pass (:mod:`cache.kernels.plan_pull`): ``(slots [U], asked [A], clocks [A], est
        [U])`` as the map lookup and :func:`cache.kernels.records.sole_writer_asks` give
        them, with every id counted in the sketch and then estimated (``est``, before a
        halving the count brings; None without a sketch) and every cached row's eviction
        key marked used at the coming tick (``keyed``: with its estimate, as serving it
        writes the key). None (nothing counted or written) where the pass does not run: no
        dense id map, or no kernel."""
        if not isinstance(self.index, DenseSlotIndex):
            return None
        return plan_pull(
            uniq, self.index.map, None if self.sketch is None else self.sketch.kernel_view(),
            self.slab, self.meta_at, self.own8, own8_max=OWN8_MAX, clock_word=CLOCK,
            own_word=OWN, bound=_NEVER if self.values else self.read_bound,
            fill=-1 - self.read_bound,
            keys=self.policy.key, tick=self.tick + 1, keys_with_estimates=keyed,
        )  # fmt: skip

    def _admittable(
        self, uniq: np.ndarray, hit: np.ndarray, slots: np.ndarray, *, misses_only: bool
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(asked, est)``: indices into the prefetch's ids worth asking for, the cached
        ids (unless ``misses_only``) and only as many misses (the first ones) as free or
        evictable slots can take (None: all of them); TinyLFU's estimates of the ids
        ``[U]`` (its misses'; None for the other policies)."""
        if self.sketch is not None:
            return self._admittable_tinylfu(uniq, hit, slots, misses_only=misses_only)
        n_hit = int(np.count_nonzero(hit))
        misses = hit.size - n_hit
        room = misses
        if misses > self.n_free and misses > self.capacity - self.touched - n_hit:
            # At most `touched` slots are used by the current batch (its hits from its
            # plan on, then its admissions, or prefetched), and `n_hit` are wanted by the
            # next one; other cached rows are evictable. Only when that bound does not
            # settle it, count exactly (O(capacity)).
            evictable = self.policy.evictable(self.tick)  # free slots are not
            evictable[slots[hit]] = False
            room = min(misses, self.n_free + int(np.count_nonzero(evictable)))
        if misses_only:
            return np.flatnonzero(~hit)[:room], None
        if room == misses:
            return None, None
        keep = hit.copy()
        keep[np.flatnonzero(~hit)[:room]] = True
        return np.flatnonzero(keep), None

    def _admittable_tinylfu(
        self, uniq: np.ndarray, hit: np.ndarray, slots: np.ndarray, *, misses_only: bool
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """:meth:`_admittable` for TinyLFU: the misses that win admission now (their
        estimate + 1, the count they get when served, against the victims they would
        evict), so a prefetch fetches no row it would not keep."""
        miss = np.flatnonzero(~hit)  # [K] indices into the prefetch's ids
        assert self.sketch is not None
        ids = uniq.take(miss)
        miss_est = self.sketch.estimate(ids)  # [K]
        est = np.zeros(uniq.size, dtype=np.int64)  # [U]
        est[miss] = miss_est
        # The victims spare the prefetch's own cached rows; the serving pull planned
        # before it marked its rows in use (their keys) at its plan.
        protect = slots[hit]  # [H]
        order, n, _ = self._choose(ids, miss_est + 1, protect)
        chosen = np.sort(miss.take(order[:n]))  # [n] in id order
        if misses_only:
            return chosen, est
        if n == miss.size:
            return None, est
        keep = hit.copy()
        keep[chosen] = True
        return np.flatnonzero(keep), est

    def _choose(
        self, ids: np.ndarray, scores: np.ndarray, protect: np.ndarray | None
    ) -> tuple[np.ndarray, int, np.ndarray]:
        """TinyLFU's admission of the missed ``ids`` ``[K]`` with sketch estimates
        ``scores`` ``[K]``: ``(order, n, victims)``.

        Candidates go highest estimate first (ties: smaller id). The first ones take
        the free slots; each next one is admitted only if its estimate beats the
        frequency of the next victim in eviction order (lowest first), so the
        admitted are a prefix: ``order[:n]`` (indices into ``ids``), evicting
        ``victims`` (slots, in order; their frequency is the high half of the key).
        Victims exclude ``protect``, the reserved slots and rows of the current batch.
        """
        k = ids.size
        order = key_then_id_order(-scores, ids)  # [K] highest score first, ties: smaller id
        free = min(k, self.n_free)
        if self.reserved is not None and self.reserved.size:
            protect = self.reserved if protect is None else np.concatenate([protect, self.reserved])
        victims = self.policy.ordered_victims(
            k - free, self.tick, protect, self.row_id, self.chunk
        )  # [M] lowest key first
        beats = scores.take(order[free : free + victims.size]) > self.policy.taken_frequency()
        n_beat = victims.size if beats.all() else int(np.argmin(beats))  # a True prefix
        return order, free + n_beat, victims[:n_beat]

    def _finish_misses(self, f: Fetch) -> None:
        """Install a prefetch that asked only for misses (``f.asked``, a plain pull)."""
        assert f.asked is not None
        uniq, slots, asked = f.uniq, f.slots, f.asked
        final = slots
        if f.handle is not None:
            res: PullResult = f.handle.wait()
            fresh, fresh_clock = self._fresh(res.rows), res.clocks.numpy()  # [A, D], [A]
            self.stats.pulled(asked.size, asked.size, 0)
            ids = uniq.take(asked)  # [A]
            fresh_state = self._pulled_state(ids, res.state)  # [A, S] or None
            take = np.arange(asked.size)  # [A] rows of the reply to install, in order
            freq = np.zeros(asked.size, np.int64) if self.lfu else None
            if f.est is not None:  # decide again: the serving pull took victims since
                freq = f.est.take(asked) + 1
                order, n_ok, victims = self._choose(ids, freq, slots[f.hit])
                take = order[:n_ok]
                self.stats.add("prefetch_rejected", asked.size - n_ok)
                ids = ids.take(take)
            else:
                victims = None
            new_slots = self._admit_rows(  # [n]
                ids, slots[f.hit], victims, fresh, take, fresh_clock, f.seq, fresh_state,
                pf=f.tick * 4 + _MISS,
            )  # fmt: skip
            n = new_slots.size
            if n > 0:
                sel = take[:n]
                self.policy.use(new_slots, None if freq is None else freq.take(sel), f.tick)
                self.touched += n
                final = slots.copy()
                final[asked.take(sel)] = new_slots
        self.prefetched = _Known(uniq, final, self.gen, f.tick, False)

    def finish(self, f: Fetch) -> PullResult | None:
        """Install the reply of ``f`` (and then of the prefetch that rode on it); a
        serving pull returns the rows in request order."""
        result = self._finish_one(f)
        follow = f.follow
        if follow is not None and not follow.done:
            self._finish_one(follow)
            # The prefetch left out this pull's ids (``plan``'s exclude) and evicts only
            # rows not used at this tick, so the slots this pull served still hold: the
            # push of the batch reuses them without a lookup (see _slots_of).
            if self.served is not None and self.served.tick == f.tick:
                self.served.gen = self.gen
        return result

    def _finish_one(self, f: Fetch) -> PullResult | None:
        """Install the reply of ``f``; a serving pull returns the rows in request order.

        Records are read and written in place (nothing else touched the table since
        the plan): refreshed rows, admitted misses and prefetch marks by numpy fancy
        indexing on the few rows concerned; the pass over every served row by
        :func:`cache.kernels.records.serve_rows` (or :meth:`_serve_numpy`)."""
        if f.done:
            return f.result
        f.done = True
        if self.inflight is f:
            self.inflight = None
        if f.prefetch:
            self.reserved = None  # installed now: its slots are protected below
        if f.misses_only:
            self._finish_misses(f)
            return None
        d = self.dim
        uniq, slots, hit = f.uniq, f.slots, f.hit
        est = None if f.prefetch else f.est  # TinyLFU: the served ids' estimates [U]
        if f.handle is not None:
            res: PullResult = f.handle.wait()
            assert res.positions is not None
            pos = res.positions.numpy()
            got = pos if f.asked is None else f.asked.take(pos)  # [M] indices into uniq
            fresh, fresh_clock = self._fresh(res.rows), res.clocks.numpy()  # [M, D], [M]
            fresh_state = self._pulled_state(uniq.take(got), res.state)  # [M, S] or None
        else:
            got = _EMPTY_I64
            fresh = self._fresh(torch.empty(0, d, dtype=torch.float32))
            fresh_clock = _EMPTY_I64
            fresh_state = self._pulled_state(_EMPTY_I64)
        got_hit = hit.take(got)  # [M]
        ref_sel = np.flatnonzero(got_hit)  # [R] indices into got
        miss_sel = np.flatnonzero(~got_hit)  # [K] indices into got
        ref_u, miss_u = got.take(ref_sel), got.take(miss_sel)  # indices into uniq
        asked_hit = hit if f.asked is None else np.zeros_like(hit)
        if f.asked is not None:
            asked_hit[f.asked] = hit.take(f.asked)
        if f.handle is not None:
            n_asked = uniq.size if f.asked is None else f.asked.size
            saved = int(np.count_nonzero(asked_hit)) - ref_sel.size
            self.stats.pulled(n_asked, got.size, saved)
        if not self.verify_prefetched and f.handle is not None:  # cached rows the PS answered
            self.meta[slots[asked_hit], CHECKED] = f.seq

        # Cached rows past the bound: copy := PS row minus the unpushed local delta.
        # With the optimizer's local step: the PS row and state advanced by the pending
        # updates as the PS will apply them (cache.local_step).
        ref_slots = slots.take(ref_u)  # [R]
        if ref_u.size > 0:
            if self.local is not None:
                self._refresh_ahead(ref_slots, fresh, ref_sel, fresh_state, f.seq)
            elif self.data is None:
                rows = fresh.take(ref_sel, axis=0)  # [R, D]
                if self.lr != 0.0:  # pend is zero for rows without pending updates: exact
                    rows -= self.lr * self.slab[ref_slots, self.rw : self.meta_at]
                self._set_rows(ref_slots, rows, f.seq)  # a narrow row: rounded
            else:  # a narrow row rounded: keyed by its id
                (at, sel), keys = self.data.keyed(self.row_id.take(ref_slots), ref_slots, ref_sel)
                self.data.refresh(at, fresh, sel, self.lr, keys, f.seq)
            self.meta[ref_slots, CLOCK] = fresh_clock.take(ref_sel)
            self.meta[ref_slots, OWN] = 0
            self.own8[ref_slots] = 0

        # Misses: admit into free (or freed) slots; those that do not fit pass through.
        protect = slots[hit] if f.prefetch else None
        adm_freq = None  # TinyLFU: the admitted rows' frequencies (their key)
        if self.sketch is not None and miss_u.size > 0:
            ids = uniq.take(miss_u)
            assert f.est is not None
            score = f.est.take(miss_u) + (1 if f.prefetch else 0)
            order, n_ok, victims = self._choose(ids, score, protect)
            miss_u, miss_sel = miss_u.take(order), miss_sel.take(order)  # admitted first
            adm_freq = score.take(order[:n_ok])
            self.stats.add("rejected", miss_u.size - n_ok)
            ids = ids.take(order[:n_ok])
        else:
            ids, victims = uniq.take(miss_u), None
        new_slots = self._admit_rows(
            ids, protect, victims, fresh, miss_sel, fresh_clock, f.seq, fresh_state
        )  # [n_adm]
        n_adm = new_slots.size
        adm_u = miss_u[:n_adm]
        final = slots.copy()
        if n_adm > 0:
            final[adm_u] = new_slots
            self.touched += n_adm

        if f.prefetch:
            marks = f.tick * 4
            if not self.verify_prefetched:  # checked rows are trusted by the next pull
                self.meta[slots[asked_hit], PF] = marks
            self.meta[new_slots, PF] = marks + _MISS
            self.meta[ref_slots, PF] = marks + _REFRESH
            zeros = np.zeros(n_adm, np.int64) if self.lfu else None  # FREQ of new rows
            self.policy.use(new_slots, zeros if adm_freq is None else adm_freq, f.tick)
            self.prefetched = _Known(uniq, final, self.gen, f.tick, False)
            return None

        # Served: every cached row of the batch counts one use per occurrence.
        old = hit.copy()  # cached rows served without moving now
        old[ref_u] = False
        # LFU and TinyLFU: the pass also writes every served row's eviction key (its use
        # count or estimate at this tick), as EvictionPolicy.use would after it.
        keyed = self.lfu or est is not None
        served = serve_rows(
            self.slab, self.sd, final, old, f.counts, lfu=self.lfu, tick=f.tick, kind=self.kind,
            keys=self.policy.key if keyed else None, key_freq=est, old_keyed=f.keyed,
        )  # fmt: skip
        keys_written = keyed and served is not None
        if served is None:
            served = self._serve_numpy(final, old, f.counts, f.tick)
        out, out_clock, lag, freq, n_pf_miss, n_pf_ref = served
        if not keys_written:
            cached = final >= 0
            if self.lfu:
                self.policy.use(final[cached], freq[cached], f.tick)
            elif est is not None:
                self.policy.use(final[cached], est[cached], f.tick)
        if not keyed and n_adm > 0:
            self.policy.use(new_slots, None, f.tick)
        self._count_served(f, ref_u.size, miss_sel.size, old, lag, n_pf_miss, n_pf_ref)
        through_u = miss_u[n_adm:]  # [T] indices into uniq of the ids passed through
        through = miss_sel[n_adm:]  # [T] their rows in the reply
        self.served = _Known(uniq, final, self.gen, f.tick, through_u.size == 0)
        rows_through = False  # the passed-through rows written into out
        if through_u.size > 0:
            self.stats.add("pass_through", through.size)
            if self.data is None:
                rows_through = pass_through(out, out_clock, through_u, fresh, through, fresh_clock)
            if not rows_through:
                out_clock[through_u] = fresh_clock.take(through)
        if f.inverse is not None:
            out_clock = out_clock.take(f.inverse)
        if self.data is None:
            if through_u.size > 0 and not rows_through:
                out[through_u] = fresh.take(through, axis=0)
            if f.inverse is not None:
                out = out.take(f.inverse, axis=0)
            rows_out = torch.from_numpy(out)  # [N, D]
        else:
            inverse = () if f.inverse is None else (f.inverse,)
            idx = self.data.indices(final, through_u, through, *inverse)
            rows_out = self.data.serve(idx[0], idx[1], fresh, idx[2], idx[3] if inverse else None)
        f.result = PullResult(rows_out, torch.from_numpy(out_clock), None)
        return f.result

    def _fresh(self, rows: torch.Tensor) -> Any:
        """The rows a store returned ``[M, D]``: a numpy view for the slab, or on the
        cache's device in one copy."""
        return rows.numpy() if self.data is None else self.data.upload(rows)

    def _pulled_state(
        self, ids: np.ndarray, pulled: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """With the optimizer's local step, the PS's optimizer state of ``ids`` ``[M]``
        (rows a pull just returned): float32 ``[M, S]`` (on the rows' device), else
        None. ``pulled``: the state the pull brought (``PullRequest.with_state``); a
        store that did not bring it is asked now, which matches the rows too (the owner
        sent nothing of this table since the pull, and the store applies this worker's
        requests in order)."""
        if self.local is None:
            return None
        if pulled is not None:
            state = pulled
        elif ids.size == 0 or self.opt_dim == 0:
            state = torch.zeros(ids.size, self.opt_dim, dtype=torch.float32)
        else:
            state = self.store.state(self.name, torch.from_numpy(ids))
        return state if self.data is None else self.data.upload(state)

    def _refresh_ahead(
        self, slots: np.ndarray, fresh: Any, sel: np.ndarray, fresh_state: Any, seq: int
    ) -> None:
        """Cached ``slots`` ``[R]`` past the bound, with the optimizer's local step: the
        PS rows ``fresh[sel]`` and their state ``fresh_state[sel]`` advanced by each
        row's pending updates as the PS will apply them (:meth:`LocalStep.ahead`) by
        request ``seq``."""
        assert self.local is not None
        counts = torch.from_numpy(self.meta[slots, COUNT].copy())  # [R]
        if self.data is not None:
            (at, at_sel), keys = self.data.keyed(self.row_id.take(slots), slots, sel)
            self.data.refresh_ahead(at, fresh, at_sel, fresh_state, counts, self.local,
                                    counted=self.counted, ids=keys, seq=seq)  # fmt: skip
            return
        d, sa, sn = self.dim, self.state_at, self.state_dim
        rows = torch.from_numpy(fresh.take(sel, axis=0))  # [R, D]
        state = fresh_state.index_select(0, torch.from_numpy(sel))  # [R, S]
        pend = torch.from_numpy(self.slab[slots, self.rw : self.rw + d])  # [R, D]
        stats = None
        if self.counted:
            stats = torch.from_numpy(self.slab[slots, self.stat_at : self.stat_at + self.stat_dim])
        self.local.ahead(rows, state, pend, counts, stats)
        self._set_rows(slots, rows.numpy(), seq)
        self.slab[slots, sa : sa + sn] = state.numpy()

    def _install(
        self,
        slots: np.ndarray,
        fresh: Any,
        sel: np.ndarray,
        clocks: np.ndarray,
        seq: int,
        fresh_state: Any = None,
        pf: int = 0,
    ) -> None:
        """Fresh records in ``slots`` ``[n]``: PS rows ``fresh[sel]`` (``fresh`` from
        :meth:`_fresh`, ``[M, D]``) read at ``clocks`` ``[n]`` by request ``seq``, nothing
        pending, no uses yet, prefetch mark ``pf``; with the optimizer's local step their
        state ``fresh_state[sel]`` (``[M, S]``, from :meth:`_pulled_state`)."""
        n = slots.size
        if self.data is not None:
            at, at_sel = self.data.indices(slots, sel)
            self.data.install(at, fresh, at_sel, fresh_state)
        host_rows = fresh if self.data is None else _NO_ROWS
        sel, clocks = sel.astype(np.int64, copy=False), clocks.astype(np.int64, copy=False)
        if not install_rows(
            self.slab, self.sd, slots, host_rows, sel, clocks, seq=seq, pf=pf, kind=self.kind
        ):
            rec = np.zeros((n, self.width), dtype=np.float32)  # [n, W]
            if self.data is None:
                self._set_rec_rows(rec, fresh.take(sel, axis=0))
            meta = self._meta(rec)
            meta[:, CLOCK] = clocks
            meta[:, CHECKED] = seq
            meta[:, PF] = pf
            self._scatter(slots, rec)
        self.own8[slots] = 0
        if self.state_dim and fresh_state is not None:
            sa = self.state_at
            self.slab[slots, sa : sa + self.state_dim] = fresh_state.numpy().take(sel, axis=0)

    def _serve_numpy(
        self, final: np.ndarray, old: np.ndarray, uses: np.ndarray | None, tick: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
        """:func:`cache.kernels.records.serve_rows` on numpy (no C compiler)."""
        u, d = final.size, self.sd
        cached = final >= 0
        cs = final[cached]  # [S]
        out = np.zeros((u, d), dtype=np.float32)
        out[cached] = self._rows(cs)
        out_clock = np.zeros(u, dtype=np.int64)
        out_clock[cached] = self.meta[cs, CLOCK]
        lag = np.zeros(u, dtype=np.int64)
        olds = final[old]  # [H]
        pf = self.meta[olds, PF]
        kind = pf & 3
        mine = kind[(kind > 0) & (pf >> 2 == tick)]
        n_pf_miss = int(np.count_nonzero(mine == _MISS))
        self.meta[olds[kind > 0], PF] = 0
        lag[old] = self.meta[olds, OWN]
        freq = np.zeros(u, dtype=np.int64)
        if self.lfu:
            self.meta[cs, FREQ] += 1 if uses is None else uses[cached]
            freq[cached] = self.meta[cs, FREQ]
        return out, out_clock, lag, freq, n_pf_miss, mine.size - n_pf_miss

    def _count_served(
        self,
        f: Fetch,
        n_ref: int,
        n_miss: int,
        old: np.ndarray,
        lag: np.ndarray,
        n_pf_miss: int,
        n_pf_ref: int,
    ) -> None:
        """Hits, misses, refreshes (now, ``n_ref``/``n_miss``, or by this batch's
        prefetch, ``n_pf_*``) and the staleness served (``lag`` ``[U]``: own pushes
        since the read at the hits ``old``, a lower bound, 0 elsewhere; exact PS
        clocks with ``exact_staleness``)."""
        st = self.stats
        n_old = int(np.count_nonzero(old))
        n_pf = n_pf_miss + n_pf_ref
        st.add("lookups", f.uniq.size)
        st.add("refreshes", n_ref + n_pf_ref)
        st.add("misses", n_miss + n_pf_miss)
        st.add("prefetched", n_pf)
        st.add("hits", n_old - n_pf)
        if self.values:  # a written-back copy is never behind the PS's row
            st.served(f.uniq.size, lag[:0])
        elif self.exact and n_old > 0:
            now = self.store.clocks(self.name, torch.from_numpy(f.uniq[old])).numpy()
            st.served(f.uniq.size - n_old, now - self.meta[f.slots[old], CLOCK])
        else:  # lag is 0 where not old: the fresh rows' count at staleness 0
            st.served(0, lag)

    def _admit(self, ids: np.ndarray, victims: np.ndarray, *, pooled: bool) -> np.ndarray:
        """Slots for the first of the new ids ``[K]`` that fit, after evicting ``victims``
        (:meth:`_victims_for`'s, or TinyLFU's from :meth:`_choose`: ``pooled``, taken from
        the policy's pool of victims)."""
        if ids.size == 0:
            return _EMPTY_I64
        self._evict(victims)
        if pooled:
            self.policy.consumed(victims)
        n = min(ids.size, self.n_free)
        top = self.n_free
        slots = self.free[top - n : top][::-1].copy()
        self.n_free = top - n
        if n > 0:
            self.index.insert(ids[:n], slots)
            self.row_id[slots] = ids[:n]
            self.gen += 1
        return slots

    def _victims_for(self, k: int, protect: np.ndarray | None) -> np.ndarray:
        """The slots to evict (LRU, LFU: a chunk, by :meth:`EvictionPolicy.victims`) so
        that ``k`` new rows fit, sparing ``protect``, the reserved slots and rows of the
        current batch; none where the free slots suffice."""
        need = k - self.n_free
        if need <= 0 or self.capacity == 0:
            return _EMPTY_I64
        if self.reserved is not None and self.reserved.size:
            protect = self.reserved if protect is None else np.concatenate([protect, self.reserved])
        return self.policy.victims(max(need, self.chunk), self.tick, protect, self.row_id)

    def _admit_rows(
        self,
        ids: np.ndarray,
        protect: np.ndarray | None,
        victims: np.ndarray | None,
        fresh: Any,
        sel: np.ndarray,
        fresh_clock: np.ndarray,
        seq: int,
        fresh_state: Any,
        pf: int = 0,
    ) -> np.ndarray:
        """:meth:`_admit` of the new ids ``[K]`` and :meth:`_install` of the ``n`` that
        fit: their slots ``[n]``. Candidate ``i``'s row is ``fresh[sel[i]]`` (``sel``
        ``[K]``) of the store's reply, read at ``fresh_clock[sel[i]]`` (``[M]``), with its
        state ``fresh_state[sel[i]]``. One C pass (:func:`cache.kernels.admit.admit_rows`)
        for records on the host under a dense id map, else the steps one by one."""
        if ids.size == 0:
            return _EMPTY_I64
        # Never evicted: ``protect`` and rows used by the current batch (or prefetched
        # for the next one), whose gradients are still to come.
        pooled = victims is not None  # TinyLFU's, from _choose; the others' found now
        evict = victims if victims is not None else self._victims_for(ids.size, protect)
        got, clocks = None, None
        if self.data is None and isinstance(self.index, DenseSlotIndex):
            if self.values and evict.size:
                clocks = self._write_clocks(evict)
            state = None if fresh_state is None else fresh_state.numpy()
            got = admit_rows(
                self._records(), self.n_free, evict, ids, fresh, sel, fresh_clock, state,
                seq=seq, pf=pf,
            )  # fmt: skip
        if got is None:  # the steps one by one
            new_slots = self._admit(ids, evict, pooled=pooled)
            sel = sel[: new_slots.size]  # [n] the admitted rows' rows in the reply
            if sel.size > 0:
                self._install(new_slots, fresh, sel, fresh_clock.take(sel), seq, fresh_state, pf)
            return new_slots
        if evict.size:  # what _evict counts
            if self.values:  # their copies: rows, clocks, state
                self._hold_evicted(_Due(got.ids, got.sums, clocks, got.stats, True))
            else:
                self._hold_evicted(_Due(got.ids, got.sums, got.counts, got.stats))
            self.gen += 1
            self.stats.add("evictions", evict.size)
        if pooled:
            self.policy.consumed(evict)
        self.n_free += evict.size - got.slots.size
        if got.slots.size:
            self.gen += 1
        return got.slots

    def _records(self) -> Records:
        """The host records and indexes :func:`cache.kernels.admit.admit_rows` writes."""
        assert isinstance(self.index, DenseSlotIndex)
        return Records(
            self.slab, self.sd, self.kind, self.rw, self.stat_at, self.stat_dim, self.counted,
            self.state_at, self.state_dim, self.row_id, self.index.map, self.policy.key, FREE,
            self.own8, self.free, self.values,
        )  # fmt: skip

    def _evict(self, victims: np.ndarray) -> None:
        """Free the distinct slots ``victims`` ``[K]``; the pending sums of those with
        pending updates wait in ``evicted`` for the next push."""
        if victims.size == 0:
            return
        if not self._evict_pass(victims):
            self._evict_numpy(victims)
        self.free[self.n_free : self.n_free + victims.size] = victims
        self.n_free += victims.size
        self.gen += 1
        self.stats.add("evictions", victims.size)

    def _evict_pass(self, victims: np.ndarray) -> bool:
        """:meth:`_evict`'s records, id map, row ids and keys in one C pass
        (:func:`cache.kernels.records.evict_rows`): records on the host and a dense id
        map. False (nothing changed) where it does not run."""
        if self.data is not None or not isinstance(self.index, DenseSlotIndex):
            return False
        if self.values:  # the copies go back: rows and state (as if counted), clocks
            clocks = self._write_clocks(victims)
            got = evict_rows(
                self.slab, self.sd, victims, self.row_id, self.index.map, self.policy.key,
                row_floats=0, meta_at=self.meta_at, stat_at=self.state_at,
                stat_dim=self.state_dim, counted=True, free_key=FREE,
            )  # fmt: skip
            if got is None:
                return False
            ids, rows, _, state = got
            self._hold_evicted(_Due(ids, rows, clocks, state, True))
            return True
        got = evict_rows(
            self.slab, self.sd, victims, self.row_id, self.index.map, self.policy.key,
            row_floats=self.rw, meta_at=self.meta_at, stat_at=self.stat_at,
            stat_dim=self.stat_dim, counted=self.counted, free_key=FREE,
        )  # fmt: skip
        if got is None:
            return False
        self._hold_evicted(_Due(*got))
        return True

    def _hold_evicted(self, due: _Due) -> None:
        """Evicted rows' pending sums ``due`` (none: nothing), kept for the next push."""
        if due.ids.size > 0:
            self.evicted.append(due)
            self.stats.add("evicted_pending", due.ids.size)

    def _evict_numpy(self, victims: np.ndarray) -> None:
        """:meth:`_evict_pass` on numpy (and for records on a device or a hashed id map)."""
        rec = self._gather(victims)
        meta = self._meta(rec)
        pend = np.flatnonzero(meta[:, COUNT])
        if pend.size > 0 and self.values:  # never dropped: written back first
            self._hold_evicted(self._written(self.row_id.take(victims.take(pend)), rec[pend]))
            self.meta[victims.take(pend), COUNT] = 0
        elif pend.size > 0:  # never dropped: push their gradient sums first
            sums: Any
            if self.data is None:
                sums = self._pend(rec)[pend]  # [K, D]
                counts, stats = self._counted_of(rec[pend])
            else:  # gathered now, before an admitted row takes the slot
                (at,) = self.data.indices(victims.take(pend))
                sums = self.data.pending_of(at)
                counts, stats = self._counted_of(rec[pend], self.data.stats_of(at))
            self._hold_evicted(_Due(self.row_id.take(victims.take(pend)), sums, counts, stats))
            self.meta[victims.take(pend), COUNT] = 0  # free slots hold no count
        self.index.remove(self.row_id.take(victims))
        self.row_id[victims] = -1
        self.policy.free(victims)

    # ------------------------------------------------------------ updates

    def send_evicted(self) -> None:
        """Queue the pending sums of evicted rows for the PS now (if any).

        An evicted row's sum must reach the PS before any later request reads the row
        (the store applies this worker's requests in issue order). The next push
        carries them; the owner calls this (and sends the outbox) before any pull
        when they are still waiting."""
        if self.evicted:
            no_rows = np.empty((0, self.dim), dtype=np.float32)
            self._push(self._due(_EMPTY_I64, no_rows if self.data is None else self.data.empty()))

    def _counted_of(
        self, rec: np.ndarray, on_device: torch.Tensor | None = None
    ) -> tuple[np.ndarray | None, Any]:
        """The update counts ``[K]`` and statistics ``[K, Q]`` (copies; ``on_device``: the
        device's, for rows there) of records ``rec`` ``[K, W]`` with pending updates;
        (None, None) where pushes are not counted."""
        if not self.counted:
            return None, None
        q, at = self.stat_dim, self.stat_at
        stats = rec[:, at : at + q].copy() if on_device is None else on_device
        return self._meta(rec)[:, COUNT].copy(), stats

    def _due(self, ids: np.ndarray, grads: Any) -> _Due:
        """A push of ``ids`` ``[P]`` and ``grads`` ``[P, D]`` of one update each."""
        if not self.counted:
            return _Due(ids, grads)
        # The statistic of a row of one update is not read (the PS squares its gradient).
        none: Any = np.zeros((ids.size, self.push_q), np.float32)
        if self.data is not None:
            none = self.data.no_stats(ids.size)
        return _Due(ids, grads, np.ones(ids.size, dtype=np.int64), none)

    def _write_clocks(self, victims: np.ndarray) -> np.ndarray:
        """The clocks ``[P]`` the writes of the victims ``[V]`` with pending updates give
        their rows at the PS, in the victims' order (read before they are evicted)."""
        meta = self.meta[victims]  # [V, 8]
        dirty = meta[:, COUNT] != 0
        return meta[dirty, CLOCK] + meta[dirty, OWN] + 1

    def _written(self, ids: np.ndarray, rec: np.ndarray) -> _Due:
        """The write of the copies ``rec`` ``[K, W]`` of rows ``ids`` ``[K]``: rows, state
        and the clock each then has at the PS (``CLOCK + OWN + 1``)."""
        meta = self._meta(rec)
        state = rec[:, self.state_at : self.state_at + self.state_dim].copy()
        clocks = meta[:, CLOCK] + meta[:, OWN] + 1
        return _Due(ids, self._rec_rows(rec), clocks, state, True).sorted()

    def _push(self, *dues: _Due) -> None:
        """Queue the pushes ``dues`` (fresh arrays; gradients on the cache's device for
        rows on a device) in the outbox, with the evicted rows' sums not sent yet
        (distinct from their ids: a row evicted since the last push was cached, so it is
        not in a batch's pass-through ids, and it is not cached now, so it is not due).
        Writes of copies go as one more item: they are not summed with anything."""
        if self.evicted and self.values:
            dues = (_Due.join(self.evicted).sorted(), *dues)
            self.evicted = []
        elif self.evicted:
            (due,) = dues
            dues = (_Due.join([*self.evicted, due], on_device=self.data is not None),)
            self.evicted = []
        for due in dues:
            if due.ids.size > 0:
                self.outbox.append(due)
                self.stats.pushed(due.ids.size)

    def take_outbox(self) -> list[Pushed]:
        """The pushes queued since the last call, in order (each one is a separate push
        for the PS: one optimizer step per row, or ``counts`` of them). The gradients of
        rows on a device are still there (the owner copies every table's at once)."""
        box, self.outbox = self.outbox, []
        return [b.tensors(on_device=self.data is not None) for b in box]

    def sent(self, handle: Handle) -> None:
        """The outbox went to the PS in the request of ``handle`` (waited by ``flush``)."""
        if len(self.push_handles) > 8:
            self.push_handles = [h for h in self.push_handles if not h.is_completed()]
        self.push_handles.append(handle)

    def update(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply row gradients ``grads`` ``[N, D]`` of ``ids`` ``[N]`` (checked already;
        ``grads`` on the rows' device when they are on one).

        Repeated ids are summed first (as a store does). Cached rows: the copy takes
        the local step (the table optimizer's with the row's state, or an SGD step of
        ``lr``), the gradient joins the row's pending sum, and rows
        with more than ``write_bound`` pending updates are pushed (their sum) now.
        Rows not cached are pushed at once. Everything due goes in one push.
        """
        uniq = ids.numpy()
        if not _increasing(uniq):
            ids, grads = _coalesce(ids, grads)  # [U], [U, D]
            uniq = ids.numpy()
        self.seq += 1
        # The batch's rows stay in their slots until the next serving pull (they are
        # protected from eviction), so its slots need no lookup unless ids were admitted.
        slots = self._slots_of(uniq, self.served, self.tick)  # [U]
        self.stats.add("updates", uniq.size)
        if self.data is None:
            g = np.ascontiguousarray(grads.numpy())  # [U, D]
            in_order = self._update_in_order(uniq, slots, g)
            if in_order is not None:
                self._push(*in_order)
                return
        else:  # the records hold no row: the pass only counts and decides what is due
            g = np.empty((uniq.size, 0), dtype=np.float32)
        # [K] positions into uniq, [K, sd] sums, counted pushes: [K] counts, [K, Q] stats
        due_at, due_g, *due_counted = self._update_records(slots, g)
        uncached = _EMPTY_I64
        if slots.size and slots.min() < 0:  # rows not cached are pushed at once
            uncached = np.flatnonzero(slots < 0)
        if self.data is None:
            pushed = _Due(uniq.take(due_at), due_g, due_counted[0], due_counted[1])
            if uncached.size:
                through = self._due(uniq.take(uncached), g.take(uncached, axis=0))
                pushed = _Due.join([through, pushed])
            self._push(pushed)
            return
        push_ids = uniq.take(due_at)
        through = self._due(uniq.take(uncached), None)
        if uncached.size:
            push_ids = np.concatenate([uniq.take(uncached), push_ids])
        cached = np.flatnonzero(slots >= 0)
        # (the cached rows' ids key a narrow row's rounding)
        (at_c, s_c, at_due, s_due, at_unc), keys = self.data.keyed(
            uniq.take(cached), cached, slots.take(cached), due_at, slots.take(due_at), uncached
        )
        self.data.update(
            at_c, s_c, grads, self.lr, accumulate=self.write_bound > 0, ids=keys, seq=self.seq
        )
        if self.local is not None:
            self.data.step_local(at_c, s_c, grads, self.local, keys, self.seq)
        if self.write_bound == 0:  # every update is due as it is
            due = grads.index_select(0, at_due)
        else:
            due = self.data.take_pending(s_due)
        rows = torch.cat([grads.index_select(0, at_unc), due])
        if not self.counted:
            self._push(_Due(push_ids, rows))
            return
        assert through.counts is not None and due_counted[0] is not None
        counts = np.concatenate([through.counts, due_counted[0]])
        stats = torch.cat([through.stats, self.data.take_stats(s_due)])
        self._push(_Due(push_ids, rows, counts, stats))

    def _step_local(self, slots: np.ndarray, g: np.ndarray) -> None:
        """The optimizer's local step of the cached ``slots`` ``[U]`` (-1: not cached)
        with gradients ``g`` ``[U, D]``: rows and state gathered, stepped, written back."""
        assert self.local is not None
        c_sel = np.flatnonzero(slots >= 0)  # [S]
        if c_sel.size == 0:
            return
        s, sa, sn = slots.take(c_sel), self.state_at, self.state_dim
        rows = torch.from_numpy(self._rows(s))  # [S, D] copies
        state = torch.from_numpy(self.slab[s, sa : sa + sn])  # [S, S_opt]
        self.local.step(rows, state, torch.from_numpy(g.take(c_sel, axis=0)))
        self._set_rows(s, rows.numpy(), self.seq)
        self.slab[s, sa : sa + sn] = state.numpy()

    def _local_step_args(self) -> tuple[float, int, float]:
        """``(lr, acc_at, eps)`` of the records' pass: row-wise Adagrad's local step is the
        C pass's own (its accumulator in the record, ``acc_at`` >= 0), else SGD's of ``lr``."""
        opt = self.spec.optimizer
        if self.state_dim > 0 and isinstance(opt, RowWiseAdagrad):
            return opt.lr, self.state_at, opt.eps
        return self.lr, -1, 0.0

    def _update_in_order(
        self, uniq: np.ndarray, slots: np.ndarray, g: np.ndarray
    ) -> tuple[_Due, ...] | None:
        """The push's pass over host records (:meth:`_update_records`) writing the whole
        push in id order (:func:`cache.kernels.records.update_rows` given the ids): the due
        rows, the rows not cached (``slots`` -1) and the sums evicted since the last push,
        merged, so the store need not sort it. Writing copies back, the rows not cached
        are cut out of it as a plain push of their gradients and the rest is one write.
        None (nothing changed) without the kernel."""
        if self.values:
            return self._write_in_order(uniq, slots, g)
        lr, acc_at, eps = self._local_step_args()
        got = update_rows(
            self.slab, self.sd, slots, self.own8, g, lr=lr, write_bound=self.write_bound,
            seq=self.seq, stat_dim=self.stat_dim, stat_at=self.stat_at, acc_at=acc_at, eps=eps,
            kind=self.kind, seed=self.seed, row_ids=self.row_id, ids=uniq,
            evicted=self._evicted_in_order(),
        )  # fmt: skip
        if got is None:
            return None
        if self.local is not None and acc_at < 0:
            self._step_local(slots, g)
        self.evicted = []
        _, sums, counts, stats, ids = got
        assert ids is not None
        return (_Due(ids, sums, counts, stats) if self.counted else _Due(ids, sums),)

    def _evicted_in_order(self) -> Evicted | None:
        """The rows evicted since the last push (sums, or writes of copies), joined in id
        order as the push's pass merges them: ``(ids, rows, counts, stats)``; None: none."""
        if not self.evicted:
            return None
        ev = _Due.join(self.evicted).sorted()
        return ev.ids, ev.grads, ev.counts, ev.stats

    def _write_in_order(
        self, uniq: np.ndarray, slots: np.ndarray, g: np.ndarray
    ) -> tuple[_Due, ...] | None:
        """:meth:`_update_in_order` of a cache that writes its copies back: the pass
        emits the due rows' copies, state and clocks, the evicted rows' writes and the
        rows not cached (their gradients) in id order; ``(push, write)``."""
        lr, acc_at, eps = self._local_step_args()
        got = update_rows(
            self.slab, self.sd, slots, self.own8, g, lr=lr, write_bound=self.write_bound,
            seq=self.seq, stat_dim=self.state_dim, stat_at=self.state_at, acc_at=acc_at,
            eps=eps, row_ids=self.row_id, ids=np.ascontiguousarray(uniq),
            evicted=self._evicted_in_order(), values=True,
        )  # fmt: skip
        if got is None:
            return self._write_numpy(uniq, slots, g)
        self.evicted = []
        at, rows, clocks, state, ids = got
        assert ids is not None
        emitted = _Due(ids, rows, clocks, state, True)
        # [P] the rows not cached: positions into the batch (evicted rows: -1) of free slots
        through = (at >= 0) & (slots.take(np.maximum(at, 0)) < 0)
        if not through.any():
            return (emitted,)
        return (
            emitted.take(np.flatnonzero(through), write=False),
            emitted.take(np.flatnonzero(~through), write=True),
        )

    def _write_numpy(self, uniq: np.ndarray, slots: np.ndarray, g: np.ndarray) -> tuple[_Due, ...]:
        """:meth:`_write_in_order` on numpy: the optimizer's local step of the cached rows,
        then their counts; ``(push of the rows not cached, write of the rows due)`` (the
        evicted rows' writes stay for :meth:`_push`)."""
        self._step_local(slots, g)
        cached = slots >= 0
        through = np.flatnonzero(~cached)
        push = _Due(uniq.take(through), g.take(through, axis=0))
        s = slots[cached]  # [S]
        if s.size == 0:
            return (push,)
        rec = self._gather(s)  # [S, W]
        meta = self._meta(rec)
        meta[:, COUNT] += 1
        due = np.flatnonzero(meta[:, COUNT] > self.write_bound)  # [K]
        write = self._written(uniq[cached].take(due), rec[due])
        meta[due, COUNT] = 0
        meta[due, OWN] += 1
        meta[due, PUSHED] = self.seq
        self._scatter(s, rec)
        self._copy_own(s)
        return push, write

    def _update_records(
        self, slots: np.ndarray, g: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The records' pass of a push (:func:`cache.kernels.records.update_rows`, or the
        same in numpy): for the cached ``slots`` ``[U]`` (-1: not cached) with gradients
        ``g`` ``[U, sd]``, ``(due_at [K] positions into slots, due sums [K, sd], counts
        [K], statistics [K, Q])``, the last two None where pushes are not counted."""
        q, at = self.stat_dim, self.stat_at
        if slots.size == 0:
            return self._counted(_EMPTY_I64, np.empty((0, self.sd), np.float32), _EMPTY_I64, None)
        lr, acc_at, eps = self._local_step_args()
        got = update_rows(
            self.slab, self.sd, slots, self.own8, g, lr=lr, write_bound=self.write_bound,
            seq=self.seq, stat_dim=q, stat_at=at, acc_at=acc_at, eps=eps, kind=self.kind,
            seed=self.seed, row_ids=self.row_id,
        )  # fmt: skip
        stepped = got is not None and acc_at >= 0  # the C pass took row-wise Adagrad's step
        if self.local is not None and self.data is None and not stepped:
            self._step_local(slots, g)  # before the numpy path below reads the records
        if got is not None:
            return self._counted(*got[:4])
        d = self.sd
        c_sel = np.flatnonzero(slots >= 0)  # [S] positions of the cached rows
        s, gc = slots.take(c_sel), g.take(c_sel, axis=0)  # [S], [S, D]
        if s.size == 0:
            return self._counted(_EMPTY_I64, np.empty((0, d), np.float32), _EMPTY_I64, None)
        rec = self._gather(s)  # [S, W]
        meta = self._meta(rec)
        if self.lr != 0.0 and self.kind == 0:
            rec[:, :d] -= self.lr * gc
        elif self.lr != 0.0:  # a narrow row: the float32 step, rounded back
            rows = self._rec_rows(rec)
            rows -= self.lr * gc
            self._set_rec_rows(rec, rows, self.row_id.take(s), self.seq)
        if self.write_bound == 0:  # every update is due as it is
            due = np.arange(s.size)
            due_g, due_k, due_s = gc, np.ones(s.size, np.int64), None
            meta[:, OWN] += 1
            meta[:, PUSHED] = self.seq
        else:
            pend = self._pend(rec)  # [S, D] view; zeros where nothing is pending
            pend += gc
            stat = rec[:, at : at + q]  # [S, Q] view (Q = 0: empty)
            if q == 1:  # the kernel's sum, in its order: j = 0, 1, ... (no pairwise sum)
                sq = np.zeros(s.size, dtype=np.float32)
                for j in range(d):
                    sq += gc[:, j] * gc[:, j]
                stat[:, 0] += sq / np.float32(d)
            elif q > 1:
                stat += gc * gc
            meta[:, COUNT] += 1
            due = np.flatnonzero(meta[:, COUNT] > self.write_bound)
            due_g, due_k, due_s = pend[due], meta[due, COUNT].copy(), stat[due].copy()
            if due.size > 0:
                pend[due] = 0.0
                stat[due] = 0.0
                meta[due, COUNT] = 0
                meta[due, OWN] += 1
                meta[due, PUSHED] = self.seq
        self._scatter(s, rec)
        self._copy_own(s)
        return self._counted(c_sel.take(due), due_g, due_k, due_s)

    def _counted(
        self, due: np.ndarray, sums: np.ndarray, counts: np.ndarray, stats: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What :meth:`_update_records` returns: the counts and statistics only where
        pushes are counted (the statistics of a write bound of 0: zeros, not read)."""
        if not self.counted:
            return due, sums, None, None
        if stats is None:
            stats = np.zeros((due.size, self.stat_dim), dtype=np.float32)
        return due, sums, counts, stats

    def flush(self) -> None:
        """Queue every pending sum (and evicted sum) in the outbox; the owner sends it
        and waits for :attr:`push_handles`."""
        slots = np.flatnonzero(self.meta[:, COUNT])
        if slots.size > 0:
            self.seq += 1
            rec = self._gather(slots)
            meta = self._meta(rec)
            if self.values:  # the copies themselves
                self._push(self._written(self.row_id.take(slots), rec))
            else:
                self._flush_sums(slots, rec)
            meta[:, COUNT] = 0
            meta[:, OWN] += 1
            meta[:, PUSHED] = self.seq
            self._scatter(slots, rec)
            self._copy_own(slots)
        self.send_evicted()

    def _flush_sums(self, slots: np.ndarray, rec: np.ndarray) -> None:
        """:meth:`flush`'s push of the pending sums (counts, statistics) of ``slots``
        ``[K]`` whose records are ``rec`` ``[K, W]``, cleared in ``rec``."""
        sums: Any
        if self.data is None:
            sums = self._pend(rec).copy()  # [K, D]
            counted = self._counted_of(rec)
        else:
            (at,) = self.data.indices(slots)
            sums = self.data.take_pending(at)
            counted = self._counted_of(rec, self.data.take_stats(at) if self.counted else None)
        self._push(_Due(self.row_id.take(slots), sums, *counted))
        self._pend(rec)[:] = 0.0
        if self.counted:
            rec[:, self.stat_at : self.stat_at + self.stat_dim] = 0.0


def _coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeated ``ids`` ``[N]`` summed (as a store does): ``([U] sorted, [U, D])``; the
    sums stay on ``grads``' device (the ids on the host)."""
    if grads.device.type == "cpu":
        return coalesce(ids, grads)
    uniq, inverse = torch.unique(ids, return_inverse=True)  # [U], [N]
    sums = torch.zeros(uniq.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    return uniq, sums.index_add_(0, inverse.to(grads.device), grads)


def _writes_values(config: CacheConfig, spec: TableSpec, *, values: bool, host: bool) -> bool:
    """Whether a cache of ``spec`` writes its copies back (``CacheConfig.write_back``):
    ``"auto"`` where it can, ``"values"`` or a ValueError saying why it cannot.

    It can where it is the rows' only writer (``sole_writer``: no other update reaches
    the PS, so its copy is the newest value of each row), the store takes writes
    (``values``), the rows are float32 host records of a fixed table and the table's
    optimizer is row-wise Adagrad stepping the copies (``local_step="optimizer"``), which
    the records' C pass runs as the store's kernel does: then each copy has taken every
    update, in order, as the PS would have, bit for bit (without the C pass, by the
    optimizer's torch step: within its roundings). Plain SGD's pushed sums are exact
    already, and its store step rounds otherwise than the records' pass."""
    if config.write_back == "gradients":
        return False
    opt = spec.optimizer
    in_pass = config.local_step == "optimizer" and isinstance(opt, RowWiseAdagrad)
    why = None
    if not config.sole_writer:
        why = "the cache is not its tables' only writer (sole_writer=False)"
    elif not values:
        why = "the store does not take writes of rows"
    elif not host or spec.narrow or spec.num_rows is None:
        why = "its rows are not float32 host records of a fixed table"
    elif not in_pass:
        why = f"its optimizer is {opt.name}, not row-wise Adagrad stepping the copies"
    if why is not None and config.write_back == "values":
        raise ValueError(f"CacheConfig: write_back='values' for table {spec.name!r}, but {why}")
    return why is None
