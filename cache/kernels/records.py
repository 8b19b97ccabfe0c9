"""C kernels over the cache's slot records: one pass per batch, touching only the
words each step needs (record layout in :mod:`cache.table_cache`).

The passes of a table's step, each over the batch's slots ``[S]`` (-1: not cached,
skipped):

* :func:`copy_clocks` (planning a pull): the ``CLOCK`` word of each record, 8 bytes
  instead of the whole ``[W]`` record numpy's gather would move;
* :func:`sole_writer_asks` (planning a pull of a cache that is its tables' only
  writer): the misses and the cached rows pushed more than ``s_r`` times since their
  read, with their clocks, compacted in one pass (the other rows need no request);
* :func:`serve_rows` (installing a served pull): the served row and clock of each
  cached id; for the hits, the prefetch marks (counted and cleared) and the own
  pushes since the read (the staleness lower bound); with LFU, ``FREQ += uses``;
* :func:`install_rows` (installing admitted misses): each new record written once, in
  place, from the store's reply (numpy would build the records, then scatter them);
* :func:`evict_rows` (evicting): the pending sums, counts and statistics of the
  victims with pending updates taken out, their ``COUNT`` cleared, and every victim's
  id map entry, row id and eviction key freed, in one pass;
* :func:`update_rows` (a push)::

      for i, s in enumerate(slots):
          row, pend, meta = slab[s, :D], slab[s, D:2D], slab[s, 2D:] as int64
          row -= lr * grad[i]                   # float32 product, then subtract (no FMA)
          if write_bound == 0:                  # every update is due as it is
              due_g[k] = grad[i]; due_k[k] = 1; due_s[k] = 0
          else:
              pend += grad[i]; meta[COUNT] += 1
              stat += mean(grad[i] ** 2) (Q = 1) or grad[i] ** 2 (Q = D)  # counted pushes
              if meta[COUNT] <= write_bound: continue
              due_g[k] = pend; due_k[k] = meta[COUNT]; due_s[k] = stat
              pend = 0; stat = 0; meta[COUNT] = 0
          meta[OWN] += 1; meta[PUSHED] = seq; due_idx[k++] = i
          own8[s] = min(meta[OWN], OWN8_MAX)

``own8`` uint8 ``[C]`` is the table's dense copy of every record's ``OWN``, capped at
:data:`OWN8_MAX` (the record decides there): a sole writer's asks read ``OWN`` for every
id of a step, at random slots, and one byte a slot stays in the CPU caches where a
record's word is a miss in a slab of hundreds of MB (~36 -> ~15 ns per id in the
cache benchmark's steps, 30 k ids over 2.6 M slots).

A narrow table's record (``kind`` 1 fp16, 2 bf16: :data:`ROW_KINDS`) holds its row in
``ceil(D / 2)`` words (:func:`row_words`): the served rows are widened, installed rows
stored as they are, and the push's local step runs on a float32 copy rounded back
stochastically (:mod:`cache.narrow_records` on numpy, the same bits): the widening and
rounding are ``ps/kernels/narrow_rows.c``'s, compiled into this library.

The serving and push passes split a batch's ids into contiguous ranges over the
caller's torch intra-op threads (``torch.get_num_threads()``, OpenMP, at least 2048 ids
a thread): a batch's slots are distinct, so every record belongs to one range. The push
writes each range's rows from the most the ranges before it can emit and then moves
them down behind those, so its output is the one-thread order; each row takes the same
operations either way and the bits do not depend on the thread count
(``tests/cache/test_cache_kernel.py``). At two threads this halves the two passes in the
DLRM step (~4 -> ~2 ms and ~2.3 -> ~1.2 ms), where nothing else runs beside them.

Why C: the table's records are scattered over a slab of ``capacity x W`` floats, so
every record is a cache miss; numpy moves whole records (gather, then scatter back)
and runs ~10 calls per pass, and on this 2-core machine the copies are what costs
(~5 GB/s). These passes read and write the words they need, once. The numpy path in
:class:`cache.table_cache.TableCache` does the same with the same float32 operations in
the same order (FMA contraction off here), so both give identical bits;
``tests/cache/test_cache_kernel.py`` compares them. Built and loaded by :mod:`comm.native`
(system C compiler, ctypes); every function returns None where that is not possible
and the caller takes the numpy path.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from cache.policy import FREQ_MAX, TICK_BITS
from comm.native import kernel_source, load_c_library
from ps.kernels import narrow_rows

# The C source: records.c next to this file (package data). It is compiled after the
# library source of ps.kernels.narrow_rows (rowwise_adagrad.c and narrow_rows.c), whose
# widening and stochastic rounding of narrow rows it calls: one definition of the
# rounding's bits for the store and the cache (one string, built once: the loader's
# cache is keyed by it).
_SOURCE = kernel_source(__package__, "records")
_LIBRARY_SOURCE = narrow_rows._LIBRARY_SOURCE + "\n" + _SOURCE


def _library() -> ctypes.CDLL | None:
    # load_c_library keeps the library after the first call
    return load_c_library("hr_cache_records", _LIBRARY_SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_cache_clocks.restype = None
    lib.hr_cache_clocks.argtypes = [i64, i64, i64, ptr, ptr, i64, ptr]
    lib.hr_cache_ask.restype = i64
    lib.hr_cache_ask.argtypes = [i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr]
    lib.hr_cache_serve.restype = None
    lib.hr_cache_serve.argtypes = [i64, i64, i64, ctypes.c_int, i64, ptr, ptr, ptr, ptr]
    lib.hr_cache_serve.argtypes += [ctypes.c_int, i64] + [ptr] * 5 + [ptr, ptr, i64, i64]
    lib.hr_cache_serve.argtypes += [ctypes.c_int, ctypes.c_int]
    lib.hr_cache_update.restype = i64
    lib.hr_cache_update.argtypes = [i64, i64, i64, ctypes.c_int, i64, ptr, ptr, i64]
    lib.hr_cache_update.argtypes += [ptr, ptr, ptr, ctypes.c_float, i64, ctypes.c_int, i64]
    lib.hr_cache_update.argtypes += [i64, i64, i64, ctypes.c_float, ptr, ptr, ptr, ptr]
    lib.hr_cache_update.argtypes += [ptr, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.hr_cache_install.restype = None
    lib.hr_cache_install.argtypes = [i64, i64, i64, ctypes.c_int, i64, ptr, ptr, ptr, ptr]
    lib.hr_cache_install.argtypes += [i64, i64, ptr]
    lib.hr_cache_pass_through.restype = None
    lib.hr_cache_pass_through.argtypes = [i64, i64] + [ptr] * 6
    lib.hr_cache_evict.restype = i64
    lib.hr_cache_evict.argtypes = [i64] * 7 + [ptr] * 5 + [i64] + [ptr] * 4


#: The largest value of a slot's ``own8`` (the C source's OWN8_MAX): at it, the record's
#: ``OWN`` word is read instead.
OWN8_MAX = 255

#: Row kinds of a record: float32, fp16, bf16 (the C source's 0, NR_F16, NR_BF16).
ROW_KINDS = {"fp32": 0, "fp16": 1, "bf16": 2}


def row_words(dim: int, kind: int) -> int:
    """Float words of a record's row of ``dim`` elements: ``dim`` float32, or
    ``ceil(dim / 2)`` of a narrow kind (2 bytes per element)."""
    return dim if kind == 0 else -(-dim // 2)


def available() -> bool:
    """Whether the functions below run the C kernels here."""
    return _library() is not None


def _ok(*arrays: np.ndarray | None) -> bool:
    return all(a is None or a.flags.c_contiguous for a in arrays)


def copy_clocks(
    slab: np.ndarray, dim: int, slots: np.ndarray, fill: int, *, kind: int = 0
) -> np.ndarray | None:
    """``CLOCK`` of the records of ``slots`` int64 ``[S]`` (``fill`` where -1) of rows of
    ``dim`` elements of ``kind`` (:data:`ROW_KINDS`): int64 ``[S]``, or None where the
    kernel is not available."""
    lib = _library()
    if lib is None or not _ok(slab, slots):
        return None
    out = np.empty(slots.size, dtype=np.int64)
    m = row_words(dim, kind) + dim
    lib.hr_cache_clocks(
        slots.size, m, slab.shape[1], slots.ctypes.data, slab.ctypes.data, fill, out.ctypes.data
    )
    return out


def sole_writer_asks(
    slab: np.ndarray,
    dim: int,
    slots: np.ndarray,
    own8: np.ndarray,
    bound: int,
    fill: int,
    *,
    kind: int = 0,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(asked [A], clocks [A])``: the indices into ``slots`` int64 ``[S]`` of the
    misses (-1) and of the records whose ``OWN > bound`` (read from ``own8`` uint8
    ``[C]`` below :data:`OWN8_MAX`), with their ``CLOCK`` (``fill`` for a miss), in
    order. None where the kernel is not available."""
    lib = _library()
    if lib is None or not _ok(slab, slots, own8) or own8.dtype != np.uint8:
        return None
    asked = np.empty(slots.size, dtype=np.int64)
    clocks = np.empty(slots.size, dtype=np.int64)
    k = lib.hr_cache_ask(
        slots.size, row_words(dim, kind) + dim, slab.shape[1], slots.ctypes.data,
        slab.ctypes.data, own8.ctypes.data, bound, fill, asked.ctypes.data, clocks.ctypes.data,
    )  # fmt: skip
    return asked[:k], clocks[:k]


