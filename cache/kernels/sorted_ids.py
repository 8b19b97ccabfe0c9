"""C kernel over sorted id arrays: the ids of one not in another, in one merge pass.

A prefetch planned with a serving pull leaves out the pull's ids
(:meth:`cache.table_cache.TableCache.plan`); both are sorted and distinct, ~26 k ids
each in a DLRM step of 26 tables, where numpy's binary search of every id took ~0.8 ms.
Built by :mod:`comm.native`; :func:`sorted_difference` returns None where that is not
possible and the caller takes its numpy path (the same ids).
"""

from __future__ import annotations

import ctypes

import numpy as np

from comm.native import kernel_source, load_c_library

_SOURCE = kernel_source(__package__, "sorted_ids")


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_sorted_ids", _SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_sorted_difference.restype = i64
    lib.hr_sorted_difference.argtypes = [i64, ptr, i64, ptr, ptr]


def sorted_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The ids of ``a`` int64 ``[N]`` not in ``b`` int64 ``[M]`` (both strictly
    increasing), in order: int64 ``[R]``; None where the kernel is not available."""
    lib = _library()
    if lib is None:
        return None
    a = np.ascontiguousarray(a, dtype=np.int64)
    b = np.ascontiguousarray(b, dtype=np.int64)
    out = np.empty(a.size, dtype=np.int64)
    r = lib.hr_sorted_difference(a.size, a.ctypes.data, b.size, b.ctypes.data, out.ctypes.data)
    return out[:r]
