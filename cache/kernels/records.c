/* Compiled after ps/kernels/rowwise_adagrad.c and ps/kernels/narrow_rows.c in one library
   (cache/kernels/records.py puts the sources together): a narrow row's widening, its
   stochastic rounding and their random bits are narrow_rows.c's functions, so the cache
   rounds with the bits of ps.rounding.rounding_bits by the very code the store runs.
   rowwise_adagrad.c's "fp-contract=off" pragma covers this file too (no fused
   multiply-add: the same bits on every CPU). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A record's metadata words (PF_MARK is the PF word of cache.table_cache; PF is
   rowwise_adagrad.c's prefetch distance). */
enum { CLOCK, OWN, COUNT, FREQ, PF_MARK, CHECKED, PUSHED };
/* A record's metadata: m floats into it (the row's words, then the pending sum's). */
#define META(slab, s, m, w) ((int64_t*)((slab) + (s) * (w) + (m)))
/* Records prefetched ahead, so that their misses overlap. In the cache benchmark's steady
   state (~30 k ids a step over 2.6 M records) 12 took the serve pass 0.89 -> 0.78 ms and
   the push's 1.74 -> 1.60 ms against 6 (Intel Xeon, medians of 8 alternations in one
   process); 16, 24 and 32 were no faster. */
#define AHEAD 12
#define OWN8_MAX 255 /* own8's largest value: the record's OWN word is read then */
/* The passes over a push's or a pull's ids run on up to this many OpenMP threads, each
   taking at least PASS_MIN_IDS_PER_THREAD ids (fewer: the threads' start costs more than
   they save). */
#define PASS_MAX_THREADS 64
#define PASS_MIN_IDS_PER_THREAD 2048

/* The threads a pass over n ids runs on: nthreads, within [1, PASS_MAX_THREADS], and
   no more than give each thread PASS_MIN_IDS_PER_THREAD ids. */
static int pass_threads(int64_t n, int nthreads) {
    int nt = nthreads < 1 ? 1 : (nthreads > PASS_MAX_THREADS ? PASS_MAX_THREADS : nthreads);
    if (n / PASS_MIN_IDS_PER_THREAD < nt) nt = (int)(n / PASS_MIN_IDS_PER_THREAD);
    return nt < 1 ? 1 : nt;
}

/* ------------------------------------------------------------------ narrow rows

   A narrow table's record holds its row as d fp16 or bf16 values (kind NR_F16 or
   NR_BF16 of narrow_rows.c; kind 0: float32) in rw = ceil(d / 2) float words. Reads widen
   exactly (nr_widen); a local write rounds stochastically (nr_store, keyed by nr_row_key
   as ps.rounding.rounding_bits); the store's rows are installed as they are: they are
   narrow values already, so the magnitude cut below their last bit is exact. */

/* float32 x [d] holding narrow values into the narrow row dst [d]: the rounding with no
   random bits, which cuts nothing but zeros. */
static inline void rec_store_exact(int kind, const float* x, int64_t d, uint16_t* dst) {
    if (kind == NR_BF16)
        for (int64_t j = 0; j < d; ++j) dst[j] = nr_round_bf16(x[j], 0u);
    else
        for (int64_t j = 0; j < d; ++j) dst[j] = nr_round_f16(x[j], 0u);
}

void hr_cache_clocks(int64_t n, int64_t m, int64_t w, const int64_t* slots,
                     const float* slab, int64_t fill, int64_t* out) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && slots[i + AHEAD] >= 0)
            __builtin_prefetch(META(slab, slots[i + AHEAD], m, w), 0, 0);
        int64_t s = slots[i];
        out[i] = s < 0 ? fill : META(slab, s, m, w)[CLOCK];
    }
}

/* What a sole writer asks the PS about: the misses (slots[i] < 0) and the cached rows
   this cache pushed more than `bound` times since their copy was read (with no other
   writer the PS clock is exactly CLOCK + OWN, so the others are provably within the
   bound). Their indices go to asked [n] and their copy clocks (fill for a miss) to
   clock [n], in order; returns how many.

   OWN is read from own8 [C], min(OWN, OWN8_MAX) of every slot (the record's word
   decides only at OWN8_MAX): a step's ids hit random slots, and at one byte a slot
   this copy stays in the CPU caches where each record's word is a miss in a slab of
   hundreds of MB. */
