/* Rows stored as fp16 or bf16: stochastic rounding, row-wise Adagrad and pooling over them.

   Built after rowwise_adagrad.c in one library (ps/kernels/narrow_rows.py puts the two
   sources together, and that file's "fp-contract=off" pragma covers this one): a narrow
   row's update is that file's adagrad_step() on a float32 copy of the row, so its float32
   math has the bits of the float32 kernel, and is then written back stochastically rounded
   with the random bits of ps.rounding.rounding_bits (the same hash on uint64):

       key  = splitmix64(splitmix64(splitmix64(seed & (2**63 - 1)) ^ id)
                         + version * 0x9E3779B97F4A7C15)           per row
       h    = key + (column + 1) * 0xD1B54A32D192ED03              per element
       h    = (h ^ (h >> 33)) * 0xFF51AFD7ED558CCD
       bits = (h ^ (h >> 33)) >> 32

   with id the row's id in its table and version its clock after the update. Widening is
   exact (F16C's instruction where -march allows it, else integer operations) and the
   rounded value is built from float32 bits by integer operations, so the result is the
   same on every x86-64 CPU whatever -march picked (tests/ps/test_narrow_rows_kernel.py
   compares a -march=native build with a baseline x86-64 one); the loops have no branches
   and vectorise.

   The flat rows of a kernel call may hold several tables (a fused group): table k owns
   rows [starts[k], starts[k + 1]) and rounds with seeds[k]; a row's id is row_ids[r]
   where given (a server's shard, whose rows are not ids), else r - starts[k]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NR_F16 1
#define NR_BF16 2

#define NR_GAMMA 0x9E3779B97F4A7C15ull  /* splitmix64's increment; the version's factor */
#define NR_M1 0xBF58476D1CE4E5B9ull
#define NR_M2 0x94D049BB133111EBull
#define NR_COLUMN 0xD1B54A32D192ED03ull
#define NR_MIX 0xFF51AFD7ED558CCDull
#define NR_FP16_MIN_NORMAL 0x1p-14f

static inline uint32_t nr_bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float nr_float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ------------------------------------------------------------------ widening */

/* fp16 bits to float32, exactly, by integer and exact float operations (after
   M. Dukhan's FP16 library, as c10 converts): a normal or Inf/NaN half is re-biased by
   shifting its exponent and mantissa into place and scaling by 2**-112; a subnormal one
   becomes 0.5 + m * 2**-24 in float32, minus 0.5. Free of branches, so the loops over a
   row vectorise on any x86-64 (gcc 12 converts _Float16 one element at a time unless the
   CPU has AVX512-FP16: 2x slower lookups than this), and the result is the same on every
   CPU. */
static inline float nr_f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w; /* exponent and mantissa at the top, sign dropped */
    float normalized = nr_float_of((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
    float denormalized = nr_float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t mag = two_w < (1u << 27) ? nr_bits_of(denormalized) : nr_bits_of(normalized);
    return nr_float_of(sign | mag);
}

#if defined(__F16C__)
#include <immintrin.h>
/* With F16C (any x86-64 since 2012, when -march allows it) the conversion instruction,
   exact like the bit version: the same floats, 8 at a time. */
static inline void nr_widen_f16(const uint16_t* src, int64_t d, float* out) {
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + j))));
    for (; j < d; ++j) out[j] = nr_f16_to_f32(src[j]);
}
#else
static inline void nr_widen_f16(const uint16_t* src, int64_t d, float* out) {
    for (int64_t j = 0; j < d; ++j) out[j] = nr_f16_to_f32(src[j]);
}
#endif

static inline void nr_widen_bf16(const uint16_t* src, int64_t d, float* out) {
    for (int64_t j = 0; j < d; ++j) out[j] = nr_float_of((uint32_t)src[j] << 16);
}

/* Row [d] of narrow type dtype as float32 into out [d] (exact). */
static inline void nr_widen(int dtype, const uint16_t* src, int64_t d, float* out) {
    if (dtype == NR_BF16)
        nr_widen_bf16(src, d, out);
    else
        nr_widen_f16(src, d, out);
}

/* ------------------------------------------------------------------ rounding */

static inline uint64_t nr_splitmix64(uint64_t z) {
    z += NR_GAMMA;
    z = (z ^ (z >> 30)) * NR_M1;
    z = (z ^ (z >> 27)) * NR_M2;
    return z ^ (z >> 31);
}

