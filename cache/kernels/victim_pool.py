"""C kernel of TinyLFU's pool of victims (:meth:`cache.policy.EvictionPolicy.ordered_victims`):
the first ``k`` entries still valid, in one pass.

The numpy path reads the pool in windows that double until they hold ``k`` valid
entries, each window a gather of keys and marks and a few temporaries, after marking
the protected slots (every cached id of the current and the next batch: ~90 k random
writes a step in the cache benchmark, and as many to clear them). This pass marks,
scans with the keys and marks of the entries ahead prefetched, stops at the ``k``-th
valid entry and clears. The same entries in the same order (``tests/cache/
test_cache_kernel.py``). Built by :mod:`comm.native`; :func:`pool_valid` returns None
where that is not possible and the caller takes its numpy path.
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
    """The first ``k`` entries ``s`` of ``pool`` int64 ``[n]`` (in its order) with
    ``key[s] == then[j]``, ``key[s] & low < tick`` and ``s`` not in ``protect`` int64
    ``[m]`` (entries < 0 ignored): int64 ``[<= k]``. ``key`` int64 ``[C]``; ``marks``
    bool ``[C]``, all False, is the scratch the protected slots are marked in (all False
    again on return). None where the kernel is not available."""
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
