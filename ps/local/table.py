"""One table (or one shard of one) held as tensors in this process: the engine of the
in-process store, and usable by any server process that owns a shard of a table.

Layout::

    fixed table (spec.num_rows = N)      dynamic table (spec.num_rows None)
      weights  [N, D]   spec dtype         weights   [slots, D]  spec dtype slots grow by doubling
      state    [N, S]   float32            state     [slots, S]  float32
      clocks   [N]      int64              clocks    [slots]     int64
      (row i is id i)                      row_ids   [slots]     int64     id held by a slot
                                           live      [slots]     bool
                                           last_touch[slots]     int64     table step of last touch
                                           index     IdIndex: id -> slot (ps.local.dynamic_index)
                                           free      int64 stack of freed slots

Dynamic-table rules (see :class:`ps.table.TableSpec`):

* a **push** creates the missing rows it touches (initial row from the spec's
  initializer, initial optimizer state, clock 0) and then updates them;
* a **pull** never creates: an id without a row reads as its initial row, clock 0;
* the table's *step* counts push requests; a pull or push of an existing row sets
  its ``last_touch`` to the current step;
* after each push: rows with ``step - last_touch >= max_age_steps`` are evicted,
  then, while more than ``capacity`` rows exist, the least recently touched ones
  (ties: smaller id first) are evicted. Evicted rows lose weights, state and
  clock; their slots are reused.

Initial rows of a fixed table are hashed on the host by default (numpy, one core: ~0.8 s
per 65,536 x 128 rows); with ``init_device`` they are hashed by torch ops on that device
(:meth:`ps.UniformInit.rows_torch`, the same bits) and copied into the host table
chunk by chunk (:func:`initialise_rows`): with a GPU, the host's share is one copy of the
rows on every core.

Narrow rows (``spec.dtype`` fp16 or bf16): ``weights`` hold that type, every read
returns float32 (exact), and an update is computed on float32 copies and written back
stochastically rounded (:func:`ps.rounding.round_to`, keyed by the row's id and its
clock after the update): row-wise Adagrad on a fixed table in one C pass
(:func:`ps.kernels.narrow_rows.rowwise_adagrad_`, the float32 kernel's step, then the
rounding; the bits of local tables' pass), other optimizers by their torch step and the
C rounding (:func:`ps.kernels.narrow_rows.round_rows`, the bits of
:func:`ps.rounding.round_to`).

Nothing here validates requests or takes locks: callers check ids and grads
(:mod:`ps.validate`) and serialise requests with :attr:`LocalTable.lock`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ps.checkpoint import TablePart
from ps.kernels import narrow_rows, rowwise_adagrad
from ps.local.dynamic_index import IdIndex
from ps.optimizers import RowWiseAdagrad
from ps.store import PullResult
from ps.table import TableSpec, UniformInit
from ps.validate import finite_rows

_INIT_CHUNK_ROWS = 1 << 16  # rows initialised per step, bounds the temporary hash arrays
#: Elements hashed at once by torch on a device: the hash holds a few int64 ``[rows, D]``
#: temporaries at a time (8 bytes x this each), 1 GiB each on a GPU (1 M rows of 128),
#: 32 MiB on the host.
_DEVICE_INIT_ELEMENTS = {"cuda": 1 << 27}
_HOST_INIT_ELEMENTS = 1 << 22
_MIN_SLOTS = 64

COUNTERS = (
    "pull_requests",
    "rows_pulled",
    "rows_skipped_by_bound",
    "push_requests",
    "rows_pushed",
    "rows_skipped_nan",
    "rows_created",
    "rows_evicted",
)

#: Counters of writes (:meth:`LocalTable.write`), beside :data:`COUNTERS` (which the C
#: passes count in their order).
WRITE_COUNTERS = ("write_requests", "rows_written")


_ALIGN = 64  # bytes: a cache line


def table_array(
    shape: tuple[int, ...], dtype: torch.dtype, fill: float | None = None
) -> torch.Tensor:
    """A CPU tensor for table storage, allocated by numpy (zeros, or ``fill``), its first
    element on a 64-byte boundary.

    numpy asks the kernel for transparent huge pages on big arrays
    (``madvise(MADV_HUGEPAGE)``), torch's allocator does not; with 2 MiB pages a
    random row gather over a large table misses the TLB far less often. But glibc
    hands out a big block 16 bytes past a page boundary, so every 64-byte row (dim 16)
    would straddle two cache lines: two misses per random row instead of one, measured
    1.9x slower for a 26-table row-wise Adagrad push. So the array starts at the first
    cache line of a block one line larger.
    """
    if dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits as int16
        out16 = table_array(shape, torch.int16).view(torch.bfloat16)
        return out16.fill_(fill) if fill is not None and fill != 0 else out16
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    nbytes = math.prod(shape) * np_dtype.itemsize
    # calloc: the kernel hands out zero pages as they are first written, so tens of
    # GB are "allocated" at once and the first writer (the init) pays for the pages
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = raw[start : start + nbytes].view(np_dtype).reshape(shape)
    if fill is not None and fill != 0:
        out.fill(fill)
    return torch.from_numpy(out)


def initialise_rows(
    spec: TableSpec,
    weights: torch.Tensor,
    device: torch.device | None = None,
    ids: torch.Tensor | None = None,
) -> None:
    """Write the initial rows of fixed table ``spec`` into the host ``weights [N, D]``:
    all rows, or only rows ``ids`` (int64 ``[K]``, host) when given.

    ``device`` None: ``spec.initial_rows`` on the host (numpy), 65,536 rows at a time.
    Else the rows are hashed by :meth:`ps.UniformInit.rows_torch` on ``device``, bit for
    bit the same values, in chunks of ``_DEVICE_INIT_ELEMENTS`` elements, and copied in.
    On CUDA two pinned buffers alternate: the device hashes chunk ``i + 1`` and copies
    it to one buffer while the host copies chunk ``i`` from the other into ``weights``
    (torch's host copy runs on every core, which also spreads the first-touch page
    faults of a freshly allocated table). A constant init is written on the host.
    """
    init = spec.init
    assert isinstance(init, UniformInit)  # resolved by TableSpec
    n, d = int(weights.shape[0]), int(weights.shape[1])
    count = n if ids is None else int(ids.numel())
    if count == 0:
        return
    if init.low == init.high and device is not None:
        value = float(init.low)
        if ids is not None:
            weights[ids] = value
        elif value != 0.0 or math.copysign(1.0, value) < 0:  # +0.0: calloc's zeros already
            weights.fill_(value)
        return
    if device is None:
        for start in range(0, count, _INIT_CHUNK_ROWS):
            stop = min(count, start + _INIT_CHUNK_ROWS)
            if ids is None:
                weights[start:stop] = spec.initial_rows(torch.arange(start, stop))
            else:
                sl = ids[start:stop]
                weights[sl] = spec.initial_rows(sl).to(weights.dtype)
        return
    chunk = max(1, _DEVICE_INIT_ELEMENTS.get(device.type, _HOST_INIT_ELEMENTS) // d)
    if device.type == "cuda":
        _initialise_from_cuda(init, weights, device, chunk, ids)
        return
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        if ids is None:
            at = torch.arange(start, stop, dtype=torch.int64, device=device)
            weights[start:stop].copy_(init.rows_torch(at, d))
        else:
            sl = ids[start:stop]
            weights[sl] = init.rows_torch(sl.to(device), d).cpu().to(weights.dtype)


def _initialise_from_cuda(
    init: UniformInit,
    weights: torch.Tensor,
    device: torch.device,
    chunk: int,
    ids: torch.Tensor | None,
) -> None:
    """:func:`initialise_rows` on a GPU: hash a chunk on the device, copy it to a pinned
    buffer (non-blocking), and while the next chunk is hashed and copied to the other
    buffer, copy this one into ``weights`` on the host."""
    d = int(weights.shape[1])
    count = int(weights.shape[0]) if ids is None else int(ids.numel())
    rows = min(chunk, count)
    buffers = [torch.empty((rows, d), dtype=torch.float32, pin_memory=True) for _ in range(2)]
    stream = torch.cuda.current_stream(device)
    # (copy done, pinned buffer, start, stop): on the way to the host, not yet in weights
    waiting: tuple[torch.cuda.Event, torch.Tensor, int, int] | None = None

    def land(done: torch.cuda.Event, buf: torch.Tensor, start: int, stop: int) -> None:
        done.synchronize()
        if ids is None:
            weights[start:stop].copy_(buf)
        else:
            weights[ids[start:stop]] = buf.to(weights.dtype)

    for i, start in enumerate(range(0, count, chunk)):
        stop = min(count, start + chunk)
        if ids is None:
            at = torch.arange(start, stop, dtype=torch.int64, device=device)
        else:
            at = ids[start:stop].to(device, non_blocking=False)
        # buffer i % 2 last held chunk i - 2, which ``land`` copied out at step i - 1
        buf = buffers[i % 2][: stop - start]
        buf.copy_(init.rows_torch(at, d), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        if waiting is not None:
            land(*waiting)
        waiting = (done, buf, start, stop)
    if waiting is not None:
        land(*waiting)


def take(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` along dim 0 (a new tensor), for CPU tensors.

    Gathers and scatters go through numpy: single-threaded, they are as fast as
    ``index_select`` on one thread and do not stall the way an OpenMP-parallel
    ``index_select`` does when the cores are oversubscribed (several ranks or
    jobs on one machine: every parallel region then waits for a descheduled
    thread, 5-10x slower in our measurements).
    """
    if src.dtype == torch.bfloat16:  # numpy has no bfloat16: move its bits
        bits = np.take(src.view(torch.int16).numpy(), index.numpy(), axis=0)
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.take(src.numpy(), index.numpy(), axis=0))


