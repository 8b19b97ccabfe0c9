"""A C kernel for DLRM's pairwise dot interaction on CPU (float32).

``torch.bmm`` runs the per-sample ``[N, D] x [D, N]`` products (N = 27, D = 64 in
the benchmark) at ~21 GFLOP/s single-thread: each is far too small for MKL's
blocking, and half of the Gram matrix is thrown away. This kernel keeps one
sample's ``[N, D]`` block in L1 and computes only what is needed:

* forward: ``out[b] = [t[b, 0] | t_i . t_j for i > j, row-major | zeros to W]``
  (the top MLP's padded input, written once);
* backward: ``dt[b, i] = sum_{j != i} g_sym[i, j] t[b, j]`` (+ ``g[b, :D]`` for
  row 0 when the first vector is passed through), accumulated in registers.

Single-thread CPU time, B = 2048, N = 27, D = 64 (AVX2): forward 3.4 ms vs 12 ms,
backward 3.8 ms vs ~9.5 ms for the torch path (``docs/dlrm_bench.md``). Samples are
split over ``torch.get_num_threads()`` OpenMP threads. Numerics: the same products
summed in another order (float32 rounding only); float64 and non-CPU tensors take
the torch path, as does everything when the library cannot be built
(:mod:`comm.native`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from comm.native import kernel_source, load_c_library

# The C source: interaction.c next to this file (package data).
_SOURCE = kernel_source(__package__, "interaction")


def _load() -> ctypes.CDLL | None:
    return load_c_library("hr_interaction", _SOURCE, _declare)  # kept after the first call


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.hr_interaction_fwd.restype = None
    lib.hr_interaction_fwd.argtypes = [i64, i64, i64, ptr, i64, ptr, i64, cint, cint]
    lib.hr_interaction_bwd.restype = None
    lib.hr_interaction_bwd.argtypes = [i64, i64, i64, ptr, i64, ptr, i64, cint, ptr, cint]


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel handles tensors like ``t``: float32, CPU, library built here,
    and not being traced (``torch.export`` / ``torch.compile`` see fake tensors with no
    memory for the kernel to read, and record the torch path instead)."""
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and _load() is not None
    )


Rows = torch.Tensor | Sequence[torch.Tensor]


def _row_pointers(rows: Rows) -> tuple[ctypes.Array[ctypes.c_void_p], int, int, int, int]:
    """``(pointers [N], stride, B, N, D)`` of ``[B, N, D]`` or N contiguous ``[B, D]``."""
    if isinstance(rows, torch.Tensor):
        assert rows.is_contiguous()
        b, n, d = rows.shape
        base, size = rows.data_ptr(), rows.element_size()
        addrs = [base + i * d * size for i in range(n)]
        stride = n * d
    else:
        assert all(r.is_contiguous() for r in rows)
        b, d = rows[0].shape
        n = len(rows)
        addrs = [r.data_ptr() for r in rows]
        stride = d
    return (ctypes.c_void_p * n)(*addrs), stride, b, n, d


def forward(rows: Rows, *, with_first: bool, width: int) -> torch.Tensor:
    """``[B, width]``: ``[row 0 if with_first | pairs | zeros]`` of ``rows``, one
    contiguous ``[B, N, D]`` tensor or N contiguous ``[B, D]`` tensors (call only
    where :func:`usable`)."""
    lib = _load()
    assert lib is not None
    ptrs, stride, b, n, d = _row_pointers(rows)
    out = torch.empty(b, width, dtype=torch.float32)
    nt = torch.get_num_threads()
    lib.hr_interaction_fwd(b, n, d, ptrs, stride, out.data_ptr(), width, int(with_first), nt)
    return out


def backward(rows: Rows, grad: torch.Tensor, *, with_first: bool) -> torch.Tensor:
    """``[B, N, D]``: the gradient w.r.t. the rows of :func:`forward` given ``grad``
    ``[B, width]``."""
    lib = _load()
    assert lib is not None
    grad = grad.contiguous()
    ptrs, stride, b, n, d = _row_pointers(rows)
    out = torch.empty(b, n, d, dtype=torch.float32)
    nt = torch.get_num_threads()
    lib.hr_interaction_bwd(
        b, n, d, ptrs, stride, grad.data_ptr(), grad.shape[1], int(with_first), out.data_ptr(), nt
    )
    return out