int64_t hr_cache_ask(int64_t n, int64_t m, int64_t w, const int64_t* slots,
                     const float* slab, const uint8_t* own8, int64_t bound, int64_t fill,
                     int64_t* asked, int64_t* clock) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (i + 4 * AHEAD < n && slots[i + 4 * AHEAD] >= 0)
            __builtin_prefetch(own8 + slots[i + 4 * AHEAD], 0, 0);
        int64_t s = slots[i];
        if (s >= 0) {
            int64_t own = own8[s] < OWN8_MAX ? own8[s] : META(slab, s, m, w)[OWN];
            if (own <= bound) continue;
        }
        asked[k] = i;
        clock[k++] = s < 0 ? fill : META(slab, s, m, w)[CLOCK];
    }
    return k;
}

/* Rows and clocks of the cached ids (slots[i] >= 0) into out_rows [n, d], out_clock [n].
   old[i] (NULL: none) marks the hits: their prefetch marks PF_MARK are counted in
   pf_counts[0] (fetched as a miss) / pf_counts[1] (refreshed) when made for batch
   `tick`, and cleared; lag[i] := OWN. lfu: FREQ += uses[i] (1 if uses NULL), and
   freq[i] := FREQ. keys [C] (NULL: none) are the eviction policy's keys
   (cache.policy): keys[s] := min(f, fmax) << tick_bits | tick, f = key_freq[i] (the
   TinyLFU estimates) or, with key_freq NULL, FREQ; with old_keyed, only where not old
   (the plan wrote the hits' keys already: cache/kernels/plan_pull.c). */
void hr_cache_serve(int64_t n, int64_t d, int64_t rw, int kind, int64_t w,
                    const int64_t* slots, float* slab, const uint8_t* old,
                    const int64_t* uses, int lfu, int64_t tick, float* out_rows,
                    int64_t* out_clock, int64_t* lag, int64_t* freq, int64_t* pf_counts,
                    int64_t* keys, const int64_t* key_freq, int64_t fmax, int64_t tick_bits,
                    int old_keyed, int nthreads) {
    int64_t m = rw + d;
    int64_t missed = 0, refreshed = 0;
    const int keyed = old_keyed && old;
    /* The slots are distinct (a pull's ids are), so the ids can be served in any order:
       nthreads > 1 splits them into contiguous ranges, one per OpenMP thread. */
    int nt = pass_threads(n, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : missed, refreshed)
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && slots[i + AHEAD] >= 0) {
            const char* p = (const char*)(slab + slots[i + AHEAD] * w);
            for (int64_t c = 0; c < rw * 4; c += 64) __builtin_prefetch(p + c, 0, 0);
            __builtin_prefetch(META(slab, slots[i + AHEAD], m, w), 1, 0);
            if (keys && !(keyed && old[i + AHEAD]))
                __builtin_prefetch(keys + slots[i + AHEAD], 1, 0);
        }
        int64_t s = slots[i];
        if (s < 0) continue;
        if (kind)
            nr_widen(kind, (const uint16_t*)(slab + s * w), d, out_rows + i * d);
        else
            memcpy(out_rows + i * d, slab + s * w, sizeof(float) * (size_t)d);
        int64_t* meta = META(slab, s, m, w);
        out_clock[i] = meta[CLOCK];
        if (old && old[i]) {
            int64_t pf = meta[PF_MARK];
            if (pf & 3) {
                if ((pf >> 2) == tick) {
                    if ((pf & 3) == 1) missed += 1;
                    else refreshed += 1;
                }
                meta[PF_MARK] = 0;
            }
            lag[i] = meta[OWN];
        }
        if (lfu) {
            meta[FREQ] += uses ? uses[i] : 1;
            freq[i] = meta[FREQ];
        }
        if (keys && !(keyed && old[i])) {
            int64_t f = key_freq ? key_freq[i] : meta[FREQ];
            keys[s] = ((f < fmax ? f : fmax) << tick_bits) + tick;
        }
    }
    pf_counts[0] += missed;
    pf_counts[1] += refreshed;
}

/* One row of the push at output k: id, gradient or sum g [d], update count c and
   statistic st [q] (NULL: zeros). */
