/* No fused multiply-add: -march=native enables FMA where the CPU has it, and contracting
   a*b+c there would make the bits depend on the machine (every CPU rounds alike here). */
#pragma GCC optimize ("fp-contract=off")
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

/* Ask for the gradient row of occurrence i (through perm and bag_of) ahead of its read:
   the rows are read in id order, scattered over the gradient. Always inlined: left a
   call, it made the segment sums ~1.5x slower than the same lines written in place. */
static inline __attribute__((always_inline)) void prefetch_grad(const grad_src* src,
                                                                const int64_t* perm,
                                                                const int64_t* bag_of,
                                                                int64_t i, int64_t d) {
    int64_t p = perm ? perm[i] : i;
    const char* gr = (const char*)grad_row(src, bag_of ? bag_of[p] : p);
    for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64) __builtin_prefetch(gr + c, 0, 0);
}

/* Ask for row q's values, accumulator and clock ahead of their update (for writing). */
static inline void prefetch_update(int64_t q, int64_t d, int64_t s_stride, const float* weight,
                                const float* state, const int64_t* clocks) {
    const char* wr = (const char*)(weight + q * d);
    for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64) __builtin_prefetch(wr + c, 1, 0);
    __builtin_prefetch(state + q * s_stride, 1, 0);
    __builtin_prefetch(clocks + q, 1, 0);
}

/* One row-wise Adagrad update of row [d] with gradient g [d] and accumulator *acc:
   acc += mean(g ** 2) (16 partial sums, vectorised like torch's reduction), then
   row -= lr * g / (sqrt(acc) + eps). Every update of one gradient goes through here, so
   a plain push and the one-update rows of a counted push have the same bits. */
static inline void adagrad_step(float* row, float* acc, const float* g, int64_t d, float lr,
                                float eps) {
    float part[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
        for (int k = 0; k < 16; ++k) part[k] += g[j + k] * g[j + k];
    float sq = 0.0f;
    for (int k = 0; k < 16; ++k) sq += part[k];
    for (; j < d; ++j) sq += g[j] * g[j];
    float a = *acc + sq / (float)d;
    *acc = a;
    float denom = sqrtf(a) + eps;
    for (j = 0; j < d; ++j) row[j] += -lr * (g[j] / denom);
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
                prefetch_update(sorted_ids[lo + PF], d, s_stride, weight, state, clocks);
                prefetch_grad(src, perm, bag_of, lo + PF, d);
            }
            int64_t r = sorted_ids[lo];
            int64_t end = lo + 1;
            while (end < n && sorted_ids[end] == r) ++end;
            run_grad(lo, end, d, perm, bag_of, w, src, buf);
            adagrad_step(weight + r * d, state + r * s_stride, buf, d, lr, eps);
            clocks[r] += 1;
            lo = end;
        }
    }
    free(bufs);
    return 0;
}

#define DIGIT_BITS 11
#define DIGITS (1 << DIGIT_BITS)

/* LSD radix sort of keys < 2^32 with their positions in one word (key << 32 | position,
   n < 2^32): half the bytes of separate key and position arrays moved per pass, and every
   pass's digit counts taken in the first read. Fills sorted (+ lo) and perm. Returns 0, or
   1 when a buffer could not be allocated. */
static int sort_packed(int64_t n, const int64_t* ids, int64_t lo, int bits, int64_t* sorted,
                       int64_t* perm) {
    int passes = (bits + DIGIT_BITS - 1) / DIGIT_BITS;
    uint64_t* buf = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)n * 2);
    int64_t* count = (int64_t*)calloc((size_t)(passes + 1) * DIGITS, sizeof(int64_t));
    if (!buf || !count) {
        free(buf);
        free(count);
        return 1;
    }
    uint64_t *a = buf, *b = buf + n;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t k = (uint64_t)ids[i] - (uint64_t)lo;
        a[i] = k << 32 | (uint64_t)i;
        for (int p = 0; p < passes; ++p) ++count[p * DIGITS + ((k >> (p * DIGIT_BITS)) & (DIGITS - 1))];
    }
    for (int p = 0; p < passes; ++p) {
        int64_t sum = 0, *c = count + p * DIGITS;
        for (int d = 0; d < DIGITS; ++d) {
            int64_t k = c[d];
            c[d] = sum;
            sum += k;
        }
    }
    for (int p = 0; p < passes; ++p) {
        int64_t* c = count + p * DIGITS;
        int shift = 32 + p * DIGIT_BITS;
        for (int64_t i = 0; i < n; ++i) {
            uint64_t v = a[i];
            b[c[(v >> shift) & (DIGITS - 1)]++] = v;
        }
        uint64_t* t = a; a = b; b = t;
    }
    for (int64_t i = 0; i < n; ++i) {
        sorted[i] = (int64_t)((a[i] >> 32) + (uint64_t)lo);
        perm[i] = (int64_t)(a[i] & 0xffffffffu);
    }
    free(buf);
    free(count);
    return 0;
}

