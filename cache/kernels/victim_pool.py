"""C kernels of the victim search (:meth:`cache.policy.EvictionPolicy.victims`): the slots
whose keys are among the smallest, in one pass over the keys; and of TinyLFU's pool of
victims (:meth:`cache.policy.EvictionPolicy.ordered_victims`): the first ``k`` entries
still valid, in one pass; and TinyLFU's halving of every key's frequency
(:func:`halve_keys`).

The numpy path reads the pool in windows that double until they hold ``k`` valid
entries, each window a gather of keys and marks and a few temporaries, after marking
the protected slots (every cached id of the current and the next batch: ~90 k random
writes a step in the cache benchmark, and as many to clear them). This pass marks,
scans with the keys and marks of the entries ahead prefetched, stops at the ``k``-th
valid entry and clears. The same entries in the same order (``tests/cache/
test_cache_kernel.py``). Built by :mod:`comm.native`; :func:`search_near` and
:func:`pool_valid` return None (:func:`halve_keys` False) where that is not possible and
the caller takes its numpy path.
"""

from __future__ import annotations

import ctypes

import numpy as np

from comm.native import kernel_source, load_c_library

_SOURCE = kernel_source(__package__, "victim_pool")


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_victim_pool", _SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_pool_valid.restype = i64
    lib.hr_pool_valid.argtypes = [i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr]
    lib.hr_search_near.restype = i64
    lib.hr_search_near.argtypes = [i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr]
    lib.hr_halve_keys.restype = None
    lib.hr_halve_keys.argtypes = [i64, ptr, i64, i64]


def _plain(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrays)


def pool_valid(
    pool: np.ndarray,
    then: np.ndarray,
    key: np.ndarray,
    low: int,
    tick: int,
    protect: np.ndarray | None,
    marks: np.ndarray,
    k: int,
) -> np.ndarray | None:
    """The positions ``j`` (increasing) of the first ``k`` entries ``s = pool[j]`` of
    ``pool`` int64 ``[n]`` with ``key[s] == then[j]``, ``key[s] & low < tick`` and ``s``
    not in ``protect`` int64 ``[m]`` (entries < 0 ignored): int64 ``[<= k]``. ``key``
    int64 ``[C]``; ``marks`` bool ``[C]``, all False, is the scratch the protected slots
    are marked in (all False again on return). None where the kernel is not available."""
    lib = _library()
    protect = np.empty(0, dtype=np.int64) if protect is None else protect
    protect = np.ascontiguousarray(protect, dtype=np.int64)
    if lib is None or not _plain(pool, then, key) or marks.dtype != np.bool_:
        return None
    if not marks.flags.c_contiguous or pool.size != then.size:
        return None
    out = np.empty(max(0, min(k, pool.size)), dtype=np.int64)
    r = lib.hr_pool_valid(
        pool.size, pool.ctypes.data, then.ctypes.data, key.ctypes.data, low, tick,
        protect.size, protect.ctypes.data, marks.ctypes.data, out.size, out.ctypes.data,
    )  # fmt: skip
    return out[:r]


SAMPLE = 65536  # keys in the search's strided sample, about


def search_near(
    key: np.ndarray, low: int, tick: int, protect: np.ndarray | None, marks: np.ndarray, k: int
) -> tuple[np.ndarray, int] | None:
    """``(near, candidates)`` for a victim search of ``k >= 1`` rows among the slots of
    ``key`` int64 ``[C]`` that may be evicted (key not ``FREE``, ``key & low < tick``, not
    in ``protect`` int64 ``[m]``, entries < 0 ignored): ``near`` int64 ``[r]``, increasing,
    holds every such slot whose key is among the ``k`` smallest (ties at the ``k``-th
    included; every such slot where there are at most ``k``), and ``candidates`` counts
    them all. A bound read off a strided sample of about :data:`SAMPLE` keys keeps ``near``
    near ``k`` long. ``marks`` bool ``[C]``, all False, is the scratch for the protected
    slots (all False again on return). None where the kernel is not available."""
    lib = _library()
    protect = np.empty(0, dtype=np.int64) if protect is None else protect
    protect = np.ascontiguousarray(protect, dtype=np.int64)
    if lib is None or not _plain(key) or marks.dtype != np.bool_ or not marks.flags.c_contiguous:
        return None
    c = key.size
    step = max(1, c // SAMPLE)
    sample = np.empty(c // step + 1, dtype=np.int64)
    out = np.empty(c, dtype=np.int64)  # pages touched only as far as it is written
    cand = np.zeros(1, dtype=np.int64)
    r = lib.hr_search_near(
        c, key.ctypes.data, low, tick, protect.size, protect.ctypes.data, marks.ctypes.data,
        k, step, sample.ctypes.data, out.ctypes.data, cand.ctypes.data,
    )  # fmt: skip
    return out[:r].copy(), int(cand[0])


def halve_keys(key: np.ndarray, free_key: int, low_bits: int) -> bool:
    """In place: every entry of ``key`` int64 ``[C]`` other than ``free_key`` becomes
    ``((k >> low_bits) >> 1 << low_bits) + (k & (2**low_bits - 1))`` (its high bits
    halved, its low ``low_bits`` kept). False where the kernel is not available (nothing
    changed)."""
    lib = _library()
    if lib is None or not _plain(key) or not key.flags.writeable:
        return False
    lib.hr_halve_keys(key.size, key.ctypes.data, free_key, low_bits)
    return True
