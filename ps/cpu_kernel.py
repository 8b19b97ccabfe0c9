"""A small C kernel for row-wise Adagrad on the CPU, in place on the touched rows.

Two callers: the embedding collection's fused backward (per-id gradients of a lookup)
and :class:`ps.local_table.LocalTable`'s push (already summed gradients per unique row).

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

from comm.native import load_c_library

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PF 8 /* prefetch distance, in occurrences */

/* Where bag b's gradient row is: rows[b] when given, else grad + b * d. */
typedef struct {
    const float* grad;
    const float* const* rows;
    int64_t d;
} grad_src;

static inline const float* grad_row(const grad_src* g, int64_t b) {
    return g->rows ? g->rows[b] : g->grad + b * g->d;
}

/* Sum the gradients of one run of equal rows into buf [d]. */
static void run_grad(int64_t lo, int64_t hi, int64_t d, const int64_t* perm,
                     const int64_t* bag_of, const float* w, const grad_src* src, float* buf) {
    for (int64_t i = lo; i < hi; ++i) {
        int64_t p = perm ? perm[i] : i;
        int64_t b = bag_of ? bag_of[p] : p;
        float s = w ? w[p] : 1.0f;
        const float* g = grad_row(src, b);
        if (i == lo) {
            for (int64_t j = 0; j < d; ++j) buf[j] = s * g[j];
        } else {
            for (int64_t j = 0; j < d; ++j) buf[j] += s * g[j];
        }
    }
}

static int adagrad(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                   const int64_t* perm, const int64_t* bag_of, const float* w,
                   const grad_src* src, float* weight, float* state, int64_t* clocks,
                   float lr, float eps, int nthreads) {
    if (n <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    if (n < 4096) nthreads = 1;
    float* bufs = (float*)malloc(sizeof(float) * (size_t)(d * nthreads));
    if (!bufs) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int t = 0; t < nthreads; ++t) {
        float* buf = bufs + (int64_t)t * d;
        int64_t lo = n * t / nthreads, hi = n * (t + 1) / nthreads;
        /* A thread owns the runs that START in [lo, hi). */
        while (lo > 0 && lo < n && sorted_ids[lo] == sorted_ids[lo - 1]) ++lo;
        while (lo < hi) {
            /* The rows are scattered over a big table: every row is a cache (and TLB)
               miss. Prefetch the rows and gradients PF occurrences ahead so the misses
               overlap instead of being paid one after another. */
            if (lo + PF < n) {
                int64_t q = sorted_ids[lo + PF];
                const char* wr = (const char*)(weight + q * d);
                for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64)
                    __builtin_prefetch(wr + c, 1, 0);
                __builtin_prefetch(state + q * s_stride, 1, 0);
                __builtin_prefetch(clocks + q, 1, 0);
                int64_t p = perm ? perm[lo + PF] : lo + PF;
                const char* gr = (const char*)grad_row(src, bag_of ? bag_of[p] : p);
                for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64)
                    __builtin_prefetch(gr + c, 0, 0);
            }
            int64_t r = sorted_ids[lo];
            int64_t end = lo + 1;
            while (end < n && sorted_ids[end] == r) ++end;
            run_grad(lo, end, d, perm, bag_of, w, src, buf);
            /* mean(g ** 2) with 16 partial sums (vectorised, like torch's reduction) */
            float part[16] = {0};
            int64_t j = 0;
            for (; j + 16 <= d; j += 16)
                for (int k = 0; k < 16; ++k) part[k] += buf[j + k] * buf[j + k];
            float sq = 0.0f;
            for (int k = 0; k < 16; ++k) sq += part[k];
            for (; j < d; ++j) sq += buf[j] * buf[j];
            float acc = state[r * s_stride] + sq / (float)d;
            state[r * s_stride] = acc;
            float denom = sqrtf(acc) + eps;
            float* row = weight + r * d;
            for (j = 0; j < d; ++j) row[j] += -lr * (buf[j] / denom);
            clocks[r] += 1;
            lo = end;
        }
    }
    free(bufs);
    return 0;
}

/* Stable sort of ids [n]: sorted [n] and perm [n] (sorted[i] = ids[perm[i]]). LSD radix
   sort on ids - min in 11-bit digits, as many passes as the id range needs (two for the
   2.6 M rows of 26 tables x 100 k): 0.5 ms for 53 k ids against 0.7 ms for torch.sort.
   Returns 0, or 1 when a buffer could not be allocated. */
int hr_sort_ids(int64_t n, const int64_t* ids, int64_t* sorted, int64_t* perm) {
    if (n <= 0) return 0;
    int64_t lo = ids[0], hi = ids[0];
    for (int64_t i = 1; i < n; ++i) {
        if (ids[i] < lo) lo = ids[i];
        if (ids[i] > hi) hi = ids[i];
    }
    uint64_t range = (uint64_t)hi - (uint64_t)lo;
    int bits = 0;
    while (bits < 64 && (range >> bits) != 0) ++bits;
    uint64_t* key = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)n * 2);
    int64_t* idx = (int64_t*)malloc(sizeof(int64_t) * (size_t)n * 2);
    int64_t* count = (int64_t*)malloc(sizeof(int64_t) * 2048);
    if (!key || !idx || !count) {
        free(key);
        free(idx);
        free(count);
        return 1;
    }
    uint64_t *ka = key, *kb = key + n;
    int64_t *ia = idx, *ib = idx + n;
    for (int64_t i = 0; i < n; ++i) {
        ka[i] = (uint64_t)ids[i] - (uint64_t)lo;
        ia[i] = i;
    }
    for (int shift = 0; shift < bits; shift += 11) {
        for (int c = 0; c < 2048; ++c) count[c] = 0;
        for (int64_t i = 0; i < n; ++i) ++count[(ka[i] >> shift) & 2047];
        int64_t sum = 0;
        for (int c = 0; c < 2048; ++c) {
            int64_t k = count[c];
            count[c] = sum;
            sum += k;
        }
        for (int64_t i = 0; i < n; ++i) {
            int64_t at = count[(ka[i] >> shift) & 2047]++;
            kb[at] = ka[i];
            ib[at] = ia[i];
        }
        uint64_t* kt = ka; ka = kb; kb = kt;
        int64_t* it = ia; ia = ib; ib = it;
    }
    for (int64_t i = 0; i < n; ++i) {
        sorted[i] = (int64_t)(ka[i] + (uint64_t)lo);
        perm[i] = ia[i];
    }
    free(key);
    free(idx);
    free(count);
    return 0;
}

/* Row-wise Adagrad on every run of equal ids in sorted_ids [n]. Occurrence i (in
   sorted order) is original position perm[i] (identity if NULL), whose gradient is
   w[p] * grad[bag_of[p]] (w NULL: 1; bag_of NULL: bag p). Returns 0, or 1 when a
   buffer could not be allocated (nothing was changed then). */
int hr_rowwise_adagrad(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                       const int64_t* perm, const int64_t* bag_of, const float* w,
                       const float* grad, float* weight, float* state, int64_t* clocks,
                       float lr, float eps, int nthreads) {
    grad_src src = {grad, NULL, d};
    return adagrad(n, d, s_stride, sorted_ids, perm, bag_of, w, &src, weight, state, clocks,
                   lr, eps, nthreads);
}

/* Gradients in separate parts (one per feature, read in place: no concatenation): bags
   [0, nbags) are the parts' rows in order, part f having part_bags[f] rows of d floats,
   row j at part_ptr[f] + j * part_stride[f] floats. The bag of occurrence p comes from
   offsets [nbags + 1] (bag k holds positions [offsets[k], offsets[k+1])), or is p when
   offsets is NULL. Fills src and *bag_of (malloc'd, or NULL); 1 when out of memory. */
static int parts_src(int64_t n, int64_t d, const int64_t* offsets, int64_t nbags,
                     int64_t nparts, const int64_t* part_bags, const int64_t* part_ptr,
                     const int64_t* part_stride, grad_src* src, int64_t** bag_of) {
    const float** rows = (const float**)malloc(sizeof(float*) * (size_t)(nbags + 1));
    int64_t* map = offsets ? (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 1)) : NULL;
    if (!rows || (offsets && !map)) {
        free(rows);
        free(map);
        return 1;
    }
    int64_t k = 0;
    for (int64_t f = 0; f < nparts; ++f) {
        const float* base = (const float*)(intptr_t)part_ptr[f];
        for (int64_t j = 0; j < part_bags[f] && k < nbags; ++j)
            rows[k++] = base + j * part_stride[f];
    }
    if (offsets)
        for (int64_t b = 0; b < nbags; ++b)
            for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) map[p] = b;
    src->grad = NULL;
    src->rows = rows;
    src->d = d;
    *bag_of = map;
    return 0;
}

/* hr_rowwise_adagrad with the bags' gradients in parts (see parts_src). */
int hr_rowwise_adagrad_parts(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                             const int64_t* perm, const int64_t* offsets, int64_t nbags,
                             const float* w, int64_t nparts, const int64_t* part_bags,
                             const int64_t* part_ptr, const int64_t* part_stride,
                             float* weight, float* state, int64_t* clocks, float lr, float eps,
                             int nthreads) {
    grad_src src;
    int64_t* bag_of;
    if (parts_src(n, d, offsets, nbags, nparts, part_bags, part_ptr, part_stride, &src, &bag_of))
        return 1;
    int rc = adagrad(n, d, s_stride, sorted_ids, perm, bag_of, w, &src, weight, state, clocks,
                     lr, eps, nthreads);
    free((void*)src.rows);
    free(bag_of);
    return rc;
}

/* Segment sums with the bags' gradients in parts (see parts_src): out [nruns, d], run u
   summing w[p] * grad_row(bag of p) over the positions p = perm[i] of its counts[u]
   consecutive entries of perm. The hybrid backward's row gradients, no concatenation. */
int hr_segment_sum_parts(int64_t nruns, const int64_t* counts, int64_t n, int64_t d,
                         const int64_t* perm, const int64_t* offsets, int64_t nbags,
                         const float* w, int64_t nparts, const int64_t* part_bags,
                         const int64_t* part_ptr, const int64_t* part_stride, float* out,
                         int nthreads) {
    grad_src src;
    int64_t* bag_of;
    int64_t* start = (int64_t*)malloc(sizeof(int64_t) * (size_t)(nruns + 1));
    if (!start) return 1;
    if (parts_src(n, d, offsets, nbags, nparts, part_bags, part_ptr, part_stride, &src, &bag_of)) {
        free(start);
        return 1;
    }
    start[0] = 0;
    for (int64_t u = 0; u < nruns; ++u) start[u + 1] = start[u] + counts[u];
    if (nthreads < 1 || n < 4096) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t u = 0; u < nruns; ++u) {
        if (start[u + 1] > start[u])
            run_grad(start[u], start[u + 1], d, perm, bag_of, w, &src, out + u * d);
        else
            for (int64_t j = 0; j < d; ++j) out[u * d + j] = 0.0f;
    }
    free(start);
    free((void*)src.rows);
    free(bag_of);
    return 0;
}
"""


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
    lib.hr_sort_ids.restype = ctypes.c_int
    lib.hr_sort_ids.argtypes = [i64, ptr, ptr, ptr]
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