@functools.cache
def _no_uses() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def serve_rows(
    slab: np.ndarray,
    dim: int,
    slots: np.ndarray,
    old: np.ndarray,
    uses: np.ndarray | None,
    *,
    lfu: bool,
    tick: int,
    kind: int = 0,
    keys: np.ndarray | None = None,
    key_freq: np.ndarray | None = None,
    old_keyed: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int] | None:
    """The served pass over ``slots`` int64 ``[U]`` (see the module docstring), ``old``
    bool ``[U]`` the hits, ``uses`` int64 ``[U]`` (None: 1 each).

    ``keys`` (int64 ``[C]``, the eviction policy's :attr:`cache.policy.EvictionPolicy.key`;
    None: untouched): each served slot's key is set for its use at ``tick`` with the
    frequency ``key_freq[i]`` (int64 ``[U]``, TinyLFU's estimates), or with ``lfu`` and no
    ``key_freq`` the record's use count: what :meth:`EvictionPolicy.use` writes, in the
    same pass. ``old_keyed``: the ``old`` rows' keys hold that already (the plan wrote
    them: :func:`cache.kernels.plan_pull.plan_pull`), only the other rows' are written.

    Returns ``(rows [U, D], clocks [U], lag [U], freq [U], prefetched misses,
    prefetched refreshes)``; entries where ``slots`` is -1 are left unset (rows and
    clocks: the caller fills them), ``lag`` is each row's ``OWN`` where ``old`` and 0
    elsewhere, ``freq`` set with ``lfu``; rows of a narrow ``kind`` are served widened.
    None where the kernel is not available.
    """
    lib = _library()
    if lib is None or not _ok(slab, slots, old, uses, keys, key_freq):
        return None
    if keys is not None and (keys.dtype != np.int64 or (key_freq is None and not lfu)):
        return None
    n = slots.size
    rows = np.empty((n, dim), dtype=np.float32)
    clocks = np.empty(n, dtype=np.int64)
    lag = np.zeros(n, dtype=np.int64)  # the pass writes it where old
    freq = np.empty(n, dtype=np.int64) if lfu else _no_uses()
    pf = np.zeros(2, dtype=np.int64)
    lib.hr_cache_serve(
        n, dim, row_words(dim, kind), kind, slab.shape[1], slots.ctypes.data, slab.ctypes.data,
        old.view(np.uint8).ctypes.data, None if uses is None else uses.ctypes.data,
        int(lfu), tick, rows.ctypes.data, clocks.ctypes.data, lag.ctypes.data,
        freq.ctypes.data, pf.ctypes.data, None if keys is None else keys.ctypes.data,
        None if key_freq is None else key_freq.ctypes.data, FREQ_MAX, TICK_BITS, int(old_keyed),
        torch.get_num_threads(),
    )  # fmt: skip
    return rows, clocks, lag, freq, int(pf[0]), int(pf[1])


