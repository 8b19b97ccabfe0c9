/* Rows stored as fp16 or bf16: stochastic rounding, row-wise Adagrad and pooling over them.

   Built after rowwise_adagrad.c in one library (ps/kernels/narrow_rows.py puts the two
   sources together, and that file's "fp-contract=off" pragma covers this one): a narrow
   row's update is that file's adagrad_step() on a float32 copy of the row, so its float32
   math has the bits of the float32 kernel, and is then written back stochastically rounded
   with the random bits of ps.rounding.rounding_bits (the same hash on uint64), one 64-bit
   hash per group of four columns:

       key  = splitmix64(splitmix64(splitmix64(seed & (2**63 - 1)) ^ id)
                         + version * 0x9E3779B97F4A7C15)           per row
       h    = key + (column / 4 + 1) * 0xD1B54A32D192ED03          per group of four
       h   ^= h >> 33;  h *= 0xFF51AFD7ED558CCD                    murmur3's fmix64
       h   ^= h >> 33;  h *= 0xC4CEB9FE1A85EC53
       h   ^= h >> 33
       bits = (h >> (16 * (column % 4))) & 0xFFFF                 per element

   with id the row's id in its table and version its clock after the update; bf16 adds
   the 16 bits, fp16 the low 13 (bits & 0x1FFF). Two 64-bit multiplies per four values
   keep the hash cheap where a vector 64-bit multiply is three 32-bit ones (AVX2 without
   AVX-512DQ). Widening is exact (F16C's instruction where -march allows it, else integer
   operations) and the rounded value is built from float32 bits by integer operations and
   one IEEE float32 addition (with AVX2 eight values at a time, the same operations), so
   the result is the same on every x86-64 CPU whatever -march picked
   (tests/ps/test_narrow_rows_kernel.py compares a -march=native build with a baseline
   x86-64 one); the loops have no branches and vectorise. message_pass.c and
   cache/kernels/records.c are compiled after this file and round with its functions.

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
#define NR_GROUP 0xD1B54A32D192ED03ull /* the step of the hash's input per group of four */
#define NR_FMIX1 0xFF51AFD7ED558CCDull
#define NR_FMIX2 0xC4CEB9FE1A85EC53ull
#define NR_CHUNK 64 /* columns drawn (rounding) or widened (pooling) at once: a multiple of 8 */

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

/* murmur3's 64-bit finaliser. */
static inline uint64_t nr_fmix64(uint64_t h) {
    h = (h ^ (h >> 33)) * NR_FMIX1;
    h = (h ^ (h >> 33)) * NR_FMIX2;
    return h ^ (h >> 33);
}

/* The 16-bit draws r [4 * ngroups] of the groups of four columns first_group,
   first_group + 1, ... of a row with key: column 4g + l takes lane l of group g's hash.
   The empty asm keeps gcc from vectorising the loop: without AVX-512DQ a vector 64-bit
   multiply is three 32-bit ones and shuffles, slower than scalar imul (the bits are the
   same either way). */
static inline void nr_draws(uint64_t key, int64_t first_group, int64_t ngroups, uint16_t* r) {
    uint64_t in = key + (uint64_t)first_group * NR_GROUP;
    for (int64_t g = 0; g < ngroups; ++g) {
        in += NR_GROUP; /* key + (group + 1) * NR_GROUP */
        __asm__("" : "+r"(in));
        uint64_t h = nr_fmix64(in);
        r[4 * g] = (uint16_t)h;
        r[4 * g + 1] = (uint16_t)(h >> 16);
        r[4 * g + 2] = (uint16_t)(h >> 32);
        r[4 * g + 3] = (uint16_t)(h >> 48);
    }
}

/* The rounding of one value works on x's float32 bits u as int32: the magnitude
   mag = u & 0x7FFFFFFF is >= 0, so every comparison is a signed one (one vector
   instruction on x86), and every choice is a mask or a min, so the loop over a row has no
   branch and vectorises (gcc 12 keeps a branch for a ternary on a float sum or on the
   result). Inf and NaN are the magnitudes above 0x7F7FFFFF. */

/* bf16 keeps float32's top 16 bits: add the 16 random bits r below them, cut them off (on
   the sign-magnitude bits, so the magnitude rounds; a finite value past bf16's largest
   rounds up to Inf or stays, as the bits say). Non-finite values convert as they are:
   Inf keeps its bits (nothing added), NaN becomes the quiet NaN 0x7FC0 (torch's
   conversion). */
static inline uint16_t nr_round_bf16(float x, uint32_t r) {
    int32_t u = (int32_t)nr_bits_of(x);
    int32_t mag = u & 0x7FFFFFFF;
    uint32_t special = (uint32_t)-(mag > 0x7F7FFFFF); /* all ones for Inf or NaN */
    uint32_t nan = (uint32_t)-(mag > 0x7F800000);
    uint32_t out = ((uint32_t)u + (r & 0xFFFFu & ~special)) >> 16;
    return (uint16_t)((out & ~nan) | (0x7FC0u & nan));
}