/* A table's part of the key: its seed hashed. */
static inline uint64_t nr_seed_key(int64_t seed) {
    return nr_splitmix64((uint64_t)seed & 0x7FFFFFFFFFFFFFFFull);
}

/* The per-row key of the random bits: row id of a table with seed_key, at version. */
static inline uint64_t nr_row_key(uint64_t seed_key, int64_t id, int64_t version) {
    return nr_splitmix64(nr_splitmix64((uint64_t)id ^ seed_key) + (uint64_t)version * NR_GAMMA);
}

/* The per-column part of the hash: cols [d] = (j + 1) * 0xD1B54A32D192ED03, the same for
   every row (computed once per call: it saves a 64-bit multiply per element). NULL when
   out of memory. */
static uint64_t* nr_columns(int64_t d) {
    uint64_t* cols = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)(d > 0 ? d : 1));
    if (cols)
        for (int64_t j = 0; j < d; ++j) cols[j] = (uint64_t)(j + 1) * NR_COLUMN;
    return cols;
}

/* 32 random bits of a column (its cols entry) of a row with key. The last xor-shift of
   the hash does not reach the top 32 bits, so they are the product's. */
static inline uint32_t nr_col_bits(uint64_t key, uint64_t col) {
    uint64_t h = key + col;
    h = (h ^ (h >> 33)) * NR_MIX;
    return (uint32_t)(h >> 32);
}

/* bf16 keeps float32's top 16 bits: add 16 random bits below them, cut them off (on the
   sign-magnitude bits, so the magnitude rounds). Non-finite values convert as they are:
   Inf keeps its bits, NaN becomes the quiet NaN 0x7FC0 (torch's conversion). */
static inline uint16_t nr_round_bf16(float x, uint32_t r) {
    uint32_t u = nr_bits_of(x);
    uint32_t finite = (u & 0x7F800000u) != 0x7F800000u;
    uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    uint32_t out = finite ? (u + (r & 0xFFFFu)) >> 16 : (nan ? 0x7FC0u : u >> 16);
    return (uint16_t)out;
}

/* fp16 keeps 10 of float32's 23 mantissa bits: add 13 random bits, cut them off. Below
   fp16's normal range the magnitude is first shifted by 2**-14 into the lowest normal
   binade (the same step, 2**-24), rounded there and shifted back; magnitudes past 65504
   saturate (ps.rounding.round_to's steps). The rounded magnitude is then an fp16 value,
   and its fp16 bits come from its float32 bits: exponent re-biased (127 - 15), top 10
   mantissa bits; a value shifted back from the lowest normal binade is the subnormal
   whose bits are 0x400 less. Inf keeps its sign, NaN becomes sign | 0x7E00. */
static inline uint16_t nr_round_f16(float x, uint32_t r) {
    uint32_t u = nr_bits_of(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    float mag = fabsf(x);
    uint32_t small = mag < NR_FP16_MIN_NORMAL;
    float shifted = small ? mag + NR_FP16_MIN_NORMAL : mag; /* >= 2**-14 */
    uint32_t up = (nr_bits_of(shifted) + (r & 0x1FFFu)) & ~0x1FFFu;
    uint32_t h = (up >> 13) - (112u << 10);
    h = small ? h - 0x400u : h;
    h = up > 0x477FE000u ? 0x7BFFu : h; /* past 65504 (and Inf from rounding up): 65504 */
    uint32_t finite = (u & 0x7F800000u) != 0x7F800000u;
    uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    h = finite ? h : (nan ? 0x7E00u : 0x7C00u);
    return (uint16_t)(sign | h);
}

/* The rounding keys of flat rows: tables by their first rows, seeds, optional ids. */
typedef struct {
    int dtype;
    int64_t ntables;
    const int64_t* starts; /* [ntables + 1] */
    const int64_t* seeds;  /* [ntables] */
    const int64_t* row_ids; /* [rows] or NULL */
} nr_keys;

/* Where the last key was made: its table and that table's seed key. Rows mostly come
   sorted, so the next row's table is this one or a later one close by. */
typedef struct {
    int64_t table;
    uint64_t seed_key;
} nr_cursor;

/* The key of flat row r at version: its table found from the cursor (walking forward) or
   by bisection of starts (a row before the cursor's table). */
static inline uint64_t nr_key_of(const nr_keys* k, nr_cursor* at, int64_t r, int64_t version) {
    int64_t t = at->table;
    if (t < 0 || r < k->starts[t]) {
        int64_t lo = 0, hi = k->ntables - 1; /* the last table starting at or before r */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (k->starts[mid] <= r)
                lo = mid;
            else
                hi = mid - 1;
        }
        t = lo;
    } else {
        while (t + 1 < k->ntables && k->starts[t + 1] <= r) ++t;
    }
    if (t != at->table) {
        at->table = t;
        at->seed_key = nr_seed_key(k->seeds[t]);
    }
    int64_t id = k->row_ids ? k->row_ids[r] : r - k->starts[t];
    return nr_row_key(at->seed_key, id, version);
}

