"""C kernel planning a sole writer's serving pull in one pass over the batch's ids.

Planning a serving pull of a cache that is its tables' only writer
(:meth:`cache.table_cache.TableCache.plan`) takes three passes over the batch's distinct
ids, each a random access per id into a structure larger than the CPU caches: counting
each id in TinyLFU's sketch (:mod:`cache.sketch`), looking its slot up in the dense id ->
slot map (:class:`cache.slot_index.DenseSlotIndex`), and deciding what to ask the store
(:func:`cache.kernels.records.sole_writer_asks`); then every cached row is marked used
by the batch in the eviction policy's keys. One pass does the four, with the sketch
line, map entry and key of the ids ahead prefetched, so their misses overlap. The
sketch's estimates need every id counted first, so they are a second loop of the same
call (:func:`cache.kernels.sketch.min_counts`'s), which with TinyLFU also writes the
cached rows' keys with their estimates (as serving them would). Where the count brings
a halving, the caller halves the estimates too: ``min(c >> 1) == min(c) >> 1``,
shifting being monotone.

Built by :mod:`comm.native` from ``sketch.c`` and ``plan_pull.c`` (the sketch's own hash);
:func:`plan_pull` returns None where that is not possible and the caller takes the three
passes (the same counts, slots, asks and keys: ``tests/cache/test_cache_kernel.py``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from cache.policy import FREQ_MAX, TICK_BITS
from comm.native import kernel_source, load_c_library

# plan_pull.c, compiled after the sketch's source (its line_of and slot_of) in one library
_SOURCE = kernel_source(__package__, "plan_pull")
_LIBRARY_SOURCE = kernel_source(__package__, "sketch") + "\n" + _SOURCE


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_plan_pull", _LIBRARY_SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_plan_pull.restype = i64
    lib.hr_plan_pull.argtypes = [i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr]
    lib.hr_plan_pull.argtypes += [i64] * 5 + [ptr, ptr, ptr, i64, ptr, i64, i64]


def _ok(*arrays: np.ndarray | None) -> bool:
    return all(a is None or a.flags.c_contiguous for a in arrays)


def plan_pull(
    ids: np.ndarray,
    slot_map: np.ndarray,
    sketch: tuple[np.ndarray, int, np.ndarray] | None,
    slab: np.ndarray,
    meta_at: int,
    own8: np.ndarray,
    *,
    own8_max: int,
    clock_word: int,
    own_word: int,
    bound: int,
    fill: int,
    keys: np.ndarray | None = None,
    tick: int = 0,
    keys_with_estimates: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """``(slots [U], asked [A], clocks [A], est [U])`` of the batch's distinct ``ids`` int64 ``[U]``
    (increasing): each id's slot in ``slot_map`` (int32, -1: not cached); the indices into
    ``ids`` of the misses and of the cached rows whose ``OWN`` (``own8`` uint8 ``[C]``
    below ``own8_max``, else the record's int64 word ``own_word``) exceeds ``bound``, with
    their copy clocks (word ``clock_word``; ``fill`` for a miss). A record's int64 words
    start ``meta_at`` floats into its row of ``slab`` float32 ``[C, W]``. ``sketch``
    ``(mult uint64 [depth], lines, counters int32 [16 * lines])``: each id is also counted
    once there (:meth:`cache.sketch.FrequencySketch.add`, without its bookkeeping),
    and ``est`` int64 ``[U]`` holds their estimates after that
    (:meth:`cache.sketch.FrequencySketch.estimate`; None without a sketch).
    ``keys`` (int64 ``[C]``, the eviction policy's keys; None: untouched): each cached
    row's key is set to ``tick``, as :meth:`cache.policy.EvictionPolicy.use` without a
    frequency sets it (the row is in use by batch ``tick``); with a sketch and
    ``keys_with_estimates``, then to what ``use`` with the frequencies ``est`` sets
    (TinyLFU's key of a served row, which the serving pass then need not write: its
    ``old_keyed``). None (nothing counted or written) where the kernel is not
    available."""
    lib = _library()
    if lib is None or not _ok(ids, slot_map, slab, own8):
        return None
    if ids.dtype != np.int64 or slot_map.dtype != np.int32 or own8.dtype != np.uint8:
        return None
    if keys is not None and (keys.dtype != np.int64 or not _ok(keys)):
        return None
    depth, mult_p, lines, counters_p, est = 0, None, 0, None, None
    if sketch is not None:
        mult, lines, counters = sketch
        if not (_ok(mult, counters) and mult.dtype == np.uint64 and counters.dtype == np.int32):
            return None
        depth, mult_p, counters_p = mult.size, mult.ctypes.data, counters.ctypes.data
        est = np.empty(ids.size, dtype=np.int64)
    n = ids.size
    slots = np.empty(n, dtype=np.int64)
    asked = np.empty(n, dtype=np.int64)
    clocks = np.empty(n, dtype=np.int64)
    k = lib.hr_plan_pull(
        n, ids.ctypes.data, slot_map.ctypes.data, slots.ctypes.data, depth, mult_p, lines,
        counters_p, meta_at, slab.shape[1], slab.ctypes.data, own8.ctypes.data, own8_max,
        clock_word, own_word, bound, fill, asked.ctypes.data, clocks.ctypes.data,
        None if keys is None else keys.ctypes.data, tick, None if est is None else est.ctypes.data,
        FREQ_MAX if keys_with_estimates else 0, TICK_BITS,
    )  # fmt: skip
    return slots, asked[:k], clocks[:k], est