static inline void emit(int64_t k, int64_t d, int64_t q, int64_t id, const float* g, int64_t c,
                        const float* st, int64_t* out_ids, float* due_g, int64_t* due_k,
                        float* due_s) {
    if (out_ids) out_ids[k] = id;
    memcpy(due_g + k * d, g, sizeof(float) * (size_t)d);
    due_k[k] = c;
    if (q > 0) {
        if (st)
            memcpy(due_s + k * q, st, sizeof(float) * (size_t)q);
        else
            memset(due_s + k * q, 0, sizeof(float) * (size_t)q);
    }
}

/* The push's pass over the records: a cached row's copy takes its local step (acc_at < 0:
   an SGD step of lr; else row-wise Adagrad's with the row's accumulator at float acc_at
   of the record, acc += mean(g^2), row -= lr * g / (sqrt(acc) + eps), as
   ps.RowWiseAdagrad.apply), its gradient joins the pending sum (and, q > 0, the
   statistic of a counted push at float stat_at of the record: q = 1 the sum of
   mean(g^2), q = d the sums of g^2) and rows with more than write_bound pending updates
   are due: index into due_idx, sum into due_g [k, d], update count into due_k and
   statistic into due_s [k, q], and own8[s] follows the record's OWN (hr_cache_ask);
   returns k.

   values != 0 (a cache that writes its copies back, fp32 rows only): nothing is summed;
   a row due emits its copy's row after the step, its state (q floats at stat_at) and,
   as its count, the PS clock the write gives it (CLOCK + OWN + 1).

   ids [n] (NULL: the above only): the batch's ids, increasing; the pass then writes the
   whole push in id order, the ids into out_ids: the rows not cached as they are (due_idx
   i, one update, statistic zero) and the ne rows evicted since the last push (e_ids
   increasing and not among ids; sums e_g [ne, d], counts e_k, statistics e_s [ne, q];
   due_idx -1) merged in, so the store need not sort it.

   nthreads > 1 splits the ids into that many contiguous ranges, one per OpenMP thread
   (the slots are distinct: every record belongs to one range). A range's rows are
   emitted from output lo + (evicted ids before it), the most the ranges before it can
   emit, and then moved down behind the previous ranges' rows. Each row takes the same
   operations in either case, so the bits do not depend on nthreads. */

typedef struct {
    int64_t d, rw, w, write_bound, seq, q, stat_at, acc_at;
    int kind, values;
    uint64_t seed_key;
    float lr, eps;
    const int64_t *slots, *row_ids, *ids, *e_ids, *e_k;
    const float *grads, *e_g, *e_s;
    float* slab;
    uint8_t* own8;
    int64_t *due_idx, *due_k, *out_ids;
    float *due_g, *due_s;
} update_args;

/* The pass over ids [lo, hi) and evicted ids [je, je_end), emitting from output k0 (buf:
   d floats, a narrow row's float32 copy); returns how many rows it emitted. */