/* fp16 keeps 10 of float32's 23 mantissa bits: add the low 13 of the random bits r, cut
   them off (the shift by 13 that re-biases the result cuts them). Below fp16's normal
   range the magnitude is first shifted by 2**-14 into the lowest normal binade (the same
   step, 2**-24), rounded there and shifted back; magnitudes past 65504 saturate
   (ps.rounding.round_to's steps): clamped to 65504 first, which rounds to itself. The
   rounded magnitude is then an fp16 value, and its fp16 bits come from its float32 bits:
   exponent re-biased (127 - 15), top 10 mantissa bits; a value shifted back from the
   lowest normal binade is the subnormal whose bits are 0x400 less. Inf keeps its sign,
   NaN becomes sign | 0x7E00. */
static inline uint16_t nr_round_f16(float x, uint32_t r) {
    int32_t u = (int32_t)nr_bits_of(x);
    int32_t mag = u & 0x7FFFFFFF;
    int32_t small = -(mag < 0x38800000);                 /* all ones where < 2**-14 */
    int32_t clamped = mag < 0x477FE000 ? mag : 0x477FE000; /* at most 65504 */
    float shifted = nr_float_of((uint32_t)clamped) + nr_float_of((uint32_t)(small & 0x38800000));
    int32_t up = (int32_t)nr_bits_of(shifted) + (int32_t)(r & 0x1FFFu); /* < 0x47800000 */
    int32_t h = (up >> 13) - (112 << 10) - (small & 0x400);
    int32_t special = -(mag > 0x7F7FFFFF); /* Inf or NaN */
    int32_t inf_nan = 0x7C00 | (-(mag > 0x7F800000) & 0x200);
    h = (h & ~special) | (inf_nan & special);
    return (uint16_t)(((u >> 16) & 0x8000) | h);
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

#if defined(__AVX2__)
#include <immintrin.h>
/* With AVX2 (where -march allows it) eight values at a time: nr_round_f16 and
   nr_round_bf16 step for step on 8 int32 lanes (the same integer operations, the same
   float32 addition), so the bits are the scalar functions' (the test of this file
   compares this build with a baseline x86-64 one). gcc vectorises the scalar loop too,
   but its code (4 lanes, constants reloaded, the draws through memory) rounds ~1.3x
   slower. r16 holds the 16-bit draws of the eight columns (the lanes of two group
   hashes). */
static inline __m256i nr_i32x8(int32_t v) { return _mm256_set1_epi32(v); }

static inline __m128i nr_narrow_x8(__m256i h) { /* 8 int32 lanes < 2**16 to 8 uint16 */
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128i nr_round_f16_x8(const float* x, __m128i r16) {
    __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x));
    __m256i mag = _mm256_and_si256(u, nr_i32x8(0x7FFFFFFF));
    __m256i small = _mm256_cmpgt_epi32(nr_i32x8(0x38800000), mag);
    __m256i clamped = _mm256_min_epi32(mag, nr_i32x8(0x477FE000));
    __m256i shift = _mm256_and_si256(small, nr_i32x8(0x38800000));
    __m256 shifted = _mm256_add_ps(_mm256_castsi256_ps(clamped), _mm256_castsi256_ps(shift));
    __m256i r = _mm256_cvtepu16_epi32(_mm_and_si128(r16, _mm_set1_epi16(0x1FFF)));
    __m256i up = _mm256_add_epi32(_mm256_castps_si256(shifted), r);
    __m256i h = _mm256_sub_epi32(_mm256_srli_epi32(up, 13), nr_i32x8(112 << 10));
    h = _mm256_sub_epi32(h, _mm256_and_si256(small, nr_i32x8(0x400)));
    __m256i special = _mm256_cmpgt_epi32(mag, nr_i32x8(0x7F7FFFFF));
    __m256i nan = _mm256_cmpgt_epi32(mag, nr_i32x8(0x7F800000));
    __m256i inf_nan = _mm256_or_si256(nr_i32x8(0x7C00), _mm256_and_si256(nan, nr_i32x8(0x200)));
    h = _mm256_blendv_epi8(h, inf_nan, special);
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_srli_epi32(u, 16), nr_i32x8(0x8000)));
    return nr_narrow_x8(h);
}

static inline __m128i nr_round_bf16_x8(const float* x, __m128i r16) {
    __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x));
    __m256i mag = _mm256_and_si256(u, nr_i32x8(0x7FFFFFFF));
    __m256i special = _mm256_cmpgt_epi32(mag, nr_i32x8(0x7F7FFFFF));
    __m256i nan = _mm256_cmpgt_epi32(mag, nr_i32x8(0x7F800000));
    __m256i r = _mm256_andnot_si256(special, _mm256_cvtepu16_epi32(r16));
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, r), 16);
    return nr_narrow_x8(_mm256_blendv_epi8(out, nr_i32x8(0x7FC0), nan));
}

