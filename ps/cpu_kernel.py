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

/* Sum the gradients of one run of equal rows into buf [d]. */
static void run_grad(int64_t lo, int64_t hi, int64_t d, const int64_t* perm,
                     const int64_t* bag_of, const float* w, const float* grad, float* buf) {
    for (int64_t i = lo; i < hi; ++i) {
        int64_t p = perm ? perm[i] : i;
        int64_t b = bag_of ? bag_of[p] : p;
        float s = w ? w[p] : 1.0f;
        const float* g = grad + b * d;
        if (i == lo) {
            for (int64_t j = 0; j < d; ++j) buf[j] = s * g[j];
        } else {
            for (int64_t j = 0; j < d; ++j) buf[j] += s * g[j];
        }
    }
}

/* Row-wise Adagrad on every run of equal ids in sorted_ids [n]. Occurrence i (in
   sorted order) is original position perm[i] (identity if NULL), whose gradient is
   w[p] * grad[bag_of[p]] (w NULL: 1; bag_of NULL: bag p). Returns 0, or 1 when a
   buffer could not be allocated (nothing was changed then). */
int hr_rowwise_adagrad(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                       const int64_t* perm, const int64_t* bag_of, const float* w,
                       const float* grad, float* weight, float* state, int64_t* clocks,
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
                const char* gr = (const char*)(grad + (bag_of ? bag_of[p] : p) * d);
                for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64)
                    __builtin_prefetch(gr + c, 0, 0);
            }
            int64_t r = sorted_ids[lo];
            int64_t end = lo + 1;
            while (end < n && sorted_ids[end] == r) ++end;
            run_grad(lo, end, d, perm, bag_of, w, grad, buf);
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
"""


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it is disabled
    (``HYBRIDREC_CPU_KERNEL=0``), no C compiler is found, or the build fails."""
    lib = load_c_library("hr_rowwise_adagrad", _SOURCE)
    if lib is None:
        return None
    fn = lib.hr_rowwise_adagrad
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_int64] * 3
        + [ctypes.c_void_p] * 8
        + [
            ctypes.c_float,
            ctypes.c_float,
            ctypes.c_int,
        ]
    )
    return lib


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
    tensors = [weight, state, clocks, sorted_ids, grad, perm, bag_of, weights]
    if any(t is not None and (t.device.type != "cpu" or not t.is_contiguous()) for t in tensors):
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