static int64_t update_range(const update_args* a, int64_t lo, int64_t hi, int64_t je,
                            int64_t je_end, int64_t k0, float* buf) {
    const int64_t d = a->d, q = a->q, w = a->w, m = a->rw + a->d;
    const int64_t *slots = a->slots, *ids = a->ids, *e_ids = a->e_ids, *e_k = a->e_k;
    const float *e_g = a->e_g, *e_s = a->e_s;
    int64_t *out_ids = a->out_ids, *due_idx = a->due_idx, *due_k = a->due_k;
    float *due_g = a->due_g, *due_s = a->due_s, *slab = a->slab;
    int64_t k = k0;
    for (int64_t i = lo; i < hi; ++i) {
        int64_t s = slots[i];
        if (ids) {
            for (; je < je_end && e_ids[je] < ids[i]; ++je, ++k) {
                emit(k, d, q, e_ids[je], e_g + je * d, e_k ? e_k[je] : 1,
                     e_s ? e_s + je * q : NULL, out_ids, due_g, due_k, due_s);
                due_idx[k] = -1;
            }
            if (s < 0) {
                emit(k, d, q, ids[i], a->grads + i * d, 1, NULL, out_ids, due_g, due_k, due_s);
                due_idx[k++] = i;
                continue;
            }
        }
        if (s < 0) continue;
        float* rec = slab + s * w;
        float* row = a->kind ? buf : rec;
        float* pend = rec + a->rw;
        float* stat = rec + a->stat_at;
        int64_t* meta = META(slab, s, m, w);
        const float* g = a->grads + i * d;
        /* the whole record ahead (row, pending sum, statistic, state, meta: ~3 lines at
           d 16), so its misses overlap the rows being stepped */
        if (i + AHEAD < hi && slots[i + AHEAD] >= 0) {
            const char* p = (const char*)(slab + slots[i + AHEAD] * w);
            for (int64_t c = 0; c < w * 4; c += 64) __builtin_prefetch(p + c, 1, 0);
            __builtin_prefetch(a->own8 + slots[i + AHEAD], 1, 0);
        }
        int stepped = a->acc_at >= 0 || a->lr != 0.0f;
        if (a->kind && stepped) nr_widen(a->kind, (const uint16_t*)rec, d, buf);
        if (a->acc_at >= 0) {
            float sq = 0.0f;
            for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
            float* acc = rec + a->acc_at;
            acc[0] += sq / (float)d;
            float den = sqrtf(acc[0]) + a->eps;
            for (int64_t j = 0; j < d; ++j) {
                float t = a->lr * (g[j] / den);
                row[j] = row[j] - t;
            }
        } else if (a->lr != 0.0f) {
            for (int64_t j = 0; j < d; ++j) {
                float t = a->lr * g[j];
                row[j] = row[j] - t;
            }
        }
        /* version -1 - seq: the push's request number, unique per write of the row and
           never a PS clock (>= 0) */
        if (a->kind && stepped)
            nr_store(a->kind, buf, d, nr_row_key(a->seed_key, a->row_ids[s], -1 - a->seq),
                     (uint16_t*)rec);
        if (a->values) {
            /* a write of the copy: row, state (q floats at stat_at) and the PS clock it
               will have, CLOCK + OWN + 1 (a sole writer's: the rows' only writer) */
            meta[COUNT] += 1;
            if (meta[COUNT] <= a->write_bound) continue;
            emit(k, d, q, ids ? ids[i] : 0, rec, meta[CLOCK] + meta[OWN] + 1, stat, out_ids,
                 due_g, due_k, due_s);
            meta[COUNT] = 0;
        } else if (a->write_bound == 0) {
            emit(k, d, q, ids ? ids[i] : 0, g, 1, NULL, out_ids, due_g, due_k, due_s);
        } else {
            for (int64_t j = 0; j < d; ++j) pend[j] += g[j];
            if (q == 1) {
                float sq = 0.0f;
                for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
                stat[0] += sq / (float)d;
            } else if (q > 1) {
                for (int64_t j = 0; j < d; ++j) stat[j] += g[j] * g[j];
            }
            meta[COUNT] += 1;
            if (meta[COUNT] <= a->write_bound) continue;
            emit(k, d, q, ids ? ids[i] : 0, pend, meta[COUNT], stat, out_ids, due_g, due_k,
                 due_s);
            memset(pend, 0, sizeof(float) * (size_t)d);
            if (q > 0) memset(stat, 0, sizeof(float) * (size_t)q);
            meta[COUNT] = 0;
        }
        meta[OWN] += 1;
        a->own8[s] = meta[OWN] < OWN8_MAX ? (uint8_t)meta[OWN] : OWN8_MAX;
        meta[PUSHED] = a->seq;
        due_idx[k++] = i;
    }
    for (; ids && je < je_end; ++je, ++k) {
        emit(k, d, q, e_ids[je], e_g + je * d, e_k ? e_k[je] : 1, e_s ? e_s + je * q : NULL,
             out_ids, due_g, due_k, due_s);
        due_idx[k] = -1;
    }
    return k - k0;
}