def put(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[index] = values`` along dim 0 for distinct ``index`` (see :func:`take`)."""
    if dst.dtype == torch.bfloat16:
        dst.view(torch.int16).numpy()[index.numpy()] = values.view(torch.int16).numpy()
        return
    dst.numpy()[index.numpy()] = values.numpy()


def widened(rows: torch.Tensor) -> torch.Tensor:
    """Rows as float32 (narrow rows widen exactly; float32 ones come back as they are)."""
    return rows if rows.dtype == torch.float32 else rows.to(torch.float32)


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated ids: ``(unique ids [U] sorted, summed grads [U, D])``.

    Sorted ids also make the later scatter into the table walk memory in order.
    Gradients of one id are added in request order. Ids already strictly increasing
    (a cache's or a dedup'd push) come back as they are, with no sort and no copy.
    """
    a = ids.numpy()  # numpy: on batches of ~1k ids its calls cost a fraction of torch's
    if a.size < 2 or bool((a[1:] > a[:-1]).all()):
        return ids, grads
    perm_np = np.argsort(a, kind="stable")  # [N]
    srt_np = a.take(perm_np)
    if bool((srt_np[1:] != srt_np[:-1]).all()):  # no repeats: just reorder
        return torch.from_numpy(srt_np), take(grads, torch.from_numpy(perm_np))
    srt, perm = torch.from_numpy(srt_np), torch.from_numpy(perm_np)
    uniq, counts = torch.unique_consecutive(srt, return_counts=True)  # [U], [U]
    segment = torch.repeat_interleave(torch.arange(uniq.numel()), counts)  # [N]
    summed = torch.zeros(uniq.numel(), grads.shape[1], dtype=torch.float32)  # [U, D]
    summed.index_add_(0, segment, take(grads, perm))
    return uniq, summed


def coalesce_counted(
    ids: torch.Tensor, grads: torch.Tensor, counts: torch.Tensor, stats: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`coalesce` of a counted push: the counts ``[N]`` and statistics ``[N, Q]`` of
    repeated ids are summed too (they are updates of one row, each counted)."""
    a = ids.numpy()
    if a.size < 2 or bool((a[1:] > a[:-1]).all()):
        return ids, grads, (counts, stats)
    perm_np = np.argsort(a, kind="stable")  # [N]
    srt_np = a.take(perm_np)
    if bool((srt_np[1:] != srt_np[:-1]).all()):  # no repeats (a cache's push): reorder
        perm = torch.from_numpy(perm_np)
        return torch.from_numpy(srt_np), take(grads, perm), (counts[perm], take(stats, perm))
    uniq, inverse = torch.unique(ids, return_inverse=True)  # [U] sorted, [N]
    u = uniq.numel()
    summed = torch.zeros(u, grads.shape[1], dtype=torch.float32).index_add_(0, inverse, grads)
    k = torch.zeros(u, dtype=torch.int64).index_add_(0, inverse, counts)
    q = torch.zeros(u, stats.shape[1], dtype=torch.float32).index_add_(0, inverse, stats)
    return uniq, summed, (k, q)


class LocalTable:
    """Rows, optimizer state and clocks of one table in local memory (fixed or dynamic)."""

    def __init__(
        self, spec: TableSpec, *, initialise: bool = True, init_device: torch.device | None = None
    ) -> None:
        """``initialise`` False leaves a fixed table's rows at zero (a load fills them);
        ``init_device``: where a fixed table's initial rows are hashed (None: numpy on
        the host; see :func:`initialise_rows`). Dynamic tables create rows on the host
        as pushes come."""
        self.spec = spec
        self.lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys((*COUNTERS, *WRITE_COUNTERS), 0)
        # The table's id of each fixed row, where a row is not its id (a server's
        # shard sets it): stochastic rounding is keyed by table ids, so every shard
        # layout rounds alike.
        self.row_table_ids: torch.Tensor | None = None
        d, s = spec.dim, spec.state_dim
        wt = spec.torch_dtype
        self._state0 = spec.initial_state()  # [S]
        if spec.num_rows is not None:
            n = spec.num_rows
            self.weights = table_array((n, d), wt)  # [N, D]
            self.state = table_array((n, s), torch.float32)  # [N, S]
            if bool((self._state0.view(torch.int32) != 0).any()):  # else calloc's zeros
                self.state[:] = self._state0
            self.clocks = table_array((n,), torch.int64)  # [N]
            if initialise:
                initialise_rows(spec, self.weights, init_device)
        else:
            self.step = 0
            self.index = IdIndex()
            self.weights = table_array((_MIN_SLOTS, d), wt)
            self.state = table_array((_MIN_SLOTS, s), torch.float32)
            self.clocks = table_array((_MIN_SLOTS,), torch.int64)
            self.row_ids = table_array((_MIN_SLOTS,), torch.int64)
            self.live = table_array((_MIN_SLOTS,), torch.bool)
            self.last_touch = table_array((_MIN_SLOTS,), torch.int64)
            self.used = 0  # slots [0, used) have been handed out at least once
            self.free = torch.empty(0, dtype=torch.int64)  # freed slots, reused first
            self._oldest_touch = 0  # a lower bound of last_touch over live rows

    # ------------------------------------------------------------ sizes

    @property
    def dynamic(self) -> bool:
        return self.spec.num_rows is None

    @property
    def num_live(self) -> int:
        """Rows that exist now."""
        return len(self.index) if self.dynamic else int(self.weights.shape[0])

    def stats(self) -> dict[str, int | float]:
        """``rows``, ``bytes`` (weights + state + clocks of the rows), ``weight_bytes`` (of
        them, the rows' elements: 2 or 4 bytes each) and the counters."""
        n, spec = self.num_live, self.spec
        out: dict[str, int | float] = {"rows": n, "bytes": n * spec.row_bytes}
        out["weight_bytes"] = n * spec.dim * self.weights.element_size()
        out.update(self.counters)
        return out

    # ------------------------------------------------------------ reads

    def _slots(self, ids: torch.Tensor, touch: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(slots, found)`` of a dynamic table's ids: ``slots`` int64 ``[N]`` with 0 where
        the id has no row, ``found`` bool ``[N]`` (None when every id has a row)."""
        slots = self.index.lookup(ids)  # [N], -1 where absent
        found = slots >= 0
        if bool(found.all()):
            if touch:
                self.last_touch.index_fill_(0, slots, self.step)
            return slots, None
        if touch:
            self.last_touch.index_fill_(0, slots[found], self.step)
        return slots.clamp_(min=0), found

    def _read(
        self, ids: torch.Tensor, src: torch.Tensor, fill: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows of ``src`` for ``ids`` (already validated); missing dynamic rows from ``fill``."""
        if not self.dynamic:
            return take(src, ids)
        slots, found = self._slots(ids, touch=False)
        out = widened(take(src, slots)) if src is self.weights else take(src, slots)
        if found is not None:
            miss = ~found
            if fill is None:
                out[miss] = self._initial_rows(ids[miss])
            else:
                out[miss] = fill
        return out

    def pull(
        self, ids: torch.Tensor, clocks: torch.Tensor | None = None, bound: int | None = None
    ) -> PullResult:
        """Rows of ``ids`` int64 ``[N]``; with ``clocks``/``bound`` only those past the bound."""
        self.counters["pull_requests"] += 1
        n = int(ids.shape[0])
        found = None  # dynamic tables: which ids have a row (None: all of them)
        if self.dynamic:
            slots, found = self._slots(ids, touch=True)  # [N]
            row_clocks = take(self.clocks, slots)  # [N]
            if found is not None:
                row_clocks.masked_fill_(~found, 0)
        else:
            slots = ids
            row_clocks = take(self.clocks, ids)  # [N]
        positions = None
        if clocks is not None:
            assert bound is not None
            positions = torch.nonzero(row_clocks > clocks + bound).squeeze(1)  # [M]
            ids, slots = take(ids, positions), take(slots, positions)
            row_clocks = take(row_clocks, positions)
            if found is not None:
                found = take(found, positions)
        rows = widened(take(self.weights, slots))  # [M, D]
        if found is not None and not bool(found.all()):
            miss = ~found
            rows[miss] = self._initial_rows(ids[miss])
        m = int(row_clocks.shape[0])
        self.counters["rows_pulled"] += m
        self.counters["rows_skipped_by_bound"] += n - m
        return PullResult(rows, row_clocks, positions)

    def _initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[K, D]``: the initial rows of absent dynamic ids as the table would
        store them once created (narrow rows: rounded to the table's type), so a row
        reads the same before and after a push creates it."""
        rows = self.spec.initial_rows(ids)
        return widened(rows.to(self.weights.dtype)) if self.spec.narrow else rows

    def read_clocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Clocks of ``ids`` ``[N]`` (0 for missing dynamic rows); touches nothing."""
        return self._read(ids, self.clocks, torch.zeros((), dtype=torch.int64))

    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of ``ids`` ``[N, S]`` (initial state for missing dynamic rows)."""
        return self._read(ids, self.state, self._state0)

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weights of ``ids`` ``[N, D]`` (initial rows for missing dynamic rows); no touch."""
        return widened(self._read(ids, self.weights, None))

    # ------------------------------------------------------------ writes

    def push(
        self,
        ids: torch.Tensor,
        grads: torch.Tensor,
        *,
        checked: bool = False,
        counted: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Apply a validated push: ``ids`` int64 ``[N]``, ``grads`` float32 ``[N, D]``;
        ``counted``: the ``(counts [N], stats [N, Q])`` of a counted push
        (:class:`ps.PushRequest`).

        ``checked``: the caller already checked every row of ``grads`` finite (a
        store's request check with ``nan_policy="raise"``), so rows that need no
        summing are not checked again.

        Gradients of repeated ids are summed (their counts and statistics too); rows
        whose summed gradient is not finite are dropped with ``nan_policy="skip"``, and
        with "raise" (where the request was checked already, so only a sum of huge
        values overflowing can get here) a ValueError is raised before anything
        changes. The optimizer runs once per unique row (a counted row: its count of
        sub-steps, :meth:`ps.Optimizer.apply_counted`) and each updated row's clock
        goes up by one.
        """
        uniq, summed = ids, grads
        if ids.numel() > 0:
            if counted is None:
                uniq, summed = coalesce(ids, grads)  # [U], [U, D]
            else:
                uniq, summed, counted = coalesce_counted(ids, grads, *counted)
        # Sums of checked rows are finite unless they overflow; checked rows that were
        # not summed (no repeats: at most reordered) need no second pass.
        summing = summed.shape[0] != grads.shape[0]
        recheck = summing or not checked or self.spec.nan_policy != "raise"
        if ids.numel() > 0 and recheck:
            ok = finite_rows(summed)  # [U]
            if not bool(ok.all()):
                if self.spec.nan_policy == "raise":
                    bad = int(uniq[~ok][0])
                    raise ValueError(
                        f"push table {self.spec.name!r}: the summed gradient of row id {bad} "
                        "overflows to Inf; nothing was applied"
                    )
                self.counters["rows_skipped_nan"] += int((~ok).sum())
                uniq, summed = uniq[ok], summed[ok]
                if counted is not None:
                    counted = (counted[0][ok], counted[1][ok])
        self.counters["push_requests"] += 1
        if self.dynamic:
            self.step += 1
        if uniq.numel() > 0:
            slots = self._create(uniq) if self.dynamic else uniq
            self.counters["rows_pushed"] += int(uniq.numel())
            if (
                counted is not None
                and not self.dynamic
                and self._counted_in_place(slots, summed, counted)
            ):
                slots = slots[:0]  # every row applied in one pass
            elif counted is not None and bool((counted[0] > 1).any()):
                # Rows of several updates take their sub-steps here; the rest (count 1)
                # the plain push below, bit for bit.
                many = counted[0] > 1
                at, rest = torch.nonzero(many).squeeze(1), torch.nonzero(~many).squeeze(1)
                self._apply(slots[at], summed[at], (counted[0][at], counted[1][at]))
                slots, summed = slots[rest], summed[rest]
            if slots.numel() > 0 and (self.dynamic or not self._push_in_place(slots, summed)):
                self._apply(slots, summed, None)
        if self.dynamic:
            self._evict()

    def write(
        self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, clocks: torch.Tensor
    ) -> None:
        """Apply a validated write (:func:`ps.validate.check_write`) of a fixed float32
        table: ``rows`` ``[N, D]``, ``state`` ``[N, S]`` and ``clocks`` ``[N]`` of the
        distinct ``ids`` ``[N]`` replace the table's; no optimizer runs."""
        self.counters["write_requests"] += 1
        if ids.numel() == 0:
            return
        a = ids.numpy()
        self.weights.numpy()[a] = rows.numpy()
        if self.state.shape[1]:
            self.state.numpy()[a] = state.numpy()
        self.clocks.numpy()[a] = clocks.numpy()
        self.counters["rows_written"] += int(a.size)

    def _apply(
        self,
        slots: torch.Tensor,
        summed: torch.Tensor,
        counted: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The optimizer on copies of the rows at distinct ``slots`` ``[U]``, written back;
        their clocks up by one (and their last touch, on a dynamic table)."""
        opt = self.spec.optimizer
        rows = widened(take(self.weights, slots))  # [U, D] float32 copies
        state = take(self.state, slots)  # [U, S] copies
        if counted is None:
            opt.apply(rows, state, summed)
        else:
            opt.apply_counted(rows, state, summed, *counted)
        self.clocks.numpy()[slots.numpy()] += 1  # slots are distinct
        if self.spec.narrow:
            versions = take(self.clocks, slots)  # [U] the clocks after this update
            rows = narrow_rows.round_rows(rows, self._rounding_keys(), slots, versions)
        put(self.weights, slots, rows)
        put(self.state, slots, state)
        if self.dynamic:
            self.last_touch.index_fill_(0, slots, self.step)

    def _rounding_keys(self) -> narrow_rows.RoundingKeys:
        """How the rows round: seeded by the table's init seed (a per-table value every
        process knows), keyed by each row's table id (a dynamic table's slot holds
        ``row_ids[slot]``, a shard's row ``row_table_ids[row]``)."""
        assert self.spec.init is not None
        ids = self.row_ids if self.dynamic else self.row_table_ids
        return narrow_rows.RoundingKeys(
            self.spec.torch_dtype,
            torch.tensor([0, int(self.weights.shape[0])], dtype=torch.int64),
            torch.tensor([self.spec.init.seed], dtype=torch.int64),
            ids,
        )

    def _counted_in_place(
        self, slots: torch.Tensor, summed: torch.Tensor, counted: tuple[torch.Tensor, torch.Tensor]
    ) -> bool:
        """A counted push of row-wise Adagrad on a fixed table in ONE C pass over the
        distinct ``slots`` ``[U]``: rows of one update take the plain step (the bits of
        :meth:`_push_in_place`), the others their sub-steps; clocks + 1. False (nothing
        changed) for other optimizers or where the kernel is unavailable."""
        opt = self.spec.optimizer
        if not isinstance(opt, RowWiseAdagrad) or self.spec.narrow:
            return False
        counts, stats = counted
        return rowwise_adagrad.rowwise_adagrad_counted_(
            self.weights, self.state, self.clocks, slots.contiguous(), summed.contiguous(),
            counts.contiguous(), stats.contiguous(), lr=opt.lr, eps=opt.eps,
        )  # fmt: skip

    def _push_in_place(self, slots: torch.Tensor, summed: torch.Tensor) -> bool:
        """Row-wise Adagrad on a fixed table in the C kernel (one pass per row, no copies).

        ``slots`` are distinct and sorted (from :func:`coalesce`); the kernel runs the
        same math as :meth:`ps.optimizers.RowWiseAdagrad.apply` and bumps the clocks.
        False (nothing changed) for other optimizers or where the kernel is unavailable.
        """
        opt = self.spec.optimizer
        if not isinstance(opt, RowWiseAdagrad):
            return False
        if self.spec.narrow:
            return narrow_rows.rowwise_adagrad_(
                self.weights, self.state, self.clocks, slots, summed.contiguous(),
                lr=opt.lr, eps=opt.eps, keys=self._rounding_keys(),
            )  # fmt: skip
        return rowwise_adagrad.rowwise_adagrad_(
            self.weights,
            self.state,
            self.clocks,
            slots,
            summed.contiguous(),
            lr=opt.lr,
            eps=opt.eps,
        )

    def _create(self, uniq: torch.Tensor) -> torch.Tensor:
        """Slots of the distinct ids ``uniq`` ``[U]``, creating the rows that are missing."""
        slots = self.index.lookup(uniq)  # [U]
        miss = slots < 0
        if bool(miss.any()):
            new_ids = uniq[miss]  # [K]
            new_slots = self._alloc(new_ids.numel())  # [K]
            self.weights[new_slots] = self.spec.initial_rows(new_ids).to(self.weights.dtype)
            self.state[new_slots] = self._state0
            self.clocks[new_slots] = 0
            self.row_ids[new_slots] = new_ids
            self.live[new_slots] = True
            self.last_touch[new_slots] = self.step
            self.index.insert(new_ids, new_slots)
            slots[miss] = new_slots
            self.counters["rows_created"] += int(new_ids.numel())
        return slots

    def _alloc(self, k: int) -> torch.Tensor:
        """``k`` free slots: reused ones first, then fresh ones (growing the arrays)."""
        reuse = min(k, int(self.free.numel()))
        taken = self.free[self.free.numel() - reuse :]
        self.free = self.free[: self.free.numel() - reuse]
        fresh = k - reuse
        if self.used + fresh > self.weights.shape[0]:
            self._grow(self.used + fresh)
        new = torch.arange(self.used, self.used + fresh, dtype=torch.int64)
        self.used += fresh
        return torch.cat([taken, new])

    def _grow(self, need: int) -> None:
        cap = int(self.weights.shape[0])
        while cap < need:
            cap *= 2
        for name in ("weights", "state", "clocks", "row_ids", "live", "last_touch"):
            old = getattr(self, name)
            new = table_array((cap, *old.shape[1:]), old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def _evict(self) -> None:
        spec = self.spec
        if spec.max_age_steps is not None and self.step - self._oldest_touch >= spec.max_age_steps:
            touched = self.last_touch[: self.used]
            old = self.live[: self.used] & (self.step - touched >= spec.max_age_steps)
            self._drop(torch.nonzero(old).squeeze(1))
            alive = touched[self.live[: self.used]]
            self._oldest_touch = int(alive.min()) if alive.numel() > 0 else self.step
        if spec.capacity is not None and len(self.index) > spec.capacity:
            self._drop(self._lru(len(self.index) - spec.capacity))

    def _lru(self, k: int) -> torch.Tensor:
        """Slots of the ``k`` least recently touched live rows (ties: smaller id first)."""
        slots = torch.nonzero(self.live[: self.used]).squeeze(1)  # [L]
        touched = self.last_touch[slots]  # [L]
        cut = int(torch.kthvalue(touched, k).values)  # the k-th smallest touch step
        below = slots[touched < cut]
        at = slots[touched == cut]
        at = at[torch.argsort(self.row_ids[at])][: k - below.numel()]
        return torch.cat([below, at])

    def _drop(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.index.remove(self.row_ids[slots])
        self.live[slots] = False
        self.free = torch.cat([self.free, slots])
        self.counters["rows_evicted"] += int(slots.numel())

    # ------------------------------------------------------------ checkpoints

    def parts(self, max_rows: int = 1 << 20) -> Iterator[TablePart]:
        """The rows as checkpoint parts of at most ``max_rows`` rows (views; hold the lock;
        narrow rows widened to float32, exactly: a checkpoint holds float32 rows and the
        spec its dtype).

        Dynamic tables list their rows by increasing id.
        """
        if self.dynamic:
            slots = torch.nonzero(self.live[: self.used]).squeeze(1)
            slots = slots[torch.argsort(self.row_ids[slots])]
            for start in range(0, max(1, slots.numel()), max_rows):
                sl = slots[start : start + max_rows]
                yield TablePart(
                    ids=self.row_ids[sl],
                    weights=widened(self.weights[sl]),
                    state=self.state[sl],
                    clocks=self.clocks[sl],
                )
            return
        n = int(self.weights.shape[0])
        for start in range(0, n, max_rows):
            stop = min(n, start + max_rows)
            yield TablePart(
                ids=torch.arange(start, stop, dtype=torch.int64),
                weights=widened(self.weights[start:stop]),
                state=self.state[start:stop],
                clocks=self.clocks[start:stop],
            )

    @classmethod
    def from_part(
        cls, spec: TableSpec, part: TablePart, init_device: torch.device | None = None
    ) -> LocalTable:
        """A table holding the checkpointed rows ``part`` (checked against ``spec`` already).

        Fixed tables: rows absent from ``part`` start from the initializer.
        Dynamic tables: the rows of ``part`` count as touched at step 0; if there
        are more than ``capacity``, the smallest ids are evicted at once.
        ``init_device``: where the missing rows are hashed (see :func:`initialise_rows`).
        """
        t = cls(spec, initialise=False)
        ids = part.ids
        if spec.num_rows is not None:
            have = torch.zeros(spec.num_rows, dtype=torch.bool)
            have[ids] = True
            missing = torch.nonzero(~have).squeeze(1)
            initialise_rows(spec, t.weights, init_device, missing)
            t.weights[ids] = part.weights.to(t.weights.dtype)
            t.state[ids] = part.state
            t.clocks[ids] = part.clocks
            return t
        slots = t._alloc(ids.numel())
        t.weights[slots] = part.weights.to(t.weights.dtype)
        t.state[slots] = part.state
        t.clocks[slots] = part.clocks
        t.row_ids[slots] = ids
        t.live[slots] = True
        t.index.insert(ids, slots)
        if spec.capacity is not None and len(t.index) > spec.capacity:
            t._drop(t._lru(len(t.index) - spec.capacity))
        t.counters["rows_evicted"] = 0
        return t
