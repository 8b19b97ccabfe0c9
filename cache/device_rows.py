"""The rows and pending sums of a cache's slots in tensors on a device (a GPU's memory).

With :class:`cache.CachedStore` given a ``device``, a table's cache splits its slots in
two: the metadata records (clock, counts, prefetch marks, eviction keys, the id -> slot
map) stay in host memory, where the plan of every step is made (:mod:`cache.table_cache`
with a row width of 0), and the ``D``-wide data lives here::

    rows  T       [C, D]   the copy served: PS row at CLOCK + local updates (T the
                           table's row type: float32, or float16 / bfloat16 for a
                           narrow table)
    pend  float32 [C, D]   the sum of the gradients not pushed yet (0 if COUNT = 0)
    stat  float32 [C, Q]   counted pushes: the statistic of `pend` (Q = 1: sum of
                           mean(g^2); Q = D: sums of g^2; Q = 0 otherwise)
    opt   float32 [C, S]   the optimizer's local step: the row's optimizer state
                           (S = 0 for an SGD step; :mod:`cache.local_step`)

The host decides every step from the metadata alone (which ids hit, which rows are
refreshed, admitted, evicted or due), so the device only receives index arrays and the
rows the store sent, and does gathers and scatters; it never has to tell the host
anything but the rows due to the store. Per step that is:

* host -> device: the rows the store returned (misses and refreshes, ``[M, D]``) in one
  copy, and each operation's slot index arrays (serve, install, refresh, update) packed
  into one int64 copy (all from pinned memory, ``non_blocking``: no host
  synchronisation; :func:`comm.boundary.to_device`);
* device -> host: the pushed rows (gradients of rows not cached, due pending sums,
  evicted sums; ``[P, D]``) in one copy, which waits for the backward (the one
  synchronisation, made by :class:`cache.CachedStore` for every table at once).

A narrow table (``TableSpec.dtype`` "fp16" or "bf16") keeps ``rows`` in its type, as
the host records do (:mod:`cache.narrow_records`): every read widens exactly (served rows
are float32), the store's rows (and a checkpoint's widened rows) are written as they are,
and a row computed here (a refresh, the SGD or the optimizer's local step) is rounded
stochastically by :func:`ps.rounding.round_to` (torch ops: on the device) with the
host's key: the table's init seed, the rows' table ids and version ``-1 - seq`` for the
write's request number ``seq``. The ids travel in the step's packed int64 copy
(:meth:`DeviceRows.keyed`). Pending sums, statistics and optimizer state stay float32.

On the host (``device = cpu``) the same code runs on CPU tensors without copies; tests
compare it with the record slab bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from cache.local_step import LocalStep
from comm import boundary
from ps.rounding import round_to


class DeviceRows:
    """``rows`` ``[capacity, dim]`` of ``dtype`` (float32, or a narrow table's float16 or
    bfloat16, rounded with the key of init ``seed``), ``pend`` ``[capacity, dim]``,
    ``stat`` ``[capacity, stat_dim]`` and ``opt`` ``[capacity, state_dim]`` float32 on
    ``device`` (zeros)."""

    def __init__(
        self,
        capacity: int,
        dim: int,
        device: torch.device,
        stat_dim: int = 0,
        state_dim: int = 0,
        *,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.device = device
        self.dim = dim
        self.dtype = dtype
        self.narrow = dtype != torch.float32
        self.seed = seed
        self.rows = torch.zeros(capacity, dim, dtype=dtype, device=device)  # [C, D]
        self.pend = torch.zeros(capacity, dim, dtype=torch.float32, device=device)  # [C, D]
        self.stat = torch.zeros(capacity, stat_dim, dtype=torch.float32, device=device)  # [C, Q]
        self.opt = torch.zeros(capacity, state_dim, dtype=torch.float32, device=device)  # [C, S]

    @property
    def nbytes(self) -> int:
        floats = self.pend.numel() + self.stat.numel() + self.opt.numel()
        return self.rows.numel() * self.rows.element_size() + floats * 4

    # ------------------------------------------------------------ transfers

    def indices(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 numpy arrays as int64 tensors on the device: one packed pinned copy
        (:func:`comm.boundary.to_device`; views of the arrays on the host)."""
        host = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        return boundary.to_device(host, self.device)

    def keyed(
        self, ids: np.ndarray, *arrays: np.ndarray
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """:meth:`indices` of ``arrays``, and for a narrow table the table ids ``ids``
        ``[K]`` of the rows it writes (the rounding's key) in the same packed copy; None
        for float32 rows (nothing sent)."""
        if not self.narrow:
            return self.indices(*arrays), None
        *idx, on_device = self.indices(*arrays, ids)
        return idx, on_device

    def upload(self, rows: torch.Tensor) -> torch.Tensor:
        """Host rows ``[M, D]`` (from the store) on the device, one non-blocking copy
        (none for no rows)."""
        if rows.numel() == 0:
            return torch.empty(rows.shape, dtype=torch.float32, device=self.device)
        return boundary.to_device([rows.to(torch.float32)], self.device)[0]

    def empty(self) -> torch.Tensor:
        """``[0, D]`` on the device (a push with no rows)."""
        return torch.empty(0, self.dim, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------ rows

    def _get(self, slots: torch.Tensor) -> torch.Tensor:
        """float32 copies ``[K, D]`` of the rows of ``slots`` ``[K]`` (a narrow row widened:
        exact)."""
        return self.rows.index_select(0, slots).to(torch.float32)

    def _put(
        self, slots: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor | None, seq: int
    ) -> None:
        """``rows[slots] = rows`` (float32 ``[K, D]`` the cache computed by request
        ``seq``); a narrow table's rounded stochastically for its table ids ``ids``
        ``[K]`` at version ``-1 - seq``, as the host records round them."""
        if self.narrow:
            assert ids is not None, "a narrow row's rounding needs its table id"
            versions = torch.full_like(ids, -1 - seq)  # [K] never a PS clock (>= 0)
            rows = round_to(rows, self.dtype, seed=self.seed, ids=ids, versions=versions)
        self.rows.index_copy_(0, slots, rows)

    # ------------------------------------------------------------ slot operations

    def install(
        self,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        sel: torch.Tensor,
        fresh_state: torch.Tensor | None = None,
    ) -> None:
        """New copies: ``rows[slots] = fresh[sel]``, nothing pending (``[n]`` each), and
        ``opt[slots] = fresh_state[sel]`` (``[M, S]`` on the device) when given. The
        store's rows of a narrow table are values of its type: narrowed exactly."""
        if slots.numel() == 0:
            return
        self.rows.index_copy_(0, slots, fresh.index_select(0, sel).to(self.dtype))
        self.pend.index_fill_(0, slots, 0.0)
        self.stat.index_fill_(0, slots, 0.0)
        if fresh_state is not None and self.opt.shape[1]:
            self.opt.index_copy_(0, slots, fresh_state.index_select(0, sel))

    def write(
        self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None
    ) -> None:
        """``rows[slots] = rows`` (host ``[n, D]``) and their optimizer state (host
        ``[n, S]``), nothing pending (a loaded cache). A narrow table's saved rows are
        its values widened: narrowed exactly (other values to the nearest, as the host
        records load them)."""
        at = torch.arange(rows.shape[0], device=self.device)
        self.install(slots, self.upload(rows), at, None if state is None else self.upload(state))

    def refresh_ahead(
        self,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        sel: torch.Tensor,
        fresh_state: torch.Tensor,
        counts: torch.Tensor,
        local: LocalStep,
        *,
        counted: bool,
        ids: torch.Tensor | None = None,
        seq: int = 0,
    ) -> None:
        """Cached rows past the read bound, with the optimizer's local step: the PS rows
        ``fresh[sel]`` and state ``fresh_state[sel]`` advanced by the pending updates
        (``counts`` ``[R]`` on the host; with ``counted``, the statistics) as the PS will
        apply them (:meth:`cache.local_step.LocalStep.ahead`), written by request ``seq``
        (a narrow table's rows ``ids`` ``[R]`` rounded: :meth:`_put`)."""
        if slots.numel() == 0:
            return
        rows = fresh.index_select(0, sel)  # [R, D]
        state = fresh_state.index_select(0, sel)  # [R, S]
        stats = self.stat.index_select(0, slots) if counted else None
        (k,) = boundary.to_device([counts], self.device)
        local.ahead(rows, state, self.pend.index_select(0, slots), k, stats)
        self._put(slots, rows, ids, seq)
        self.opt.index_copy_(0, slots, state)

    def step_local(
        self,
        cached_at: torch.Tensor,
        slots: torch.Tensor,
        grads: torch.Tensor,
        local: LocalStep,
        ids: torch.Tensor | None = None,
        seq: int = 0,
    ) -> None:
        """The optimizer's local step of the cached rows ``slots`` ``[S]`` with gradients
        ``grads[cached_at]`` by request ``seq``: rows (float32) and state gathered,
        stepped, scattered back (a narrow table's rows ``ids`` ``[S]`` rounded)."""
        if slots.numel() == 0:
            return
        rows, state = self._get(slots), self.opt.index_select(0, slots)
        local.step(rows, state, grads.index_select(0, cached_at))
        self._put(slots, rows, ids, seq)
        self.opt.index_copy_(0, slots, state)

    def read_state(self, slots: np.ndarray) -> torch.Tensor:
        """Host copies of the optimizer state of ``slots`` (a checkpoint of the cache)."""
        (at,) = self.indices(slots)
        return self.opt.index_select(0, at).cpu()

    def refresh(
        self,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        sel: torch.Tensor,
        lr: float,
        ids: torch.Tensor | None = None,
        seq: int = 0,
    ) -> None:
        """Cached rows past the read bound: ``rows[slots] = fresh[sel] - lr * pend[slots]``
        (the PS row minus the unpushed local delta; exact where nothing is pending),
        written by request ``seq`` (a narrow table's rows ``ids`` ``[R]`` rounded, which
        leaves a row with nothing pending as the store sent it)."""
        if slots.numel() == 0:
            return
        new = fresh.index_select(0, sel)  # [R, D]
        if lr != 0.0:
            new -= lr * self.pend.index_select(0, slots)
        self._put(slots, new, ids, seq)

    def serve(
        self,
        final: torch.Tensor,
        through_at: torch.Tensor,
        fresh: torch.Tensor,
        through_sel: torch.Tensor,
        inverse: torch.Tensor | None,
    ) -> torch.Tensor:
        """The served rows ``[N, D]``: the copies of the cached ids (``final`` ``[U]``
        slots, -1 where not cached), the store's rows ``fresh[through_sel]`` at the ids
        that pass through (``through_at``), in request order (``inverse`` ``[N]``);
        float32 (a narrow row widened)."""
        out = self._get(final.clamp(min=0))  # [U, D]
        if through_at.numel() > 0:
            out.index_copy_(0, through_at, fresh.index_select(0, through_sel))
        return out if inverse is None else out.index_select(0, inverse)

    def take_pending(self, slots: torch.Tensor) -> torch.Tensor:
        """The pending sums of ``slots`` ``[K]`` (a new tensor ``[K, D]``), zeroed here."""
        sums = self.pend.index_select(0, slots)
        self.pend.index_fill_(0, slots, 0.0)
        return sums

    def pending_of(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the pending sums of ``slots`` ``[K]`` (rows being evicted)."""
        return self.pend.index_select(0, slots)

    def take_stats(self, slots: torch.Tensor) -> torch.Tensor:
        """The statistics of ``slots`` ``[K]`` (a new tensor ``[K, Q]``), zeroed here."""
        stats = self.stat.index_select(0, slots)
        self.stat.index_fill_(0, slots, 0.0)
        return stats

    def stats_of(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the statistics of ``slots`` ``[K]`` (rows being evicted)."""
        return self.stat.index_select(0, slots)

    def no_stats(self, n: int) -> torch.Tensor:
        """``[n, Q]`` zeros on the device: the statistic of rows of one update (not read)."""
        return torch.zeros(n, self.stat.shape[1], dtype=torch.float32, device=self.device)

    def update(
        self,
        cached_at: torch.Tensor,
        slots: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        accumulate: bool,
        ids: torch.Tensor | None = None,
        seq: int = 0,
    ) -> None:
        """Gradients ``grads[cached_at]`` of the cached rows ``slots`` (``[S]``) by request
        ``seq``: the copy takes an SGD step of ``lr`` (float32 product, then subtract; a
        narrow table's rows ``ids`` ``[S]`` rounded back), and with ``accumulate`` (a
        write bound > 0) the gradient joins the pending sum and its square the statistic
        (summed over the row in the host kernel's order, j = 0, 1, ..., so both layouts
        give the same bits)."""
        if slots.numel() == 0:
            return
        g = grads.index_select(0, cached_at)  # [S, D]
        if lr != 0.0:
            self._put(slots, self._get(slots) - lr * g, ids, seq)
        if accumulate:
            self.pend.index_copy_(0, slots, self.pend.index_select(0, slots) + g)
            q = self.stat.shape[1]
            if q == 1:
                sq = torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
                for j in range(g.shape[1]):
                    sq += g[:, j] * g[:, j]
                add = (sq / float(g.shape[1])).unsqueeze(1)  # [S, 1]
            elif q > 1:
                add = g * g  # [S, D]
            if q > 0:
                self.stat.index_copy_(0, slots, self.stat.index_select(0, slots) + add)

    def read(self, slots: np.ndarray) -> torch.Tensor:
        """Host float32 copies of the rows of ``slots`` (a checkpoint of the cache; a
        narrow row crosses in its type and widens on the host: exact)."""
        (at,) = self.indices(slots)
        return self.rows.index_select(0, at).cpu().to(torch.float32)