/* How many of the increasing e_ids [ne] are below x. */
static int64_t count_below(const int64_t* e_ids, int64_t ne, int64_t x) {
    int64_t lo = 0, hi = ne;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (e_ids[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Output rows [from, from + c) moved to [to, to + c), to <= from. */
static void move_rows(const update_args* a, int64_t to, int64_t from, int64_t c) {
    if (to == from || c == 0) return;
    memmove(a->due_idx + to, a->due_idx + from, sizeof(int64_t) * (size_t)c);
    memmove(a->due_k + to, a->due_k + from, sizeof(int64_t) * (size_t)c);
    memmove(a->due_g + to * a->d, a->due_g + from * a->d, sizeof(float) * (size_t)(c * a->d));
    if (a->q > 0)
        memmove(a->due_s + to * a->q, a->due_s + from * a->q, sizeof(float) * (size_t)(c * a->q));
    if (a->out_ids) memmove(a->out_ids + to, a->out_ids + from, sizeof(int64_t) * (size_t)c);
}

int64_t hr_cache_update(int64_t n, int64_t d, int64_t rw, int kind, int64_t w,
                        const int64_t* slots, const int64_t* row_ids, int64_t seed,
                        const float* grads, float* slab, uint8_t* own8, float lr,
                        int64_t write_bound, int values, int64_t seq, int64_t q, int64_t stat_at, int64_t acc_at, float eps,
                        int64_t* due_idx, float* due_g, int64_t* due_k, float* due_s,
                        const int64_t* ids, int64_t ne, const int64_t* e_ids, const float* e_g,
                        const int64_t* e_k, const float* e_s, int64_t* out_ids, int nthreads) {
    update_args a = {d, rw, w, write_bound, seq, q, stat_at, acc_at, kind, values, nr_seed_key(seed),
                     lr, eps, slots, row_ids, ids, e_ids, e_k, grads, e_g, e_s, slab, own8,
                     due_idx, due_k, out_ids, due_g, due_s};
    if (!ids) ne = 0;
    int nt = pass_threads(n, nthreads);
    /* a narrow row steps on a float32 copy (d floats a thread), then is rounded back */
    float* bufs = kind ? (float*)malloc(sizeof(float) * (size_t)((d > 0 ? d : 1) * nt)) : NULL;
    if (kind && !bufs) return -1;
    int64_t lo[PASS_MAX_THREADS + 1], je[PASS_MAX_THREADS + 1], got[PASS_MAX_THREADS];
    for (int t = 0; t <= nt; ++t) {
        lo[t] = n * t / nt;
        /* range t takes the evicted ids below its first id that range t - 1 leaves:
           those above range t - 1's last id */
        je[t] = t == 0 || ne == 0 ? 0 : (t == nt ? ne : count_below(e_ids, ne, ids[lo[t] - 1]));
    }
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; ++t)
        got[t] = update_range(&a, lo[t], lo[t + 1], je[t], je[t + 1], lo[t] + je[t],
                              bufs ? bufs + (int64_t)t * (d > 0 ? d : 1) : NULL);
    int64_t k = 0;
    for (int t = 0; t < nt; ++t) {
        move_rows(&a, k, lo[t] + je[t], got[t]);
        k += got[t];
    }
    free(bufs);
    return k;
}

/* A fresh record in slot s: row := the d values at row (float32; a narrow kind stores
   them as they are), nothing pending, CLOCK := clock, CHECKED := seq, PF_MARK := pf, every
   other word 0. */
static inline void install_one(int64_t d, int64_t rw, int kind, int64_t w, int64_t s,
                               const float* row, int64_t clock, int64_t seq, int64_t pf,
                               float* slab) {
    float* rec = slab + s * w;
    memset(rec, 0, sizeof(float) * (size_t)w);
    if (d > 0 && kind)
        rec_store_exact(kind, row, d, (uint16_t*)rec);
    else if (d > 0)
        memcpy(rec, row, sizeof(float) * (size_t)d);
    int64_t* meta = META(slab, s, rw + d, w);
    meta[CLOCK] = clock;
    meta[PF_MARK] = pf;
    meta[CHECKED] = seq;
}

/* The lines of slot s's record prefetched for writing. */
static inline void prefetch_record(const float* slab, int64_t s, int64_t w) {
    const char* p = (const char*)(slab + s * w);
    for (int64_t c = 0; c < w * 4; c += 64) __builtin_prefetch(p + c, 1, 0);
}

/* Fresh records in slots[i] (distinct): install_one of fresh[sel[i]] (d floats, fresh
   [m, d]) read at clocks[i]. */
void hr_cache_install(int64_t n, int64_t d, int64_t rw, int kind, int64_t w,
                      const int64_t* slots, const float* fresh, const int64_t* sel,
                      const int64_t* clocks, int64_t seq, int64_t pf, float* slab) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_record(slab, slots[i + AHEAD], w);
        install_one(d, rw, kind, w, slots[i], d > 0 ? fresh + sel[i] * d : 0, clocks[i], seq,
                    pf, slab);
    }
}