def pass_through(
    out: np.ndarray,
    out_clock: np.ndarray,
    at: np.ndarray,
    fresh: np.ndarray,
    sel: np.ndarray,
    fresh_clock: np.ndarray,
) -> bool:
    """The served rows the cache does not keep, from the store's reply: ``out[at[i]] =
    fresh[sel[i]]`` (float32 ``[U, D]`` and ``[M, D]``) and ``out_clock[at[i]] =
    fresh_clock[sel[i]]`` (int64 ``[U]``, ``[M]``), ``at`` and ``sel`` int64 ``[T]``.
    False (nothing written) where the kernel is not available."""
    lib = _library()
    arrays = (out, out_clock, at, fresh, sel, fresh_clock)
    if lib is None or not _ok(*arrays) or out.dtype != np.float32 or fresh.dtype != np.float32:
        return False
    if not at.dtype == sel.dtype == out_clock.dtype == fresh_clock.dtype == np.int64:
        return False
    d = out.shape[1]
    assert fresh.shape[1] == d and at.size == sel.size
    lib.hr_cache_pass_through(
        at.size, d, at.ctypes.data, sel.ctypes.data, fresh.ctypes.data, fresh_clock.ctypes.data,
        out.ctypes.data, out_clock.ctypes.data,
    )  # fmt: skip
    return True


