"""C kernel packing the ids of a table group's requests
(:meth:`cache.table_group.TableGroup.pack_many`): each part range-checked and moved to
its table's place in the group's id space, in one pass. A step packs a cache's ids up
to three times (the prefetch, the pull, the push), ~30 k ids of 26 tables each; numpy
needs five passes and a temporary for it. Built by :mod:`comm.native`; :func:`pack_ids`
returns None where that is not possible and the caller takes its numpy path (the same
ids, the same errors).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from comm.native import kernel_source, load_c_library

_SOURCE = kernel_source(__package__, "pack_ids")


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_cache_pack_ids", _SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_pack_ids.restype = i64
    lib.hr_pack_ids.argtypes = [i64, ptr, ptr, ptr, ptr, ptr]


def pack_ids(
    parts: list[torch.Tensor], base: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, int] | None:
    """``(packed, bad)``: the int64 CPU tensors ``parts`` ``[k]`` of ``[n_j]`` ids one
    after the other, part ``j``'s ids plus ``base[j]`` (int64 ``[N]``), and the first part
    with an id outside ``0 .. rows[j] - 1`` (-1: none; ``packed`` is then incomplete).
    None where the kernel is not available or a part is not contiguous."""
    lib = _library()
    if lib is None or not all(p.is_contiguous() for p in parts):
        return None
    k = len(parts)
    sizes = np.fromiter((p.numel() for p in parts), dtype=np.int64, count=k)
    ptrs = np.fromiter((p.data_ptr() for p in parts), dtype=np.uint64, count=k)
    base = np.ascontiguousarray(base, dtype=np.int64)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    bad = lib.hr_pack_ids(
        k, ptrs.ctypes.data, sizes.ctypes.data, base.ctypes.data, rows.ctypes.data,
        out.ctypes.data,
    )  # fmt: skip
    return out, int(bad)