/* Stable sort of ids [n]: sorted [n] and perm [n] (sorted[i] = ids[perm[i]]). LSD radix
   sort on ids - min in 11-bit digits, as many passes as the id range needs (two for the
   2.6 M rows of 26 tables x 100 k): ~0.2 ms for 53 k ids against 0.7 ms for torch.sort.
   A range and a count under 2^32 take sort_packed; wider ones sort keys and positions in
   separate arrays. Returns 0, or 1 when a buffer could not be allocated. */
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
    if (bits <= 32 && (uint64_t)n <= 0xffffffffu) return sort_packed(n, ids, lo, bits, sorted, perm);
    uint64_t* key = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)n * 2);
    int64_t* idx = (int64_t*)malloc(sizeof(int64_t) * (size_t)n * 2);
    int64_t* count = (int64_t*)malloc(sizeof(int64_t) * DIGITS);
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
    for (int shift = 0; shift < bits; shift += DIGIT_BITS) {
        for (int c = 0; c < DIGITS; ++c) count[c] = 0;
        for (int64_t i = 0; i < n; ++i) ++count[(ka[i] >> shift) & (DIGITS - 1)];
        int64_t sum = 0;
        for (int c = 0; c < DIGITS; ++c) {
            int64_t k = count[c];
            count[c] = sum;
            sum += k;
        }
        for (int64_t i = 0; i < n; ++i) {
            int64_t at = count[(ka[i] >> shift) & (DIGITS - 1)]++;
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

/* A batch's ids deduplicated in one call: hr_sort_ids's stable sort, then one pass over
   the sorted ids, where torch took three more (unique_consecutive, repeat_interleave and a
   scatter, ~0.3 ms for 53 k ids). Fills perm [n] (sorted = ids[perm]), unique [U] (sorted,
   written over the sorted ids: a run's first entry is never behind its unique slot),
   counts [U] (each unique id's occurrences, runs of perm) and index [n]
   (unique[index[i]] == ids[i]); each of unique and counts has room for n. Returns U, or -1
   when a buffer could not be allocated. */
int64_t hr_dedup_ids(int64_t n, const int64_t* ids, int64_t* perm, int64_t* unique,
                     int64_t* counts, int64_t* index) {
    if (n <= 0) return 0;
    if (hr_sort_ids(n, ids, unique, perm)) return -1;
    int64_t u = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t v = unique[i];
        if (i == 0 || v != unique[u - 1]) {
            unique[u] = v;
            counts[u++] = 0;
        }
        ++counts[u - 1];
        index[perm[i]] = u - 1;
    }
    return u;
}

/* k > 1 sub-steps of row-wise Adagrad on row [d] with the mean gradient g / k and the
   accumulator *acc: each adds stat / k to it, then row -= lr * (g / k) / (sqrt(acc) + eps).
   The row goes in blocks of SUBSTEP_BLOCK columns, each taking every sub-step in order
   with its mean gradient divided by k once (the sub-steps' accumulators are recomputed
   per block, the same values): each value takes the operations of k separate sub-steps,
   in their order, with half their divisions (the pass is division-bound: 34 k rows of
   64 columns at k = 5 took 4.7 ms on one thread dividing g by k in every sub-step). */
#define SUBSTEP_BLOCK 64
static inline void counted_substeps(float* row, float* acc, const float* g, int64_t d,
                                    int64_t k, float stat, float lr, float eps) {
    float kf = (float)k, q = stat / kf, a0 = *acc, a = a0;
    float mean[SUBSTEP_BLOCK];
    for (int64_t j0 = 0; j0 < d; j0 += SUBSTEP_BLOCK) {
        int64_t b = d - j0 < SUBSTEP_BLOCK ? d - j0 : SUBSTEP_BLOCK;
        for (int64_t j = 0; j < b; ++j) mean[j] = g[j0 + j] / kf;
        a = a0;
        for (int64_t s = 0; s < k; ++s) {
            a = a + q;
            float denom = sqrtf(a) + eps;
            for (int64_t j = 0; j < b; ++j) row[j0 + j] += -lr * (mean[j] / denom);
        }
    }
    if (d == 0)
        for (int64_t s = 0; s < k; ++s) a = a + q;
    *acc = a;
}

/* A counted push of distinct rows [n] (ps.Optimizer.apply_counted): row i stands for
   counts[i] updates whose gradients sum to grad[i] [d] and whose mean squares sum to
   stats[i]. A row of one update takes the plain step (adagrad_step: its statistic is not
   read, the gradient is squared here), so it has the bits of a plain push; a row of k > 1
   takes k sub-steps of the mean gradient, each adding stats[i] / k to the accumulator.
   Clocks + 1 (one push). The rows are scattered over the table, so the row, accumulator
   and clock PF rows ahead are prefetched. */
void hr_rowwise_adagrad_counted(int64_t n, int64_t d, int64_t s_stride, const int64_t* rows,
                                const int64_t* counts, const float* stats, const float* grad,
                                float* weight, float* state, int64_t* clocks, float lr,
                                float eps) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + PF < n) prefetch_update(rows[i + PF], d, s_stride, weight, state, clocks);
        int64_t r = rows[i];
        const float* g = grad + i * d;
        float* row = weight + r * d;
        clocks[r] += 1;
        if (counts[i] == 1) {
            adagrad_step(row, state + r * s_stride, g, d, lr, eps);
            continue;
        }
        counted_substeps(row, state + r * s_stride, g, d, counts[i], stats[i], lr, eps);
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
        if (start[u] + PF < n) prefetch_grad(&src, perm, bag_of, start[u] + PF, d);
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