def install_rows(
    slab: np.ndarray,
    dim: int,
    slots: np.ndarray,
    fresh: np.ndarray,
    sel: np.ndarray,
    clocks: np.ndarray,
    *,
    seq: int,
    pf: int,
    kind: int = 0,
) -> bool:
    """Write fresh records to the distinct ``slots`` int64 ``[n]`` of ``slab`` float32
    ``[C, W]``: row ``fresh[sel[i]]`` (``fresh`` float32 ``[M, dim]``; ``dim`` 0: rows
    live elsewhere), nothing pending, ``CLOCK = clocks[i]``, ``CHECKED = seq``, ``PF =
    pf``, every other word zero; a narrow ``kind`` stores the rows as they are (they
    are values of that type). False (nothing written) where the kernel is not
    available."""
    lib = _library()
    if lib is None or not _ok(slab, slots, sel, clocks) or (dim and not _ok(fresh)):
        return False
    int64 = slots.dtype == sel.dtype == clocks.dtype == np.int64
    if not int64 or slab.dtype != np.float32 or (dim and fresh.dtype != np.float32):
        return False
    n = slots.size
    assert sel.size == n and clocks.size == n
    lib.hr_cache_install(
        n, dim, row_words(dim, kind), kind, slab.shape[1], slots.ctypes.data,
        fresh.ctypes.data if dim else None,
        sel.ctypes.data, clocks.ctypes.data, seq, pf, slab.ctypes.data,
    )  # fmt: skip
    return True


