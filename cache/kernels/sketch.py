"""C kernels of the frequency sketch (:mod:`cache.sketch`): hash, then count or take the
minimum, one pass over the ids with the counter line of the ids ahead prefetched.

The numpy/torch path materialises ``[depth, N]`` hashes and positions, then scatters or
gathers them; the counters are larger than the CPU caches (``4 * depth * width`` bytes),
so what costs is the random counter accesses: one 64-byte line per id (every counter of
an id sits in one line, ``sketch.c``), which this pass overlaps. Integer
arithmetic: both paths give the same counts (``tests/cache/test_cache_kernel.py``). Built by
:mod:`comm.native`; each function returns False/None where that is not possible and the
caller takes its torch path.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from comm.native import kernel_source, load_c_library

_SOURCE = kernel_source(__package__, "sketch")


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_sketch", _SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_sketch_add.restype = None
    lib.hr_sketch_add.argtypes = [i64, ptr, i64, ptr, i64, ptr]
    lib.hr_sketch_estimate.restype = None
    lib.hr_sketch_estimate.argtypes = [i64, ptr, i64, ptr, i64, ptr, ptr]


def _usable(ids: np.ndarray, mult: np.ndarray, counters: torch.Tensor) -> bool:
    return (
        ids.dtype == np.int64
        and ids.flags.c_contiguous
        and mult.dtype == np.uint64
        and mult.flags.c_contiguous
        and counters.dtype == torch.int32
        and counters.is_contiguous()
        and counters.device.type == "cpu"
    )


def add_counts(ids: np.ndarray, mult: np.ndarray, lines: int, counters: torch.Tensor) -> bool:
    """``counters`` (int32 ``[16 * lines]``) += 1 at each id's ``depth`` positions
    (``mult`` uint64 ``[depth]``); False (nothing counted) where the kernel is not
    available."""
    lib = _library()
    if lib is None or not _usable(ids, mult, counters):
        return False
    lib.hr_sketch_add(
        ids.size, ids.ctypes.data, mult.size, mult.ctypes.data, lines, counters.data_ptr()
    )
    return True


def min_counts(
    ids: np.ndarray, mult: np.ndarray, lines: int, counters: torch.Tensor
) -> np.ndarray | None:
    """The minimum over the ``depth`` counters of each id, int64 ``[N]``; None where the
    kernel is not available."""
    lib = _library()
    if lib is None or not _usable(ids, mult, counters):
        return None
    out = np.empty(ids.size, dtype=np.int64)
    lib.hr_sketch_estimate(
        ids.size, ids.ctypes.data, mult.size, mult.ctypes.data, lines, counters.data_ptr(),
        out.ctypes.data,
    )  # fmt: skip
    return out