/* Rows the cache does not keep, served from the store's reply: out_rows[at[i]] :=
   fresh[sel[i]] and out_clock[at[i]] := fresh_clock[sel[i]] (rows of d floats). */
void hr_cache_pass_through(int64_t n, int64_t d, const int64_t* at, const int64_t* sel,
                           const float* fresh, const int64_t* fresh_clock, float* out_rows,
                           int64_t* out_clock) {
    for (int64_t i = 0; i < n; ++i) {
        memcpy(out_rows + at[i] * d, fresh + sel[i] * d, sizeof(float) * (size_t)d);
        out_clock[at[i]] = fresh_clock[sel[i]];
    }
}

/* Slot s evicted (cache.table_cache TableCache._evict): with pending updates (COUNT >
   0) its row id, pending sum (d floats at rw), count and statistics (q floats at stat_at;
   out_counts NULL: pushes not counted) go to out_*[p] and its COUNT becomes 0; it leaves
   the dense id map (map[row_id] = -1), its row id becomes -1 and its eviction key
   free_key. Returns 1 where it had pending updates, else 0. */
static inline int64_t evict_one(int64_t s, int64_t d, int64_t rw, int64_t w, int64_t m,
                                int64_t stat_at, int64_t q, float* slab, int64_t* row_id,
                                int32_t* map, int64_t* key, int64_t free_key, int64_t p,
                                int64_t* out_ids, float* out_sums, int64_t* out_counts,
                                float* out_stats) {
    int64_t* meta = META(slab, s, m, w);
    int64_t id = row_id[s], pending = meta[COUNT] != 0;
    if (pending) {
        out_ids[p] = id;
        memcpy(out_sums + p * d, slab + s * w + rw, sizeof(float) * (size_t)d);
        if (out_counts) {
            out_counts[p] = meta[COUNT];
            memcpy(out_stats + p * q, slab + s * w + stat_at, sizeof(float) * (size_t)q);
        }
        meta[COUNT] = 0;
    }
    map[id] = -1;
    row_id[s] = -1;
    key[s] = free_key;
    return pending;
}

/* The record words, row id and key of victim a prefetched for evict_one, and (once its
   row id is in) the map entry of victim b. */
static inline void prefetch_victim(const float* slab, int64_t a, int64_t m, int64_t w,
                                   const int64_t* row_id, const int64_t* key,
                                   const int32_t* map, int64_t b) {
    if (a >= 0) {
        __builtin_prefetch(META(slab, a, m, w) + COUNT, 1, 0);
        __builtin_prefetch(row_id + a, 1, 0);
        __builtin_prefetch(key + a, 1, 0);
    }
    if (b >= 0) __builtin_prefetch(map + row_id[b], 1, 0);
}

/* An eviction of the distinct slots victims [n]: evict_one of each, in order, the ones
   with pending updates packed into out_* from 0. Returns how many had pending updates.
   The records, row ids and the map are random accesses, prefetched AHEAD victims ahead
   (numpy gathered whole records, then took their words apart in ~10 calls). */
int64_t hr_cache_evict(int64_t n, int64_t d, int64_t rw, int64_t w, int64_t m, int64_t stat_at,
                       int64_t q, const int64_t* victims, float* slab, int64_t* row_id,
                       int32_t* map, int64_t* key, int64_t free_key, int64_t* out_ids,
                       float* out_sums, int64_t* out_counts, float* out_stats) {
    int64_t p = 0;
    for (int64_t i = 0; i < n; ++i) {
        prefetch_victim(slab, i + AHEAD < n ? victims[i + AHEAD] : -1, m, w, row_id, key, map,
                        i + 2 < n ? victims[i + 2] : -1);
        p += evict_one(victims[i], d, rw, w, m, stat_at, q, slab, row_id, map, key, free_key, p,
                       out_ids, out_sums, out_counts, out_stats);
    }
    return p;
}