/* float32 x [d] stochastically rounded into the narrow row dst [d] with key. */
static inline void nr_store(int dtype, const float* x, int64_t d, uint64_t key,
                            const uint64_t* cols, uint16_t* dst) {
    if (dtype == NR_BF16)
        for (int64_t j = 0; j < d; ++j) dst[j] = nr_round_bf16(x[j], nr_col_bits(key, cols[j]));
    else
        for (int64_t j = 0; j < d; ++j) dst[j] = nr_round_f16(x[j], nr_col_bits(key, cols[j]));
}

/* values [n, d] of flat rows [n] at versions [n] rounded into out [n, d] (narrow).
   ps.rounding.round_to for rows of several tables, in one pass. Returns 0, or 1 when out
   of memory (nothing written). */
int hr_narrow_round(int64_t n, int64_t d, const float* values, const int64_t* rows,
                    const int64_t* versions, int dtype, int64_t ntables, const int64_t* starts,
                    const int64_t* seeds, const int64_t* row_ids, uint16_t* out) {
    nr_keys k = {dtype, ntables, starts, seeds, row_ids};
    nr_cursor at = {-1, 0};
    uint64_t* cols = nr_columns(d);
    if (!cols) return 1;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t key = nr_key_of(&k, &at, rows[i], versions[i]);
        nr_store(dtype, values + i * d, d, key, cols, out + i * d);
    }
    free(cols);
    return 0;
}

/* ------------------------------------------------------------------ row-wise Adagrad */

/* Ask for narrow row q, its accumulator and clock ahead of their update (for writing). */
static inline void nr_prefetch_update(int64_t q, int64_t d, int64_t s_stride,
                                      const uint16_t* weight, const float* state,
                                      const int64_t* clocks) {
    const char* wr = (const char*)(weight + q * d);
    for (int64_t c = 0; c < d * 2; c += 64) __builtin_prefetch(wr + c, 1, 0);
    __builtin_prefetch(state + q * s_stride, 1, 0);
    __builtin_prefetch(clocks + q, 1, 0);
}

/* adagrad() of rowwise_adagrad.c over narrow rows: per run of equal rows, the gradient
   summed (run_grad), the row widened, adagrad_step() on it, clock + 1, and the row written
   back rounded with the key of its new clock. */
static int nr_adagrad(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                      const int64_t* perm, const int64_t* bag_of, const float* w,
                      const grad_src* src, uint16_t* weight, float* state, int64_t* clocks,
                      float lr, float eps, const nr_keys* keys, int nthreads) {
    if (n <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    if (n < 4096) nthreads = 1;
    float* bufs = (float*)malloc(sizeof(float) * (size_t)(2 * d * nthreads));
    uint64_t* cols = nr_columns(d);
    if (!bufs || !cols) {
        free(bufs);
        free(cols);
        return 1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int t = 0; t < nthreads; ++t) {
        float* buf = bufs + (int64_t)t * 2 * d; /* the row's gradient */
        float* row = buf + d;                   /* the row, widened */
        nr_cursor at = {-1, 0};
        int64_t lo = n * t / nthreads, hi = n * (t + 1) / nthreads;
        while (lo > 0 && lo < n && sorted_ids[lo] == sorted_ids[lo - 1]) ++lo;
        while (lo < hi) {
            if (lo + PF < n) {
                nr_prefetch_update(sorted_ids[lo + PF], d, s_stride, weight, state, clocks);
                int64_t p = perm ? perm[lo + PF] : lo + PF;
                const char* gr = (const char*)grad_row(src, bag_of ? bag_of[p] : p);
                for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64)
                    __builtin_prefetch(gr + c, 0, 0);
            }
            int64_t r = sorted_ids[lo];
            int64_t end = lo + 1;
            while (end < n && sorted_ids[end] == r) ++end;
            run_grad(lo, end, d, perm, bag_of, w, src, buf);
            uint16_t* dst = weight + r * d;
            nr_widen(keys->dtype, dst, d, row);
            adagrad_step(row, state + r * s_stride, buf, d, lr, eps);
            int64_t version = clocks[r] + 1;
            clocks[r] = version;
            nr_store(keys->dtype, row, d, nr_key_of(keys, &at, r, version), cols, dst);
            lo = end;
        }
    }
    free(bufs);
    free(cols);
    return 0;
}