Evicted = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def update_rows(
    slab: np.ndarray,
    dim: int,
    slots: np.ndarray,
    own8: np.ndarray,
    grads: np.ndarray,
    *,
    lr: float,
    write_bound: int,
    seq: int,
    stat_dim: int = 0,
    stat_at: int = 0,
    acc_at: int = -1,
    eps: float = 0.0,
    kind: int = 0,
    seed: int = 0,
    row_ids: np.ndarray | None = None,
    ids: np.ndarray | None = None,
    evicted: Evicted | None = None,
    values: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Apply ``grads`` float32 ``[S, D]`` to the records of ``slots`` int64 ``[S]`` (-1:
    skipped) of ``slab`` float32 ``[C, W]`` in place, and ``own8`` uint8 ``[C]`` with
    their ``OWN`` (see the module docstring); with
    ``stat_dim`` ``Q`` > 0 each record also sums the statistic of a counted push at
    float ``stat_at`` (``Q`` = 1: ``mean(g ** 2)``; ``Q`` = ``D``: ``g ** 2``). The copy's
    step: SGD of ``lr``, or with ``acc_at`` >= 0 row-wise Adagrad's (``lr``, ``eps``) with
    the row's accumulator at float ``acc_at`` of the record. Rows of a narrow ``kind``
    step on a float32 copy, rounded back stochastically with ``ps.rounding``'s bits of
    ``(seed, row_ids[slot] int64 [C], version -1 - seq, column)``.

    Returns ``(due, due_grads, due_counts, due_stats, None)``: positions int64 ``[K]``
    into ``slots`` of the rows to push now, their gradients float32 ``[K, D]``, update
    counts int64 ``[K]`` and statistics float32 ``[K, Q]`` (fresh arrays), or None
    (nothing changed) where the kernel is not available.

    With ``ids`` (the batch's, int64 ``[S]``, increasing) the pass writes the whole push
    in id order, as the store walks it: the due rows, the rows not cached (their
    gradient, one update, statistic zero; position ``i``) and ``evicted`` ``(ids [E],
    sums [E, D], counts [E] or None: one each, statistics [E, Q] or None: zeros)``, the
    pending sums of rows evicted since the last push (ids increasing, none among
    ``ids``; position -1), merged in; the last item is then the push's ids ``[P]``.

    ``values`` (float32 rows only): the cache writes its copies back instead of gradient
    sums. Nothing is summed; a row due gives its row after the step in ``due_grads``, its
    optimizer state (``stat_dim`` floats at ``stat_at``: pass the state's) in
    ``due_stats`` and in ``due_counts`` the PS clock the write gives it, ``CLOCK + OWN +
    1``. ``evicted`` then holds writes in the same form (rows, clocks, state).
    """
    lib = _library()
    if lib is None or not _ok(slab, grads, slots, own8, row_ids) or (kind and row_ids is None):
        return None
    assert not (values and kind), "writes of copies take float32 rows"
    if own8.dtype != np.uint8:
        return None
    if ids is not None and not (
        ids.dtype == np.int64 and ids.flags.c_contiguous and ids.size == slots.size
    ):
        return None
    n = slots.size
    assert grads.shape == (n, dim)
    e_ids = e_g = e_k = e_s = None
    if evicted is not None:
        e_ids, e_g, e_k, e_s = evicted
        if not _ok(e_ids, e_g, e_k, e_s) or e_g.dtype != np.float32:
            return None
        assert e_g.shape == (e_ids.size, dim) and (e_s is None or e_s.shape[1] == stat_dim)
    ne = 0 if e_ids is None else e_ids.size
    due = np.empty(n + ne, dtype=np.int64)
    due_g = np.empty((n + ne, dim), dtype=np.float32)
    due_k = np.empty(n + ne, dtype=np.int64)
    due_s = np.empty((n + ne, stat_dim), dtype=np.float32)
    out_ids = None if ids is None else np.empty(n + ne, dtype=np.int64)

    def ptr(a: np.ndarray | None) -> int | None:
        return None if a is None else a.ctypes.data

    k = lib.hr_cache_update(
        n, dim, row_words(dim, kind), kind, slab.shape[1], slots.ctypes.data, ptr(row_ids), seed,
        grads.ctypes.data, slab.ctypes.data, own8.ctypes.data, lr, write_bound, int(values),
        seq, stat_dim,
        stat_at, acc_at, eps, due.ctypes.data, due_g.ctypes.data, due_k.ctypes.data,
        due_s.ctypes.data, ptr(ids), ne, ptr(e_ids), ptr(e_g), ptr(e_k), ptr(e_s), ptr(out_ids),
        torch.get_num_threads(),
    )  # fmt: skip
    if k < 0:  # out of memory for a narrow row's float32 copy: nothing changed
        return None
    return due[:k], due_g[:k], due_k[:k], due_s[:k], None if out_ids is None else out_ids[:k]


def evict_rows(
    slab: np.ndarray,
    dim: int,
    victims: np.ndarray,
    row_id: np.ndarray,
    index_map: np.ndarray,
    key: np.ndarray,
    *,
    row_floats: int,
    meta_at: int,
    stat_at: int,
    stat_dim: int,
    counted: bool,
    free_key: int,
) -> Evicted | None:
    """Evict the distinct ``victims`` int64 ``[n]`` (slots) of ``slab`` float32 ``[C, W]``:
    for the records with pending updates (``COUNT`` > 0), in ``victims``' order, their row
    ids int64 ``[p]``, pending sums float32 ``[p, dim]`` (at float ``row_floats``) and,
    where pushes are ``counted``, their counts int64 ``[p]`` and statistics float32 ``[p,
    stat_dim]`` (at float ``stat_at``; else None and None), their ``COUNT`` cleared; every
    victim's entry of the dense id map ``index_map`` int32 ``[num_rows]`` set to -1, its
    ``row_id`` (int64 ``[C]``) to -1 and its eviction ``key`` (int64 ``[C]``) to
    ``free_key``. None (nothing changed) where the kernel is not available."""
    lib = _library()
    if lib is None or not _ok(slab, victims, row_id, index_map, key) or slab.dtype != np.float32:
        return None
    if not victims.dtype == row_id.dtype == key.dtype == np.int64 or index_map.dtype != np.int32:
        return None
    n = victims.size
    ids = np.empty(n, dtype=np.int64)
    sums = np.empty((n, dim), dtype=np.float32)
    counts = np.empty(n, dtype=np.int64) if counted else None
    stats = np.empty((n, stat_dim), dtype=np.float32) if counted else None
    p = lib.hr_cache_evict(
        n, dim, row_floats, slab.shape[1], meta_at, stat_at, stat_dim if counted else 0,
        victims.ctypes.data, slab.ctypes.data, row_id.ctypes.data, index_map.ctypes.data,
        key.ctypes.data, free_key, ids.ctypes.data, sums.ctypes.data,
        None if counts is None else counts.ctypes.data,
        None if stats is None else stats.ctypes.data,
    )  # fmt: skip
    if counts is None or stats is None:
        return ids[:p], sums[:p], None, None
    return ids[:p], sums[:p], counts[:p], stats[:p]
