"""A small C kernel for row-wise Adagrad on the CPU, in place on the touched rows.

Two callers: the embedding collection's fused backward (per-id gradients of a lookup)
and :class:`ps.local.table.LocalTable`'s push (already summed gradients per unique row).

The torch path (:func:`embedding.fused_ops.row_gradients` then
:func:`embedding.fused_ops.apply_optimizer`) coalesces the per-id gradients into a
``[U, D]`` tensor, gathers the touched rows and state, runs the ps optimizer on the
copies and scatters them back: five passes over ``[U, D]`` plus per-row overheads of
``index_copy_``. This kernel does it in ONE pass per unique row, in place::

    for each run of equal rows r in the sorted ids (positions i of the run):
        g      = sum_i w_i * grad_out[bag_i]           # [D], in a small buffer
        s[r]  += mean(g ** 2)
        W[r]  += -lr * (g / (sqrt(s[r]) + eps))         # ps.RowWiseAdagrad.apply
        clocks[r] += 1

Measured single-thread CPU time, 26 tables x 100k x 64, batch 2048, Zipf(1.05)
(53k ids, 41k unique): torch path 22 ms (coalesce 5.5 + optimizer 16.6), kernel
about 4 ms plus the 1.3 ms sort (see docs/dlrm_bench.md).

It is plain C (no torch headers, so it builds in well under a second) compiled on
first use with the system C compiler into a per-user cache
(``$HYBRIDREC_KERNEL_DIR``, default ``~/.cache/hybridrec/kernels``; the key hashes
source, compiler, flags and CPU) and called via ``ctypes`` on the tensors' data
pointers. Where there is no compiler, or
``HYBRIDREC_CPU_KERNEL=0`` is set, :func:`load` returns None and the callers take
the torch path, which runs the identical math (tests compare the two).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from comm.native import kernel_source, load_c_library

# The C source: rowwise_adagrad.c next to this file (package data).
_SOURCE = kernel_source(__package__, "rowwise_adagrad")


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it is disabled
    (``HYBRIDREC_CPU_KERNEL=0``), no C compiler is found, or the build fails."""
    return load_c_library("hr_rowwise_adagrad", _SOURCE, _declare)  # kept after the first call


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of the kernel, set once per library (ctypes then converts them)."""
    fn = lib.hr_rowwise_adagrad
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.restype = ctypes.c_int
    fn.argtypes = [i64] * 3 + [ptr] * 8 + [f32, f32, ctypes.c_int]
    lib.hr_rowwise_adagrad_counted.restype = None
    lib.hr_rowwise_adagrad_counted.argtypes = [i64] * 3 + [ptr] * 7 + [f32, f32]
    lib.hr_sort_ids.restype = ctypes.c_int
    lib.hr_sort_ids.argtypes = [i64, ptr, ptr, ptr]
    lib.hr_dedup_ids.restype = i64
    lib.hr_dedup_ids.argtypes = [i64] + [ptr] * 5
    parts = lib.hr_rowwise_adagrad_parts
    parts.restype = ctypes.c_int
    args: list[Any] = [i64] * 3 + [ptr] * 3 + [i64, ptr, i64] + [ptr] * 6
    parts.argtypes = [*args, f32, f32, ctypes.c_int]
    sums = lib.hr_segment_sum_parts
    sums.restype = ctypes.c_int
    sum_args: list[Any] = [i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    sums.argtypes = [*sum_args, ctypes.c_int]


def available() -> bool:
    """Whether :func:`rowwise_adagrad_` runs the C kernel here."""
    return load() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rowwise_adagrad_counted_(
    weight: torch.Tensor,
    state: torch.Tensor,
    clocks: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    counts: torch.Tensor,
    stats: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> bool:
    """A counted push of distinct ``rows`` int64 ``[N]`` in place (the C form of
    :meth:`ps.Optimizer.apply_counted`'s sub-steps for row-wise Adagrad): ``grad``
    ``[N, D]`` the sums, ``counts`` int64 ``[N]``, ``stats`` ``[N, 1]`` the sums of
    ``mean(g ** 2)``; clocks + 1. False (nothing changed) where the kernel is not
    available or the tensors do not fit it."""
    lib = load()
    if lib is None:
        return False
    d = weight.shape[1]
    tensors = (weight, state, clocks, rows, grad, counts, stats)
    if any(not t.is_cpu or not t.is_contiguous() for t in tensors):
        return False
    floats = (weight, state, grad, stats)
    if any(t.dtype != torch.float32 for t in floats) or state.shape[1] < 1:
        return False
    if any(t.dtype != torch.int64 for t in (clocks, rows, counts)) or grad.shape[1] != d:
        return False
    lib.hr_rowwise_adagrad_counted(
        rows.numel(), d, state.stride(0), _ptr(rows), _ptr(counts), _ptr(stats), _ptr(grad),
        _ptr(weight), _ptr(state), _ptr(clocks), float(lr), float(eps),
    )  # fmt: skip
    return True


def rowwise_adagrad_(
    weight: torch.Tensor,
    state: torch.Tensor,
    clocks: torch.Tensor,
    sorted_ids: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
    perm: torch.Tensor | None = None,
    bag_of: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> bool:
    """Row-wise Adagrad in place on the rows in ``sorted_ids`` (int64 ``[N]``, sorted;
    repeats allowed). Occurrence ``i`` is original position ``p = perm[i]`` (identity
    if None) with gradient ``weights[p] * grad[bag_of[p]]`` (``weights`` None: 1;
    ``bag_of`` None: row ``p`` of ``grad``). ``weight`` ``[R, D]``, ``state``
    ``[R, S]`` (column 0 is the accumulator), ``clocks`` ``[R]`` int64, ``grad``
    ``[M, D]``: contiguous CPU tensors; float32 except the int64 indices.

    Returns False (and changes nothing) where the kernel is not available or the
    tensors do not fit it; the caller then takes the torch path.
    """
    lib = load()
    if lib is None:
        return False
    d = weight.shape[1]
    for t in (weight, state, clocks, sorted_ids, grad, perm, bag_of, weights):
        if t is not None and (not t.is_cpu or not t.is_contiguous()):
            return False
    if weight.dtype != torch.float32 or state.dtype != torch.float32 or state.shape[1] < 1:
        return False
    if grad.dtype != torch.float32 or grad.dim() != 2 or grad.shape[1] != d:
        return False
    if weights is not None and weights.dtype != torch.float32:
        return False
    if any(t is not None and t.dtype != torch.int64 for t in (clocks, sorted_ids, perm, bag_of)):
        return False
    rc = lib.hr_rowwise_adagrad(
        sorted_ids.numel(),
        d,
        state.stride(0),
        _ptr(sorted_ids),
        _ptr(perm),
        _ptr(bag_of),
        _ptr(weights),
        _ptr(grad),
        _ptr(weight),
        _ptr(state),
        _ptr(clocks),
        float(lr),
        float(eps),
        torch.get_num_threads(),
    )
    return bool(rc == 0)


def _parts_info(
    parts: list[torch.Tensor], d: int, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, int] | None:
    """``([3, P] rows / address / row stride (floats) of the parts, nbags)`` for the
    kernels' parts form, or None where a part does not fit (float32 CPU ``[n_f, d]``,
    elements contiguous) or ``offsets`` does not match."""
    for g in parts:
        if g.dtype != torch.float32 or not g.is_cpu or g.dim() != 2 or g.shape[1] != d:
            return None
        if g.shape[1] > 1 and g.stride(1) != 1:
            return None
    nbags = sum(int(g.shape[0]) for g in parts)
    if offsets is not None and offsets.numel() != nbags + 1:
        return None
    rows = [[int(g.shape[0]), g.data_ptr(), g.stride(0)] for g in parts]
    info = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    return info, nbags


def _fits(
    float_tensors: tuple[torch.Tensor | None, ...], int_tensors: tuple[torch.Tensor | None, ...]
) -> bool:
    """Contiguous CPU tensors of float32 and int64 (None entries are absent)."""
    for t, dtype in [(t, torch.float32) for t in float_tensors] + [
        (t, torch.int64) for t in int_tensors
    ]:
        if t is not None and (not t.is_cpu or not t.is_contiguous() or t.dtype != dtype):
            return False
    return True


def rowwise_adagrad_parts_(
    weight: torch.Tensor,
    state: torch.Tensor,
    clocks: torch.Tensor,
    sorted_ids: torch.Tensor,
    perm: torch.Tensor,
    offsets: torch.Tensor | None,
    parts: list[torch.Tensor],
    *,
    lr: float,
    eps: float,
    weights: torch.Tensor | None = None,
) -> bool:
    """:func:`rowwise_adagrad_` with the bags' gradients in ``parts`` (``[n_f, D]``
    each, rows of stride ``stride(0)``, elements contiguous), read in place: bag ``k``
    is row ``k`` of the parts laid end to end (one part per feature, as autograd hands
    a split output's gradients back, so no ``[nbags, D]`` concatenation is built).
    Occurrence ``p`` belongs to bag ``b`` with ``offsets[b] <= p < offsets[b + 1]``
    (``offsets`` int64 ``[nbags + 1]``; None: bag ``p``).

    False (nothing changed) where the kernel is not available or a tensor does not fit.
    """
    lib = load()
    if lib is None or state.shape[1] < 1:
        return False
    if not _fits((weight, state, weights), (clocks, sorted_ids, perm, offsets)):
        return False
    d = weight.shape[1]
    got = _parts_info(parts, d, offsets)
    if got is None:
        return False
    info, nbags = got
    rc = lib.hr_rowwise_adagrad_parts(
        sorted_ids.numel(), d, state.stride(0),
        _ptr(sorted_ids), _ptr(perm), _ptr(offsets), nbags, _ptr(weights),
        len(parts), info[0].data_ptr(), info[1].data_ptr(), info[2].data_ptr(),
        _ptr(weight), _ptr(state), _ptr(clocks),
        float(lr), float(eps), torch.get_num_threads(),
    )  # fmt: skip
    return bool(rc == 0)


def segment_sum_parts(
    perm: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor | None,
    parts: list[torch.Tensor],
    dim: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Row gradients ``[U, dim]`` float32: run ``u`` (``counts[u]`` consecutive entries
    of ``perm`` int64 ``[N]``) sums ``weights[p] * grad(bag of p)`` over its positions
    ``p``, the bags' gradients read in place from ``parts`` (as in
    :func:`rowwise_adagrad_parts_`). None where the kernel is not available or a
    tensor does not fit; the caller then concatenates and takes the torch path."""
    lib = load()
    if lib is None or not _fits((weights,), (perm, counts, offsets)):
        return None
    got = _parts_info(parts, dim, offsets)
    if got is None:
        return None
    info, nbags = got
    out = torch.empty(counts.numel(), dim, dtype=torch.float32)
    rc = lib.hr_segment_sum_parts(
        counts.numel(), _ptr(counts), perm.numel(), dim, _ptr(perm), _ptr(offsets), nbags,
        _ptr(weights), len(parts), info[0].data_ptr(), info[1].data_ptr(), info[2].data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


def sort_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted, perm)`` of int64 ``ids`` ``[N]``, stable (``sorted = ids[perm]``): the
    kernel's radix sort where available, else ``torch.sort(stable=True)``."""
    lib = load()
    if lib is None or not ids.is_cpu or ids.dtype != torch.int64:
        srt, perm = torch.sort(ids, stable=True)
        return srt, perm
    ids = ids.contiguous()
    srt = torch.empty_like(ids)
    perm = torch.empty_like(ids)
    if lib.hr_sort_ids(ids.numel(), ids.data_ptr(), srt.data_ptr(), perm.data_ptr()) != 0:
        srt, perm = torch.sort(ids, stable=True)
    return srt, perm


def dedup_ids(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(perm [N], unique [U], counts [U], index [N])`` of int64 ``ids`` ``[N]``: the
    stable sort's ``perm`` (``ids[perm]`` sorted), the sorted distinct ids, how often each
    occurs (``perm``'s runs) and each id's place among them (``unique[index] == ids``).
    One kernel call where available; else ``torch.sort``, ``unique_consecutive`` and a
    scatter, which give the same tensors."""
    lib = load()
    if lib is not None and ids.is_cpu and ids.dtype == torch.int64:
        ids = ids.contiguous()
        n = ids.numel()
        perm, unique, counts, index = (torch.empty_like(ids) for _ in range(4))
        got = lib.hr_dedup_ids(
            n, ids.data_ptr(), perm.data_ptr(), unique.data_ptr(), counts.data_ptr(),
            index.data_ptr(),
        )  # fmt: skip
        if got >= 0:
            return perm, unique[:got], counts[:got], index
    srt, perm = torch.sort(ids, stable=True)
    unique, counts = torch.unique_consecutive(srt, return_counts=True)
    index = torch.empty_like(perm)
    index[perm] = torch.repeat_interleave(
        torch.arange(counts.numel(), device=perm.device), counts, output_size=perm.numel()
    )
    return perm, unique, counts, index