/* hr_rowwise_adagrad over narrow rows (rounding keys as in the header). */
int hr_narrow_adagrad(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                      const int64_t* perm, const int64_t* bag_of, const float* w,
                      const float* grad, uint16_t* weight, float* state, int64_t* clocks,
                      float lr, float eps, int dtype, int64_t ntables, const int64_t* starts,
                      const int64_t* seeds, const int64_t* row_ids, int nthreads) {
    grad_src src = {grad, NULL, d};
    nr_keys k = {dtype, ntables, starts, seeds, row_ids};
    return nr_adagrad(n, d, s_stride, sorted_ids, perm, bag_of, w, &src, weight, state, clocks,
                      lr, eps, &k, nthreads);
}

/* hr_rowwise_adagrad_parts over narrow rows. */
int hr_narrow_adagrad_parts(int64_t n, int64_t d, int64_t s_stride, const int64_t* sorted_ids,
                            const int64_t* perm, const int64_t* offsets, int64_t nbags,
                            const float* w, int64_t nparts, const int64_t* part_bags,
                            const int64_t* part_ptr, const int64_t* part_stride,
                            uint16_t* weight, float* state, int64_t* clocks, float lr,
                            float eps, int dtype, int64_t ntables, const int64_t* starts,
                            const int64_t* seeds, const int64_t* row_ids, int nthreads) {
    grad_src src;
    int64_t* bag_of;
    if (parts_src(n, d, offsets, nbags, nparts, part_bags, part_ptr, part_stride, &src, &bag_of))
        return 1;
    nr_keys k = {dtype, ntables, starts, seeds, row_ids};
    int rc = nr_adagrad(n, d, s_stride, sorted_ids, perm, bag_of, w, &src, weight, state, clocks,
                        lr, eps, &k, nthreads);
    free((void*)src.rows);
    free(bag_of);
    return rc;
}

/* ------------------------------------------------------------------ pooling */

#define NR_POOL_PF 16 /* prefetch distance of the pooling's row reads, in ids */

/* acc [d] += s * row [d] (weighted 0: += row), the narrow row widened on the fly. */
static inline void nr_accumulate(int dtype, const uint16_t* src, int64_t d, int weighted,
                                 float s, float* acc) {
    if (dtype == NR_BF16) {
        if (weighted)
            for (int64_t j = 0; j < d; ++j) acc[j] += s * nr_float_of((uint32_t)src[j] << 16);
        else
            for (int64_t j = 0; j < d; ++j) acc[j] += nr_float_of((uint32_t)src[j] << 16);
    } else {
        if (weighted)
            for (int64_t j = 0; j < d; ++j) acc[j] += s * nr_f16_to_f32(src[j]);
        else
            for (int64_t j = 0; j < d; ++j) acc[j] += nr_f16_to_f32(src[j]);
    }
}

/* out [nbags, d] float32: bag b sums w[i] * row(ids[i]) (w NULL: 1) over the positions
   offsets[b] <= i < offsets[b + 1], each narrow row widened, accumulated in float32 from
   0 in the order of the ids (empty bags: zeros; the product and the sum each rounded).
   Rows NR_POOL_PF ids ahead are prefetched. */
int hr_narrow_pool(int64_t nbags, int64_t d, int dtype, const int64_t* ids,
                   const int64_t* offsets, const float* w, const uint16_t* weight, float* out,
                   int nthreads) {
    int64_t n = nbags > 0 ? offsets[nbags] : 0;
    if (nthreads < 1 || n < 4096) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nbags; ++b) {
        float* acc = out + b * d;
        for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
        for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
            if (i + NR_POOL_PF < n) {
                const char* ahead = (const char*)(weight + ids[i + NR_POOL_PF] * d);
                for (int64_t c = 0; c < d * 2; c += 64) __builtin_prefetch(ahead + c, 0, 0);
            }
            nr_accumulate(dtype, weight + ids[i] * d, d, w != NULL, w ? w[i] : 1.0f, acc);
        }
    }
    return 0;
}
