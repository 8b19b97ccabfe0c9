"""An in-process store's batched requests served whole by the C message passes.

``InProcessStore.pull_many`` and ``push_many`` of 26 tables, part by part in Python,
pay ~110 us (pull) and ~220 us (push) of fixed cost per table (checks, gathers of rows,
clocks and state, views, counters) around a few microseconds of rows. The passes of
:mod:`ps.kernels.message_pass`, which serve an MPI server's batched messages, take the
same parts from one table of contents: every part checked first, then every part
served, in C, with the table engine's own row step (the bits of ``LocalTable.push``).

:class:`LocalBatchedPass` keeps the descriptors of the tables it has served (one row
per table object; a table a load or a create replaced gets a new row after
:meth:`LocalBatchedPass.reset`), builds a request's table of contents, and splits the
reply into :class:`ps.PullResult` s. Which requests it takes: pulls of fixed tables
(fp16 / bf16 rows widened to float32), and pushes of fixed row-wise Adagrad tables with
finite gradients (counts >= 1 and statistics finite and >= 0 when counted; a counted
push of a narrow table goes the Python path), on host tensors
of the documented dtypes and shapes; a push part whose ids repeat or are out of order is
summed and sorted first by the table push's own :func:`ps.local.table.coalesce` (the
same sums in the same order), and one comparison over all parts' ids finds such parts:
a cache's push (every part sorted and distinct) goes to the pass as it came, whose own
check covers its counts, statistics and gradients. A with-state pull of tables of one
dim and state width (a shared cache's) splits rows from state in two copies for every
part together. Anything else, including every request that would raise, goes the
store's Python path, which serves it or says what is wrong; locks: every table of a
request, taken in one order.

Measured (26 tables x 1 M rows, dim 16, a cache's batched step at bounds (4, 4)): the
store's share of the step 10.5 -> 4.7 ms (push) and ~6 -> ~4 ms (pull).

A group request (:mod:`ps.group_requests`: every table of an id space at once, by packed
ids, what a cache shared by tables sends) goes to the same passes whole
(:meth:`LocalBatchedPass.pull_group`, :meth:`LocalBatchedPass.push_group`): its sorted
packed ids are cut into the tables' parts in place (one subtraction of each id's table
base), and the reply is read back as one result, its rows a view of the pass's buffer;
no per-table request or result is made.

The parts of different tables are served on the caller's torch intra-op threads
(``torch.get_num_threads()``, as local tables' kernels are), one part per thread: each
part is its own table's rows and counters, stepped in order by one thread, so the bits
are the same on any thread count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeGuard

import numpy as np
import torch

from comm import boundary
from ps.group_requests import GroupPull, GroupPush, GroupWrite
from ps.kernels import message_pass
from ps.kernels.message_pass import COUNTER_WORDS, TABLE_WORDS
from ps.local.table import COUNTERS, LocalTable, coalesce, coalesce_counted
from ps.optimizers import RowWiseAdagrad
from ps.store import PullRequest, PullResult, PushRequest
from ps.table import TableSpec

assert len(COUNTERS) == COUNTER_WORDS  # the C passes count in this order


def descriptor(
    engine: LocalTable, spec: TableSpec, ids_map: torch.Tensor | None
) -> tuple[list[int], list[float]]:
    """A fixed table's descriptor words and (lr, eps) (layout: ``message_pass.c``):
    ``engine`` holds the rows of ``spec``'s ids (all of them, or a server's share);
    ``ids_map`` int32 ``[spec.num_rows]`` maps an id to its local row (-1: another
    server's), None where the local row is the id. A narrow table's rows round with its
    init seed, keyed by the request's ids (the table ids, whatever the local rows)."""
    opt = spec.optimizer
    state = engine.state  # [rows, S]
    adagrad = isinstance(opt, RowWiseAdagrad) and state.shape[1] >= 1
    words = [
        1,
        int(spec.num_rows or 0),
        spec.dim,
        engine.weights.data_ptr(),
        state.data_ptr(),
        state.stride(0),
        engine.clocks.data_ptr(),
        0 if ids_map is None else ids_map.data_ptr(),
        1 if adagrad else 0,
        spec.state_dim,
        message_pass.ROW_CODES[spec.dtype],
        spec.init.seed if spec.narrow and spec.init is not None else 0,
    ]
    hyper = [opt.lr, opt.eps] if isinstance(opt, RowWiseAdagrad) else [0.0, 0.0]
    return words, hyper


def _host(t: object, dtype: torch.dtype, dims: int) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` is a host tensor of ``dtype`` with ``dims`` dimensions, no autograd."""
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.dim() == dims
        and t.device.type == "cpu"
        and not t.requires_grad
    )


class LocalBatchedPass:
    """Descriptors of an in-process store's fixed tables and the C passes over them."""

    def __init__(self) -> None:
        self.enabled = message_pass.available()
        self._lock = threading.Lock()  # guards the registry below
        self._tables: list[LocalTable] = []  # descriptor row -> table (held: addresses stay valid)
        self._rows: dict[int, int] = {}  # id(table) -> descriptor row
        self._words = np.zeros((0, TABLE_WORDS), dtype=np.int64)  # [T, TABLE_WORDS]
        self._hyper = np.zeros((0, 2), dtype=np.float32)  # [T, 2] lr, eps
        self.served = 0  # requests these passes served

    def reset(self) -> None:
        """Forget every descriptor (tables were created, dropped or replaced by a load)."""
        with self._lock:
            self._tables, self._rows = [], {}
            self._words = np.zeros((0, TABLE_WORDS), dtype=np.int64)
            self._hyper = np.zeros((0, 2), dtype=np.float32)

    def _describe(self, tables: Sequence[LocalTable]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(descriptor row per table [k], words, hyper)``; new tables are added to copies
        of the arrays, so a pass running on another thread keeps reading its own."""
        with self._lock:
            index = np.empty(len(tables), dtype=np.int64)
            added: list[tuple[list[int], list[float]]] = []
            for i, t in enumerate(tables):
                row = self._rows.get(id(t))
                if row is None:
                    row = self._rows[id(t)] = len(self._tables)
                    self._tables.append(t)
                    added.append(descriptor(t, t.spec, None))
                index[i] = row
            if added:
                self._words = np.concatenate(
                    [self._words, np.array([w for w, _ in added], dtype=np.int64)]
                )
                self._hyper = np.concatenate(
                    [self._hyper, np.array([h for _, h in added], dtype=np.float32)]
                )
            return index, self._words, self._hyper

    # ------------------------------------------------------------ pulls

    def pull(
        self, tables: Sequence[LocalTable], requests: Sequence[PullRequest]
    ) -> list[PullResult] | None:
        """Every request's rows (as ``LocalTable.pull``, with the state where asked), or
        None: the store serves them in Python (nothing was read or counted)."""
        k = len(requests)
        if not self.enabled or k == 0 or any(t.dynamic for t in tables):
            return None
        with_state = requests[0].with_state
        parts: list[np.ndarray] = []
        for r in requests:
            if r.with_state != with_state or not _host(r.ids, torch.int64, 1):
                return None
            parts.append(r.ids.numpy())
            if r.clocks is not None or r.bound is not None:
                b = r.bound
                if not isinstance(b, int) or isinstance(b, bool) or b < 0:
                    return None
                clocks = r.clocks
                if not _host(clocks, torch.int64, 1) or clocks.shape != r.ids.shape:
                    return None
                parts.append(clocks.numpy())
        index, words, _ = self._describe(tables)
        toc = np.empty((k, 4), dtype=np.int64)  # table row, n, width word, bound (-1: plain)
        toc[:, 0] = index
        toc[:, 1] = [r.ids.shape[0] for r in requests]
        toc[:, 2] = [message_pass.width_word(t.spec.dim, t.spec.dtype) for t in tables]
        toc[:, 3] = [-1 if r.bound is None else r.bound for r in requests]
        flat = _joined(parts)
        got = self._pull_pass(tables, index, words, toc, flat, with_state)
        return None if got is None else _results(tables, requests, *got, with_state)

    def pull_group(self, tables: Sequence[LocalTable], request: GroupPull) -> PullResult | None:
        """The result of ``request`` (the tables of its id space, ``tables``, in that
        order) over its packed ids, from one pass with no per-table request: the packed
        ids cut into the tables' parts in place, the reply's parts read back as one
        result (its rows a view of the pass's buffer). None: the store takes the
        per-table path (nothing was read or counted)."""
        if not self.enabled or any(t.dynamic for t in tables):
            return None
        if len({(t.spec.dim, t.spec.state_dim) for t in tables}) != 1:
            return None
        r, space = request, request.space
        conditional = r.bound is not None
        if not _host(r.ids, torch.int64, 1) or conditional != (r.clocks is not None):
            return None
        if conditional:
            b = r.bound
            if not isinstance(b, int) or isinstance(b, bool) or b < 0:
                return None
            if not _host(r.clocks, torch.int64, 1) or r.clocks.shape != r.ids.shape:
                return None
        packed = r.ids.numpy()
        n_all = packed.size
        if n_all == 0 or not bool((packed[1:] >= packed[:-1]).all()) or not space.inside(packed):
            return None
        segments = space.segments(packed)
        parts = [tables[i] for i, _, _ in segments]
        k = len(parts)
        sizes = np.array([b - a for _, a, b in segments], dtype=np.int64)  # [k]
        starts = np.array([a for _, a, _ in segments], dtype=np.int64)  # [k]
        local = space.local(packed, segments)  # [N] table ids
        if conditional:  # each part's ids, then its caller clocks: part p at 2 * start_p
            assert r.clocks is not None
            flat = np.empty(2 * n_all, dtype=np.int64)
            at = np.arange(n_all) + np.repeat(starts, sizes)  # [N]
            flat[at] = local
            flat[at + np.repeat(sizes, sizes)] = r.clocks.numpy()
        else:
            flat = local
        index, words, _ = self._describe(parts)
        toc = np.empty((k, 4), dtype=np.int64)  # table row, n, width word, bound (-1: plain)
        toc[:, 0] = index
        toc[:, 1] = sizes
        toc[:, 2] = [message_pass.width_word(t.spec.dim, t.spec.dtype) for t in parts]
        toc[:, 3] = -1 if r.bound is None else r.bound
        got = self._pull_pass(parts, index, words, toc, flat, r.with_state)
        if got is None:
            return None
        return _group_result(parts[0].spec, *got, starts, conditional, r.with_state)

    def _pull_pass(
        self,
        tables: Sequence[LocalTable],
        index: np.ndarray,
        words: np.ndarray,
        toc: np.ndarray,
        flat: np.ndarray,
        with_state: bool,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Check, then serve a pull pass of the parts ``toc`` of ``tables`` (under their
        locks) and count it: its ``(reply words, row floats)``; None: the check refused
        it (nothing was read or counted)."""
        counters = np.zeros((words.shape[0], COUNTER_WORDS), dtype=np.int64)
        with _locked(tables):
            sizes = message_pass.pull_check(toc, flat, words, with_state)
            if sizes is None:
                return None
            reply = np.empty(sizes[0], dtype=np.int64)
            rows = np.empty(sizes[1], dtype=np.float32)
            threads = torch.get_num_threads()
            message_pass.pull_apply(toc, flat, words, counters, reply, rows, threads, with_state)
            _fold(tables, index, counters)
        self.served += 1
        return reply, rows

    # ------------------------------------------------------------ pushes

    def push(self, tables: Sequence[LocalTable], requests: Sequence[PushRequest]) -> bool:
        """Apply every request (as ``LocalTable.push``); False: nothing changed, the store
        applies them in Python."""
        k = len(requests)
        if not self.enabled or k == 0 or any(t.dynamic for t in tables):
            return False
        counted = requests[0].counts is not None
        # narrow rows round keyed by table ids: the pass takes them as the local rows
        if any(t.spec.narrow and (counted or t.row_table_ids is not None) for t in tables):
            return False
        ids: list[np.ndarray] = []  # [n_p] each part's ids
        # [n_p * D] each part's gradients, flat (torch: joined without a copy where the
        # parts lie back to back, as the hybrid tables' slices of one [U, D] do)
        grads: list[torch.Tensor] = []
        counts: list[np.ndarray] = []  # [n_p] (counted)
        stats: list[np.ndarray] = []  # [n_p] (counted: row-wise Adagrad's one statistic)
        for t, r in zip(tables, requests, strict=True):
            if not _host(r.ids, torch.int64, 1) or not _host(r.grads, torch.float32, 2):
                return False
            n = r.ids.shape[0]
            if r.grads.shape != (n, t.spec.dim) or (r.counts is not None) != counted:
                return False
            if counted:
                part = _counted_part(r.counts, r.stats, n)
                if part is None:
                    return False
                counts.append(part[0])
                stats.append(part[1])
            elif r.stats is not None:
                return False
            ids.append(r.ids.numpy())
            grads.append(r.grads.reshape(-1))
        # A part whose ids repeat or are out of order is summed and sorted by the table
        # push's own functions (the same sums in the same order), so the pass's rows get
        # the bits the part-by-part path gives. A cache's push is sorted and distinct in
        # every part: one comparison over the joined ids says so, and the pass's check
        # covers the counts and statistics.
        flat_ids = _joined(ids)
        unsorted = _unsorted_parts(flat_ids, [a.size for a in ids])
        for p in unsorted:
            r = requests[p]
            if counted:
                if not _valid_counted(counts[p], stats[p]):
                    return False  # checked before summing: a bad one may sum to a good one
                assert r.counts is not None and r.stats is not None  # checked above
                u, g, (c, q) = coalesce_counted(r.ids, r.grads, r.counts, r.stats)
                counts[p], stats[p] = c.numpy(), q.numpy().reshape(-1)
            else:
                u, g = coalesce(r.ids, r.grads)
            ids[p], grads[p] = u.numpy(), g.reshape(-1)
        if unsorted:
            flat_ids = _joined(ids)
        index, words, hyper = self._describe(tables)
        toc = np.empty((k, 3), dtype=np.int64)  # table row, n, width word
        toc[:, 0] = index
        toc[:, 1] = [a.size for a in ids]
        toc[:, 2] = [message_pass.width_word(t.spec.dim, t.spec.dtype) for t in tables]
        flat_grads = boundary.joined(grads).numpy()
        both = (_joined(counts), _joined(stats)) if counted else None
        return self._push_pass(tables, index, words, hyper, toc, flat_ids, flat_grads, both)

    def push_group(self, tables: Sequence[LocalTable], request: GroupPush) -> bool:
        """Apply ``request`` (ids sorted, :func:`ps.group_requests.sorted_push`; the
        tables of its id space, ``tables``, in that order) in one pass with no per-table
        request: the packed ids cut into the tables' parts in place, the gradients (and
        counts and statistics) read where they are. False: nothing changed, the store
        takes the per-table path (which sums repeated ids, or says what is wrong)."""
        if not self.enabled or any(t.dynamic for t in tables):
            return False
        r, space = request, request.space
        counted = r.counts is not None
        if any(t.spec.narrow and (counted or t.row_table_ids is not None) for t in tables):
            return False
        if not _host(r.ids, torch.int64, 1) or not _host(r.grads, torch.float32, 2):
            return False
        n_all = r.ids.shape[0]
        if n_all == 0 or len({t.spec.dim for t in tables}) != 1:
            return False
        if r.grads.shape != (n_all, tables[0].spec.dim):
            return False
        both = None
        if counted:
            both = _counted_part(r.counts, r.stats, n_all)
            if both is None:
                return False
        elif r.stats is not None:
            return False
        packed = r.ids.numpy()
        # strictly increasing (a repeated id is summed by the per-table path) and inside
        if not bool((packed[1:] > packed[:-1]).all()) or not space.inside(packed):
            return False
        segments = space.segments(packed)
        parts = [tables[i] for i, _, _ in segments]
        index, words, hyper = self._describe(parts)
        toc = np.empty((len(parts), 3), dtype=np.int64)  # table row, n, width word
        toc[:, 0] = index
        toc[:, 1] = [b - a for _, a, b in segments]
        toc[:, 2] = [message_pass.width_word(t.spec.dim, t.spec.dtype) for t in parts]
        ids = space.local(packed, segments)  # [P] table ids
        grads = np.ascontiguousarray(r.grads.numpy()).reshape(-1)  # [P * D]
        return self._push_pass(parts, index, words, hyper, toc, ids, grads, both)

    def _push_pass(
        self,
        tables: Sequence[LocalTable],
        index: np.ndarray,
        words: np.ndarray,
        hyper: np.ndarray,
        toc: np.ndarray,
        ids: np.ndarray,
        grads: np.ndarray,
        counted: message_pass.Counted,
    ) -> bool:
        """Check, then apply a push pass of the parts ``toc`` of ``tables`` (under their
        locks) and count it; False: the check refused it and nothing changed."""
        counters = np.zeros((words.shape[0], COUNTER_WORDS), dtype=np.int64)
        with _locked(tables):
            threads = torch.get_num_threads()
            if not message_pass.push_check(toc, ids, grads, words, counted, threads=threads):
                return False
            message_pass.push_apply(toc, ids, grads, words, hyper, counters, threads, counted)
            _fold(tables, index, counters)
        self.served += 1
        return True

    # ------------------------------------------------------------ writes

    def write_group(self, tables: Sequence[LocalTable], request: GroupWrite) -> bool:
        """Apply ``request`` (the tables of its id space, ``tables``, in that order: fixed
        float32 tables of one dim and state width) in one checked C pass
        (:func:`ps.kernels.message_pass.write`: ids in range and increasing, clocks >= 0,
        rows and state finite). False: nothing changed; the per-table path applies it or
        says what is wrong."""
        r, space = request, request.space
        if not self.enabled or any(t.dynamic or t.spec.narrow for t in tables):
            return False
        if len({(t.spec.dim, t.spec.state_dim) for t in tables}) != 1:
            return False
        hosted = _host(r.ids, torch.int64, 1) and _host(r.clocks, torch.int64, 1)
        if (
            not hosted
            or not _host(r.rows, torch.float32, 2)
            or not _host(r.state, torch.float32, 2)
        ):
            return False
        packed, n = r.ids.numpy(), r.ids.shape[0]
        d, s = tables[0].spec.dim, tables[0].spec.state_dim
        if n == 0 or r.rows.shape != (n, d) or r.state.shape != (n, s) or r.clocks.shape != (n,):
            return False
        if not bool((packed[1:] > packed[:-1]).all()) or not space.inside(packed):
            return False
        segments = space.segments(packed)
        parts = [tables[i] for i, _, _ in segments]
        index, words, _ = self._describe(parts)
        toc = np.empty((len(parts), 4), dtype=np.int64)  # table row, n, width word, state
        toc[:, 0] = index
        toc[:, 1] = [b - a for _, a, b in segments]
        toc[:, 2] = d
        toc[:, 3] = s
        ids = np.ascontiguousarray(space.local(packed, segments))  # [P] table ids
        rows = np.ascontiguousarray(r.rows.numpy()).reshape(-1)
        state = np.ascontiguousarray(r.state.numpy()).reshape(-1)
        clocks = np.ascontiguousarray(r.clocks.numpy())
        with _locked(parts):
            if not message_pass.write(toc, ids, clocks, rows, state, words):
                return False
            for t, size in zip(parts, toc[:, 1].tolist(), strict=True):
                t.counters["write_requests"] += 1
                t.counters["rows_written"] += size
        self.served += 1
        return True


def _counted_part(
    counts: torch.Tensor | None, stats: torch.Tensor | None, n: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A counted push part's update counts int64 ``[n]`` and statistics float32 ``[n]``
    as the pass takes them (row-wise Adagrad's one statistic per row); None where it
    cannot."""
    if not _host(counts, torch.int64, 1) or not _host(stats, torch.float32, 2):
        return None
    if counts.shape != (n,) or stats.shape != (n, 1):
        return None
    return np.ascontiguousarray(counts.numpy()), np.ascontiguousarray(stats.numpy()).reshape(-1)


def _valid_counted(counts: np.ndarray, stats: np.ndarray) -> bool:
    """Counts >= 1 and statistics finite and >= 0 (``ps.validate.check_counted``)."""
    if counts.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        return bool(counts.min() >= 1) and bool((stats >= 0).all() and np.isfinite(stats).all())


def _unsorted_parts(flat: np.ndarray, sizes: list[int]) -> list[int]:
    """Indices of the parts of ``flat`` (int64 ids of parts of ``sizes``, back to back)
    that are not strictly increasing, by one comparison over all of them (the pairs
    across two parts ignored)."""
    if flat.size < 2:
        return []
    rising = flat[1:] > flat[:-1]  # [N - 1]
    ends = np.cumsum(sizes)[:-1]  # where each part but the first starts
    ends = ends[(ends > 0) & (ends < flat.size)]
    rising[ends - 1] = True  # the pair across a boundary does not count
    if rising.all():
        return []
    bad = np.flatnonzero(~rising) + 1  # [B] positions where the order breaks
    return sorted(set(np.searchsorted(np.cumsum(sizes), bad, side="right").tolist()))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts)


@contextmanager
def _locked(tables: Sequence[LocalTable]) -> Iterator[None]:
    """Hold the locks of every distinct table, taken in one global order (no deadlock
    with another pass over some of the same tables; single-table requests take one)."""
    distinct = sorted({id(t): t for t in tables}.items())
    taken: list[threading.Lock] = []
    try:
        for _, t in distinct:
            t.lock.acquire()
            taken.append(t.lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release()


def _fold(tables: Sequence[LocalTable], index: np.ndarray, counters: np.ndarray) -> None:
    """Add a pass's counts (``counters`` ``[T, COUNTER_WORDS]``) to the tables' own."""
    seen: set[int] = set()
    for t, row in zip(tables, index.tolist(), strict=True):
        if row in seen:
            continue
        seen.add(row)
        own = t.counters
        for name, value in zip(COUNTERS, counters[row].tolist(), strict=True):
            if value:
                own[name] += value


def _results(
    tables: Sequence[LocalTable],
    requests: Sequence[PullRequest],
    reply: np.ndarray,
    rows: np.ndarray,
    with_state: bool,
) -> list[PullResult]:
    """Split a pull pass's reply (``[k, 2]`` (m, flags), then each part's clocks [m] and,
    conditional, positions [m]) and rows (each part's ``[m, dim (+ state_dim)]`` back to
    back) into results."""
    k = len(requests)
    out: list[PullResult] = []
    at, fat = 2 * k, 0
    # One tensor over each buffer, parts as its slices: every part (an empty one too)
    # shares the buffer's storage, so parts that lie back to back join without a copy.
    words, floats = torch.from_numpy(reply), torch.from_numpy(rows)
    split = _split_state(tables, reply, floats) if with_state else None
    for p, (t, r) in enumerate(zip(tables, requests, strict=True)):
        m, d = int(reply[2 * p]), t.spec.dim
        clocks = words[at : at + m]
        at += m
        positions = None
        if r.bound is not None:
            positions = words[at : at + m]
            at += m
        if split is not None:  # rows and state split once for every part
            row_all, state_all = split
            out.append(
                PullResult(row_all[fat : fat + m], clocks, positions, state_all[fat : fat + m])
            )
            fat += m
        elif with_state:
            w = d + t.spec.state_dim
            block = floats[fat : fat + m * w].view(m, w)
            fat += m * w
            out.append(
                PullResult(block[:, :d].contiguous(), clocks, positions, block[:, d:].contiguous())
            )
        else:
            out.append(PullResult(floats[fat : fat + m * d].view(m, d), clocks, positions))
            fat += m * d
    return out


def _split_state(
    tables: Sequence[LocalTable], reply: np.ndarray, floats: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where every part's table has one dim ``D`` and state width ``S`` (a shared
    cache's tables), the rows of a with-state reply (``[M, D + S]``, each row's state
    after its values) split into rows ``[M, D]`` and state ``[M, S]`` in two copies,
    not two per part; None otherwise."""
    dims = {(t.spec.dim, t.spec.state_dim) for t in tables}
    if len(dims) != 1:
        return None
    ((d, s),) = dims
    m = int(reply[0 : 2 * len(tables) : 2].sum())
    block = floats[: m * (d + s)].view(m, d + s)
    return block[:, :d].contiguous(), block[:, d:].contiguous()


def _group_result(
    spec: TableSpec,
    reply: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    conditional: bool,
    with_state: bool,
) -> PullResult:
    """A pull pass's reply to a group request (``[k, 2]`` (m, flags), then each part's
    clocks [m] and, conditional, positions [m]; rows ``[M, dim (+ state_dim)]`` back to
    back), read as one result over the packed ids: part ``p`` starts at packed position
    ``starts[p]``."""
    k = starts.size
    m = reply[0 : 2 * k : 2]  # [k] rows each part returned
    total = int(m.sum())
    if conditional:  # part p's clocks sit at 2 k + 2 (m_0 + .. + m_{p-1}), its positions after
        before = np.cumsum(m) - m  # [k]
        at = np.arange(total) + np.repeat(2 * k + before, m)  # [M]
        clocks = torch.from_numpy(reply.take(at))
        positions = torch.from_numpy(reply.take(at + np.repeat(m, m)) + np.repeat(starts, m))
    else:  # every part whole: the clocks back to back
        clocks, positions = torch.from_numpy(reply[2 * k : 2 * k + total]), None
    d, s = spec.dim, spec.state_dim
    floats = torch.from_numpy(rows)
    if not with_state:
        return PullResult(floats[: total * d].view(total, d), clocks, positions)
    block = floats[: total * (d + s)].view(total, d + s)
    return PullResult(block[:, :d].contiguous(), clocks, positions, block[:, d:].contiguous())