/* The draws of columns j .. j + 7 from the hash input of their first group (in, advanced
   past their second): the lanes of two group hashes, straight into a vector (no round
   trip through memory). */
static inline __m128i nr_draws_x8(uint64_t* in) {
    *in += NR_GROUP;
    uint64_t h0 = nr_fmix64(*in); /* columns j .. j + 3 */
    *in += NR_GROUP;
    uint64_t h1 = nr_fmix64(*in); /* columns j + 4 .. j + 7 */
    return _mm_set_epi64x((long long)h1, (long long)h0);
}

/* The first columns of x [d] in groups of eight into dst; returns how many (a multiple
   of 8). One loop per type: a choice inside would compute both roundings. */
static inline int64_t nr_store_x8(int dtype, const float* x, int64_t d, uint64_t key,
                                  uint16_t* dst) {
    uint64_t in = key;
    int64_t j = 0;
    if (dtype == NR_BF16)
        for (; j + 8 <= d; j += 8)
            _mm_storeu_si128((__m128i*)(dst + j), nr_round_bf16_x8(x + j, nr_draws_x8(&in)));
    else
        for (; j + 8 <= d; j += 8)
            _mm_storeu_si128((__m128i*)(dst + j), nr_round_f16_x8(x + j, nr_draws_x8(&in)));
    return j;
}
#endif

/* float32 x [d] stochastically rounded into the narrow row dst [d] with key: with AVX2
   eight columns at a time, else (and the last d % 8 columns) the draws of NR_CHUNK columns
   at a time, then the rounding loop over them (it vectorises). */
static inline void nr_store(int dtype, const float* x, int64_t d, uint64_t key, uint16_t* dst) {
    int64_t j0 = 0;
#if defined(__AVX2__)
    j0 = nr_store_x8(dtype, x, d, key, dst);
#endif
    uint16_t r[NR_CHUNK];
    for (; j0 < d; j0 += NR_CHUNK) {
        int64_t m = d - j0 < NR_CHUNK ? d - j0 : NR_CHUNK;
        nr_draws(key, j0 / 4, (m + 3) / 4, r);
        if (dtype == NR_BF16)
            for (int64_t j = 0; j < m; ++j) dst[j0 + j] = nr_round_bf16(x[j0 + j], r[j]);
        else
            for (int64_t j = 0; j < m; ++j) dst[j0 + j] = nr_round_f16(x[j0 + j], r[j]);
    }
}

/* values [n, d] of flat rows [n] at versions [n] rounded into out [n, d] (narrow).
   ps.rounding.round_to for rows of several tables, in one pass. Returns 0. */
int hr_narrow_round(int64_t n, int64_t d, const float* values, const int64_t* rows,
                    const int64_t* versions, int dtype, int64_t ntables, const int64_t* starts,
                    const int64_t* seeds, const int64_t* row_ids, uint16_t* out) {
    nr_keys k = {dtype, ntables, starts, seeds, row_ids};
    nr_cursor at = {-1, 0};
    for (int64_t i = 0; i < n; ++i) {
        uint64_t key = nr_key_of(&k, &at, rows[i], versions[i]);
        nr_store(dtype, values + i * d, d, key, out + i * d);
    }
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
    if (!bufs) return 1;
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
            nr_store(keys->dtype, row, d, nr_key_of(keys, &at, r, version), dst);
            lo = end;
        }
    }
    free(bufs);
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

/* acc [d] += s * row [d] (weighted 0: += row), the narrow row widened on the fly: a bf16
   value by a shift, an fp16 row NR_CHUNK columns at a time by nr_widen_f16 (with F16C one
   instruction per 8 values, against ~10 integer operations per value of the bit version,
   which would cost as much as the rest of the pooling). */
static inline void nr_accumulate(int dtype, const uint16_t* src, int64_t d, int weighted,
                                 float s, float* acc) {
    if (dtype == NR_BF16) {
        if (weighted)
            for (int64_t j = 0; j < d; ++j) acc[j] += s * nr_float_of((uint32_t)src[j] << 16);
        else
            for (int64_t j = 0; j < d; ++j) acc[j] += nr_float_of((uint32_t)src[j] << 16);
        return;
    }
    float row[NR_CHUNK];
    for (int64_t j0 = 0; j0 < d; j0 += NR_CHUNK) {
        int64_t m = d - j0 < NR_CHUNK ? d - j0 : NR_CHUNK;
        float* a = acc + j0;
        nr_widen_f16(src + j0, m, row);
        if (weighted)
            for (int64_t j = 0; j < m; ++j) a[j] += s * row[j];
        else
            for (int64_t j = 0; j < m; ++j) a[j] += row[j];
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
