"""C kernel admitting a pull's misses in one pass, once the admission is decided.

Admitting the misses a pull chose (:meth:`cache.table_cache.TableCache._admit_rows`)
took six steps, each its own call over a few thousand random slots: evict the victims
(:func:`cache.kernels.records.evict_rows`), push them on the free stack, pop the new
rows' slots, write the dense id -> slot map and the slots' row ids, write the fresh
records (:func:`cache.kernels.records.install_rows`), then their ``own8`` bytes and
optimizer state. This pass does the six with the records, map entries and row ids ahead
prefetched, by the same ``evict_one`` and ``install_one`` as those passes (``admit.c``
is compiled after ``records.c``), so the bits are theirs. The pass is memory-bound (a
few random lines per victim and per new row); in the cache benchmark's steady state it
took the admission from 0.51 to 0.44 ms a step (cold, medians of 14 alternations).

Built by :mod:`comm.native`; :func:`admit_rows` returns None (nothing changed) where
that is not possible and the caller takes those steps one by one (the same records,
map, row ids, keys, free stack and pending sums: ``tests/cache/test_cache_kernel.py``).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from cache.kernels import records
from comm.native import kernel_source, load_c_library

# admit.c, compiled after the records' library source (its evict_one and install_one)
_SOURCE = kernel_source(__package__, "admit")
_LIBRARY_SOURCE = records._LIBRARY_SOURCE + "\n" + _SOURCE


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_admit", _LIBRARY_SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_cache_admit.restype = i64
    lib.hr_cache_admit.argtypes = [i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.hr_cache_admit.argtypes += [i64] * 5 + [ptr] * 4 + [i64] + [ptr] * 5 + [i64, i64]
    lib.hr_cache_admit.argtypes += [ptr] * 6 + [i64]


class Admitted(NamedTuple):
    """What :func:`admit_rows` did: the new rows' ``slots`` int64 ``[n]`` and the evicted
    rows with pending updates, in the victims' order: their ``ids`` ``[p]``, pending
    ``sums`` float32 ``[p, D]`` and, with counted pushes, ``counts`` ``[p]`` and
    statistics ``stats`` float32 ``[p, Q]`` (else None and None)."""

    slots: np.ndarray
    ids: np.ndarray
    sums: np.ndarray
    counts: np.ndarray | None
    stats: np.ndarray | None


class Records(NamedTuple):
    """A table cache's host records and their indexes, as the pass writes them:
    ``slab`` float32 ``[C, W]`` (rows of ``dim`` elements of ``kind``, then the pending
    sums at float ``row_floats``, metadata at ``meta_at``, statistics ``[stat_dim]`` at
    ``stat_at`` where pushes are ``counted``, optimizer state ``[state_dim]`` at
    ``state_at``), ``row_id`` int64 ``[C]``, the dense id map int32 ``[num_rows]``, the
    eviction keys int64 ``[C]`` (``free_key``: an empty slot), ``own8`` uint8 ``[C]`` and
    the free stack int64 ``[C]``. ``values``: the cache writes its copies back, so a
    victim with pending updates gives its row and state instead of a sum and statistics
    (as if counted: ``counts`` are then its ``COUNT``)."""

    slab: np.ndarray
    dim: int
    kind: int
    row_floats: int
    stat_at: int
    stat_dim: int
    counted: bool
    state_at: int
    state_dim: int
    row_id: np.ndarray
    index_map: np.ndarray
    key: np.ndarray
    free_key: int
    own8: np.ndarray
    free: np.ndarray
    values: bool = False


def _fits(rec: Records, *arrays: np.ndarray) -> bool:
    """Whether the pass can take ``rec`` and ``(victims, ids, fresh, sel, fresh_clock)``:
    C-contiguous arrays of the types it reads."""
    victims, ids, fresh, sel, fresh_clock = arrays
    every = (rec.slab, rec.row_id, rec.index_map, rec.key, rec.own8, rec.free, *arrays)
    if not all(a.flags.c_contiguous for a in every):
        return False
    int64 = (victims, ids, sel, fresh_clock, rec.row_id, rec.key, rec.free)
    typed = rec.slab.dtype == np.float32 and (rec.dim == 0 or fresh.dtype == np.float32)
    typed = typed and rec.index_map.dtype == np.int32 and rec.own8.dtype == np.uint8
    return typed and all(a.dtype == np.int64 for a in int64)


def admit_rows(
    rec: Records,
    n_free: int,
    victims: np.ndarray,
    ids: np.ndarray,
    fresh: np.ndarray,
    sel: np.ndarray,
    fresh_clock: np.ndarray,
    fresh_state: np.ndarray | None,
    *,
    seq: int,
    pf: int,
) -> Admitted | None:
    """Evict the distinct slots ``victims`` int64 ``[V]`` (pushed on the free stack
    ``rec.free[:n_free]``, top last), then give the first ``n = min(K, n_free + V)`` of the
    distinct, uncached ``ids`` int64 ``[K]`` the top slots of the stack, each a fresh
    record of the store's reply: row ``fresh[sel[i]]`` (float32 ``[M, dim]``), read at
    ``fresh_clock[sel[i]]`` (int64 ``[M]``) by request ``seq``, prefetch mark ``pf``, and
    optimizer state ``fresh_state[sel[i]]`` (float32 ``[M, state_dim]``; None: left
    zero), with ``own8`` 0. The caller's stack then holds ``n_free + V - n`` slots. None
    (nothing changed) where the kernel is not available."""
    lib = _library()
    if lib is None or not _fits(rec, victims, ids, fresh, sel, fresh_clock):
        return None
    if rec.state_dim == 0:
        fresh_state = None  # no state in the records: nothing to write
    if fresh_state is not None and not (
        fresh_state.dtype == np.float32 and fresh_state.flags.c_contiguous
    ):
        return None
    v, k, d = victims.size, ids.size, rec.dim
    assert sel.size >= min(k, n_free + v)
    counted, sum_at, stat_at, q = rec.counted, rec.row_floats, rec.stat_at, rec.stat_dim
    if rec.values:  # the victims' rows and state (as if counted)
        counted, sum_at, stat_at, q = True, 0, rec.state_at, rec.state_dim
    out_ids = np.empty(v, dtype=np.int64)
    sums = np.empty((v, d), dtype=np.float32)
    counts = np.empty(v, dtype=np.int64) if counted else None
    stats = np.empty((v, q), dtype=np.float32) if counted else None
    q = q if counted else 0
    slots = np.empty(min(k, n_free + v), dtype=np.int64)
    pending = np.zeros(1, dtype=np.int64)
    n = lib.hr_cache_admit(
        v, victims.ctypes.data, k, ids.ctypes.data, rec.free.ctypes.data, n_free, d,
        rec.row_floats, rec.kind, rec.slab.shape[1], stat_at, q, rec.state_at,
        rec.state_dim, rec.slab.ctypes.data, rec.row_id.ctypes.data, rec.index_map.ctypes.data,
        rec.key.ctypes.data, rec.free_key, rec.own8.ctypes.data,
        fresh.ctypes.data if d else None, sel.ctypes.data, fresh_clock.ctypes.data,
        None if fresh_state is None else fresh_state.ctypes.data, seq, pf,
        out_ids.ctypes.data, sums.ctypes.data, None if counts is None else counts.ctypes.data,
        None if stats is None else stats.ctypes.data, pending.ctypes.data, slots.ctypes.data,
        sum_at,
    )  # fmt: skip
    assert n == slots.size
    p = int(pending[0])
    return Admitted(
        slots, out_ids[:p], sums[:p], None if counts is None else counts[:p],
        None if stats is None else stats[:p],
    )  # fmt: skip
