/* Whole batched messages of the MPI parameter server in one pass per phase: every
   table part of a PULL_MANY or PUSH_MANY is checked, then served, without Python
   between the parts.

   Built after rowwise_adagrad.c and narrow_rows.c in one library
   (ps/kernels/message_pass.py puts the sources together): a push applies
   rowwise_adagrad.c's adagrad() step (a narrow row: its adagrad_step() on the row
   widened, then narrow_rows.c's stochastic rounding), so a row updated here has the
   bits the table engine's own push gives it.

   A table descriptor is TABLE_WORDS int64 words (one row per table index of the server):
     0 usable   1: a fixed table this pass may serve; 0: the Python path serves it
     1 rows     ids are [0, rows)
     2 dim      floats per row
     3 weights  float32 [local rows, dim] address
     4 state    float32 [local rows, state stride] address (column 0: the accumulator)
     5 sstride  floats per state row
     6 clocks   int64 [local rows] address
     7 map      int32 [rows] address: id -> local row, -1 where the id lives on another
                server (0: none, the local row is the id)
     8 push     1: row-wise Adagrad here; 0: pushes go the Python path
     9 swidth   floats of a row's optimizer state (the first swidth of its state row)
    10 dtype    the rows' type: 0 float32, 1 fp16, 2 bf16 (narrow: weights are uint16 bits)
    11 seed     a narrow table's rounding seed (its init seed)
   and two floats per table (lr, eps). A table of contents' width word is the row width
   with the row type above its low 32 bits (ps.mpi.wire.width_word), so a part whose
   type is not its table's is refused.

   Narrow rows round with the key (seed, table id, clock after the update, column): the
   table id is the request's id (a server's shard maps it to its local row through
   map, but rounds by the id), so every shard layout rounds as the table engine does.
   "packed": where a message carries narrow values in the table's type
   (ps.mpi.wire.pack_values: two 16-bit values per data word, an odd count's last word
   padded with a zero half): a pull part's rows go back as their stored bits, then
   (with state) each row's state floats; a push part's gradients come in the table's
   type and are widened (exactly) first. Not packed (the in-process store): narrow rows
   are pulled widened to float32 in the float32 layout, gradients are float32. Counters: COUNTER_WORDS int64 per table, in the
   order of ps.local.table.COUNTERS.

   A check returns 0 when the pass can serve the message exactly as the Python path
   would, else 1 with nothing changed: the caller then takes the Python path, which
   serves it or raises its error (these checks never need to say why). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TABLE_WORDS 12
#define COUNTER_WORDS 8
#define C_PULL_REQUESTS 0
#define C_ROWS_PULLED 1
#define C_ROWS_SKIPPED 2
#define C_PUSH_REQUESTS 3
#define C_ROWS_PUSHED 4
#define MAX_IDS ((int64_t)1 << 27)
#define PULL_PF 16 /* prefetch distance of the gathers, in ids */

typedef struct {
    int64_t usable, rows, dim;
    float* weights;
    float* state;
    int64_t sstride;
    int64_t* clocks;
    const int32_t* map;
    int64_t push, swidth, dtype, seed;
} table_desc;

static table_desc desc(const int64_t* tables, int64_t index) {
    const int64_t* w = tables + index * TABLE_WORDS;
    table_desc t = {w[0], w[1], w[2], (float*)(intptr_t)w[3], (float*)(intptr_t)w[4],
                    w[5], (int64_t*)(intptr_t)w[6], (const int32_t*)(intptr_t)w[7], w[8], w[9],
                    w[10], w[11]};
    return t;
}

static inline int64_t local_row(const table_desc* t, int64_t id) {
    return t->map ? (int64_t)t->map[id] : id;
}

/* The rows are scattered over a big table: every one is a cache (and TLB) miss, so the
   gathers ask for rows PULL_PF ids ahead and the misses overlap. */
static inline void prefetch_row(const table_desc* t, int64_t q) {
    int64_t size = t->dtype ? 2 : (int64_t)sizeof(float);
    const char* row = (const char*)t->weights + q * t->dim * size;
    for (int64_t c = 0; c < t->dim * size; c += 64) __builtin_prefetch(row + c);
}

/* Data words of a part's m rows: float32 values (and sw state floats) per row, or, a
   narrow table's packed, its m * dim halves in words (padded), then m * sw floats. */
static inline int64_t part_words(const table_desc* t, int64_t m, int64_t sw, int packed) {
    if (t->dtype && packed) return (m * t->dim + 1) / 2 + m * sw;
    return m * (t->dim + sw);
}

/* Whether halves x [n] of narrow type dtype hold no NaN or Inf (exponent bits all ones). */
static int all_finite_narrow(int64_t dtype, const uint16_t* x, int64_t n) {
    uint16_t mask = dtype == NR_BF16 ? 0x7F80u : 0x7C00u;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (uint32_t)((x[i] & mask) == mask);
    return !bad;
}

/* Every id in [0, rows) and routed to this server. */
static int ids_ok(const table_desc* t, const int64_t* ids, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t id = ids[i];
        if (id < 0 || id >= t->rows) return 0;
        if (t->map && t->map[id] < 0) return 0;
    }
    return 1;
}

/* Whether x [n] holds no NaN or Inf: a float is not finite exactly when its exponent bits
   are all ones. An integer OR over blocks vectorises (a float test with an early exit
   does not: ~1 ns a value, a third of a 26-table push). */
static int all_finite(const float* x, int64_t n) {
    for (int64_t lo = 0; lo < n; lo += 4096) {
        int64_t hi = lo + 4096 < n ? lo + 4096 : n;
        uint32_t bad = 0;
        for (int64_t i = lo; i < hi; ++i) {
            uint32_t b;
            memcpy(&b, x + i, sizeof b); /* the bits, without breaking aliasing rules */
            bad |= (uint32_t)((b & 0x7f800000u) == 0x7f800000u);
        }
        if (bad) return 0;
    }
    return 1;
}

/* The table of contents' part p: table index, ids, dim, usable descriptor. */
static int part_ok(const int64_t* toc, int64_t width, int64_t p, const int64_t* tables,
                   int64_t ntables, table_desc* t) {
    int64_t index = toc[p * width], n = toc[p * width + 1], dim = toc[p * width + 2];
    if (index < 0 || index >= ntables || n < 0 || n > MAX_IDS) return 0;
    *t = desc(tables, index);
    return t->usable == 1 && dim == (t->dim | (t->dtype << 32));
}

/* PULL_MANY: toc [k, 4] (table index, n, dim, bound; bound -1: a plain pull), then
   words [nwords]: each part's ids, then its caller clocks when bound >= 0. On 0,
   sizes[0] = the reply's words after its header (the reply toc [k, 2], then each part's
   clocks and, when conditional, its positions) and sizes[1] = the rows' floats (with
   state: each row's dim floats then its swidth state floats), both at most (a
   conditional part sends only its rows past the bound; packed: narrow rows in words of
   their type, see the header). */
int hr_pull_check(int64_t k, const int64_t* toc, int64_t nwords, const int64_t* words,
                  const int64_t* tables, int64_t ntables, int with_state, int packed,
                  int64_t* sizes) {
    int64_t at = 0, reply = 2 * k, floats = 0;
    for (int64_t p = 0; p < k; ++p) {
        table_desc t;
        if (!part_ok(toc, 4, p, tables, ntables, &t)) return 1;
        int64_t n = toc[p * 4 + 1], bound = toc[p * 4 + 3];
        int64_t need = bound >= 0 ? 2 * n : n;
        if (bound < -1 || at + need > nwords) return 1;
        if (!ids_ok(&t, words + at, n)) return 1;
        at += need;
        reply += need;
        floats += part_words(&t, n, with_state ? t.swidth : 0, packed);
        if (at > MAX_IDS * 2) return 1;
    }
    if (at != nwords) return 1;
    sizes[0] = reply;
    sizes[1] = floats;
    return 0;
}

/* Whether the k parts of a table of contents (width words a part) name k different
   tables: then they touch disjoint memory and may run on several threads at once. */
static int cmp_i64(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

static int distinct_tables(int64_t k, const int64_t* toc, int64_t width) {
    int64_t* idx = (int64_t*)malloc(sizeof(int64_t) * (size_t)k);
    if (!idx) return 0;
    for (int64_t p = 0; p < k; ++p) idx[p] = toc[p * width];
    qsort(idx, (size_t)k, sizeof(int64_t), cmp_i64);
    int ok = 1;
    for (int64_t p = 1; p < k && ok; ++p) ok = idx[p] != idx[p - 1];
    free(idx);
    return ok;
}

/* Threads for the parts of one message: several only for several parts of different
   tables (each part is ~1 k rows: one thread each, no team inside a part). */
static int part_threads(int64_t k, const int64_t* toc, int64_t width, int nthreads) {
    if (nthreads <= 1 || k < 2 || !distinct_tables(k, toc, width)) return 1;
    return nthreads < k ? nthreads : (int)k;
}

/* Rows of a conditional pull part that go back: clock past caller clock + bound. */
static int64_t count_past(const table_desc* t, const int64_t* ids, const int64_t* caller,
                          int64_t n, int64_t bound) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (i + PULL_PF < n) __builtin_prefetch(t->clocks + local_row(t, ids[i + PULL_PF]));
        m += t->clocks[local_row(t, ids[i])] > caller[i] + bound;
    }
    return m;
}

/* Row r as the part's j-th of m rows at out (the part's data words): float32 rows are
   [m, dim + sw] (values, then the first sw state floats); a narrow row is widened into
   that layout, or, packed, copied as its stored halves (halves [m * dim], then the state
   [m, sw] from word (m * dim + 1) / 2). */
static inline void copy_row(const table_desc* t, int64_t r, int64_t j, int64_t m, int64_t sw,
                            int packed, float* out) {
    int64_t d = t->dim;
    const float* st = t->state + r * t->sstride;
    float* so;
    if (!t->dtype) {
        const float* src = t->weights + r * d;
        float* o = out + j * (d + sw);
        for (int64_t e = 0; e < d; ++e) o[e] = src[e];
        so = o + d;
    } else if (packed) {
        memcpy((uint16_t*)out + j * d, (const uint16_t*)t->weights + r * d, sizeof(uint16_t) * d);
        so = out + (m * d + 1) / 2 + j * sw;
    } else {
        float* o = out + j * (d + sw);
        nr_widen((int)t->dtype, (const uint16_t*)t->weights + r * d, d, o);
        so = o + d;
    }
    for (int64_t e = 0; e < sw; ++e) so[e] = st[e];
}

/* The zero half that pads a packed narrow part of an odd count of values. */
static inline void pad_part(const table_desc* t, int64_t m, int packed, float* out) {
    if (t->dtype && packed && (m * t->dim) % 2) ((uint16_t*)out)[m * t->dim] = 0;
}

/* One pull part's reply: clocks [m] (then positions [m] when conditional) at words, its
   rows [m, dim + sw] at rows (sw state floats after each row's values; 0: none); the m
   rows counted by count_past (all n for a plain pull). A conditional part finds its rows
   first, then gathers only those. */
static void write_part(const table_desc* t, const int64_t* ids, const int64_t* caller,
                       int64_t n, int64_t bound, int64_t m, int64_t sw, int packed,
                       int64_t* words, float* rows) {
    pad_part(t, m, packed, rows);
    if (caller) {
        int64_t* positions = words + m;
        int64_t j = 0;
        for (int64_t i = 0; i < n && j < m; ++i) {
            if (i + PULL_PF < n) __builtin_prefetch(t->clocks + local_row(t, ids[i + PULL_PF]));
            int64_t c = t->clocks[local_row(t, ids[i])];
            if (c > caller[i] + bound) {
                words[j] = c;
                positions[j++] = i;
            }
        }
        for (j = 0; j < m; ++j) {
            if (j + PULL_PF < m) {
                int64_t q = local_row(t, ids[positions[j + PULL_PF]]);
                prefetch_row(t, q);
                if (sw) __builtin_prefetch(t->state + q * t->sstride);
            }
            copy_row(t, local_row(t, ids[positions[j]]), j, m, sw, packed, rows);
        }
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        if (i + PULL_PF < n) {
            int64_t q = local_row(t, ids[i + PULL_PF]);
            prefetch_row(t, q);
            __builtin_prefetch(t->clocks + q);
            if (sw) __builtin_prefetch(t->state + q * t->sstride);
        }
        int64_t r = local_row(t, ids[i]);
        words[i] = t->clocks[r];
        copy_row(t, r, i, m, sw, packed, rows);
    }
}

/* Serve a checked PULL_MANY: reply [sizes[0]] words (see hr_pull_check), rows [m, dim]
   (with_state: [m, dim + swidth], each row's state after its values) of every part back
   to back (packed: narrow parts in their type, see part_words); used = (reply words,
   row floats) written. A conditional
   part sends the rows whose clock is past caller clock + bound, as ps.local.table.pull.
   Parts of different tables run on up to nthreads threads: each part's rows are first
   counted, then every part knows where its reply goes. Returns 0, or 1 when a buffer
   could not be allocated (nothing written then). */
int hr_pull_apply(int64_t k, const int64_t* toc, const int64_t* words, const int64_t* tables,
                  int with_state, int packed, int64_t* counters, int64_t* reply, float* rows,
                  int64_t* used, int nthreads) {
    /* per part: where its request words, reply words and rows start, its rows back */
    int64_t* at = (int64_t*)malloc(sizeof(int64_t) * (size_t)(4 * k));
    if (!at) return 1;
    int64_t *out = at + k, *fat = at + 2 * k, *m = at + 3 * k;
    int64_t w = 0;
    for (int64_t p = 0; p < k; ++p) {
        at[p] = w;
        w += toc[p * 4 + 3] >= 0 ? 2 * toc[p * 4 + 1] : toc[p * 4 + 1];
    }
    int threads = part_threads(k, toc, 4, nthreads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t p = 0; p < k; ++p) {
        table_desc t = desc(tables, toc[p * 4]);
        int64_t n = toc[p * 4 + 1], bound = toc[p * 4 + 3];
        const int64_t* ids = words + at[p];
        m[p] = bound >= 0 ? count_past(&t, ids, ids + n, n, bound) : n;
    }
    int64_t o = 2 * k, f = 0;
    for (int64_t p = 0; p < k; ++p) {
        int64_t bound = toc[p * 4 + 3];
        out[p] = o;
        fat[p] = f;
        o += bound >= 0 ? 2 * m[p] : m[p];
        table_desc t = desc(tables, toc[p * 4]);
        f += part_words(&t, m[p], with_state ? t.swidth : 0, packed);
        reply[2 * p] = m[p];
        reply[2 * p + 1] = bound >= 0 ? 2 : 0; /* ps.mpi.wire.FLAG_POSITIONS */
        int64_t* cnt = counters + toc[p * 4] * COUNTER_WORDS;
        cnt[C_PULL_REQUESTS] += 1;
        cnt[C_ROWS_PULLED] += m[p];
        cnt[C_ROWS_SKIPPED] += toc[p * 4 + 1] - m[p];
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t p = 0; p < k; ++p) {
        table_desc t = desc(tables, toc[p * 4]);
        int64_t n = toc[p * 4 + 1], bound = toc[p * 4 + 3];
        const int64_t* ids = words + at[p];
        write_part(&t, ids, bound >= 0 ? ids + n : NULL, n, bound, m[p],
                   with_state ? t.swidth : 0, packed, reply + out[p], rows + fat[p]);
    }
    used[0] = o;
    used[1] = f;
    free(at);
    return 0;
}

/* PUSH_MANY: toc [k, 3] (table index, n, dim), then ids [nids], grads [nfloats]; a
   counted one (counts not NULL) also each row's update count counts [nids] and its
   statistic stats [nstats] (row-wise Adagrad: one sum of mean(g ** 2) per row). The pass
   applies it when every part's table pushes here, its ids are strictly increasing
   (nothing to sum: ps.local.table.coalesce would hand them back as they are) and routed
   here, every gradient is finite, and every count is >= 1 and every statistic finite and
   >= 0 (what ps.validate.check_counted asks). Packed: a narrow part's gradients are in
   its table's type (part_words). A counted push of a narrow table goes the Python path. */
int hr_push_check(int64_t k, const int64_t* toc, int64_t nids, const int64_t* ids,
                  int64_t nfloats, const float* grads, const int64_t* counts, int64_t nstats,
                  const float* stats, const int64_t* tables, int64_t ntables, int packed,
                  int nthreads) {
    if (counts) {
        if (nstats != nids || !all_finite(stats, nstats)) return 1;
        for (int64_t i = 0; i < nids; ++i)
            if (counts[i] < 1 || !(stats[i] >= 0.0f)) return 1;
    }
    /* First the table of contents (where each part's ids and gradients start), then the
       parts' values, parts of different tables on up to nthreads threads: each part
       reads only its own slices, so the verdict does not depend on the threads. */
    int64_t* at = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * k + 2));
    if (!at) return 1;
    int64_t* fat = at + k + 1;
    at[0] = fat[0] = 0;
    for (int64_t p = 0; p < k; ++p) {
        table_desc t;
        int ok = part_ok(toc, 3, p, tables, ntables, &t) && t.push == 1 && !(t.dtype && counts);
        int64_t n = ok ? toc[p * 3 + 1] : 0, size = ok ? part_words(&t, n, 0, packed) : 0;
        if (!ok || at[p] + n > nids || fat[p] + size > nfloats) {
            free(at);
            return 1;
        }
        at[p + 1] = at[p] + n;
        fat[p + 1] = fat[p] + size;
    }
    int whole = at[k] == nids && fat[k] == nfloats;
    int threads = whole && k > 1 && nthreads > 1 ? (nthreads < k ? nthreads : (int)k) : 1;
    int bad = !whole;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : bad)
    for (int64_t p = 0; p < k; ++p) {
        if (bad) continue; /* this thread saw a bad part already: its verdict stands */
        table_desc t = desc(tables, toc[p * 3]);
        int64_t n = at[p + 1] - at[p];
        const int64_t* part = ids + at[p];
        if (!ids_ok(&t, part, n)) {
            bad = 1;
            continue;
        }
        for (int64_t i = 1; i < n && !bad; ++i) bad |= part[i] <= part[i - 1];
        if (bad) continue;
        if (t.dtype && packed)
            bad |= !all_finite_narrow(t.dtype, (const uint16_t*)(grads + fat[p]), n * t.dim);
        else
            bad |= !all_finite(grads + fat[p], n * t.dim);
    }
    free(at);
    return bad ? 1 : 0;
}

/* One part of n rows of a narrow table (strictly increasing table ids [n], their local
   rows [n]): each row widened, adagrad_step() with its gradient (float32 [n, dim], or,
   packed, halves of the table's type widened first), clock + 1, the row written back
   rounded with the key (seed, id, new clock, column): narrow_rows.c's nr_adagrad on
   rows of one update, bit for bit. Returns 1 when out of memory (nothing changed). */
static int narrow_push_part(const table_desc* t, int64_t n, const int64_t* ids,
                            const int64_t* rows, const float* grads, int packed, float lr,
                            float eps) {
    int64_t d = t->dim;
    int dtype = (int)t->dtype;
    float* buf = (float*)malloc(sizeof(float) * (size_t)(2 * d + 1));
    if (!buf) return 1;
    float* g = buf + d; /* the row's gradient, widened (packed) */
    uint16_t* weight = (uint16_t*)t->weights;
    uint64_t seed_key = nr_seed_key(t->seed);
    for (int64_t i = 0; i < n; ++i) {
        if (i + PF < n) nr_prefetch_update(rows[i + PF], d, t->sstride, weight, t->state, t->clocks);
        int64_t r = rows[i];
        const float* gi = grads + i * d;
        if (packed) {
            nr_widen(dtype, (const uint16_t*)grads + i * d, d, g);
            gi = g;
        }
        uint16_t* dst = weight + r * d;
        nr_widen(dtype, dst, d, buf);
        adagrad_step(buf, t->state + r * t->sstride, gi, d, lr, eps);
        int64_t version = t->clocks[r] + 1;
        t->clocks[r] = version;
        nr_store(dtype, buf, d, nr_row_key(seed_key, ids[i], version), dst);
    }
    free(buf);
    return 0;
}

/* Apply a checked PUSH_MANY: each part's rows in adagrad() (rowwise_adagrad.c), or, for
   a counted one (counts, stats [nids] not NULL), in hr_rowwise_adagrad_counted (rows of one
   update take adagrad()'s step, the others their sub-steps), in place, clocks + 1; parts
   of different tables on up to nthreads threads. hyper [ntables, 2] = (lr, eps). Returns
   0, or 1 when a buffer could not be allocated: the slot and offset buffers come first
   (nothing changed then); the d floats adagrad() asks for per part could only fail with
   memory all but gone. */
int hr_push_apply(int64_t k, const int64_t* toc, const int64_t* ids, const float* grads,
                  const int64_t* counts, const float* stats, const int64_t* tables,
                  const float* hyper, int64_t* counters, int packed, int nthreads) {
    int64_t* at = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * k));
    if (!at) return 1;
    int64_t* fat = at + k;
    int64_t nids = 0, nf = 0;
    for (int64_t p = 0; p < k; ++p) {
        at[p] = nids;
        fat[p] = nf;
        nids += toc[p * 3 + 1];
        table_desc t = desc(tables, toc[p * 3]);
        nf += part_words(&t, toc[p * 3 + 1], 0, packed);
    }
    /* the local rows of a server's share of a table (FixedShard), part by part */
    int64_t* slots = (int64_t*)malloc(sizeof(int64_t) * (size_t)(nids + 1));
    if (!slots) {
        free(at);
        return 1;
    }
    int threads = part_threads(k, toc, 3, nthreads);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t p = 0; p < k; ++p) {
        int64_t index = toc[p * 3], n = toc[p * 3 + 1];
        table_desc t = desc(tables, index);
        const int64_t* rows = ids + at[p];
        if (t.map) {
            for (int64_t i = 0; i < n; ++i) slots[at[p] + i] = (int64_t)t.map[rows[i]];
            rows = slots + at[p];
        }
        float lr = hyper[2 * index], eps = hyper[2 * index + 1];
        if (t.dtype) {
            failed |= narrow_push_part(&t, n, ids + at[p], rows, grads + fat[p], packed, lr, eps);
        } else if (counts) {
            hr_rowwise_adagrad_counted(n, t.dim, t.sstride, rows, counts + at[p], stats + at[p],
                                       grads + fat[p], t.weights, t.state, t.clocks, lr, eps);
        } else {
            grad_src src = {grads + fat[p], NULL, t.dim};
            failed |= adagrad(n, t.dim, t.sstride, rows, NULL, NULL, NULL, &src, t.weights,
                              t.state, t.clocks, lr, eps, threads > 1 ? 1 : nthreads);
        }
        int64_t* cnt = counters + index * COUNTER_WORDS;
        cnt[C_PUSH_REQUESTS] += 1;
        cnt[C_ROWS_PUSHED] += n;
    }
    free(slots);
    free(at);
    return failed ? 1 : 0;
}

/* Writes (ps.WriteRequest parts of float32 fixed tables). Part p of toc [k, 4] (table
   row, n, width word, state width) carries n ids, their clocks, rows [n, dim] and state
   [n, swidth]; each of ids, clocks, rows and state holds the parts' values back to back
   (the caller sized them from toc). */

/* Whether the pass can apply the write exactly: every part a usable float32 table of
   its dim and state width, ids in range, routed here and strictly increasing, clocks >=
   0, rows and state finite. 0: yes; 1: take the Python path. */
int hr_write_check(int64_t k, const int64_t* toc, const int64_t* ids, const int64_t* clocks,
                   const float* rows, const float* state, const int64_t* tables,
                   int64_t ntables) {
    int64_t at = 0, fr = 0, fs = 0;
    for (int64_t p = 0; p < k; ++p) {
        table_desc t;
        if (!part_ok(toc, 4, p, tables, ntables, &t) || t.dtype != 0) return 1;
        int64_t n = toc[p * 4 + 1];
        if (toc[p * 4 + 3] != t.swidth || !ids_ok(&t, ids + at, n)) return 1;
        for (int64_t i = 1; i < n; ++i)
            if (ids[at + i] <= ids[at + i - 1]) return 1;
        for (int64_t i = 0; i < n; ++i)
            if (clocks[at + i] < 0) return 1;
        if (!all_finite(rows + fr, n * t.dim) || !all_finite(state + fs, n * t.swidth)) return 1;
        at += n;
        fr += n * t.dim;
        fs += n * t.swidth;
    }
    return 0;
}

/* Apply a checked write: each part's rows, the first swidth floats of their state rows
   and their clocks set in place (local rows through the table's map); the rows are
   scattered, so each is prefetched PULL_PF ids ahead. */
void hr_write_apply(int64_t k, const int64_t* toc, const int64_t* ids, const int64_t* clocks,
                    const float* rows, const float* state, const int64_t* tables) {
    int64_t at = 0, fr = 0, fs = 0;
    for (int64_t p = 0; p < k; ++p) {
        int64_t n = toc[p * 4 + 1];
        table_desc t = desc(tables, toc[p * 4]);
        for (int64_t i = 0; i < n; ++i) {
            if (i + PULL_PF < n) prefetch_row(&t, local_row(&t, ids[at + i + PULL_PF]));
            int64_t r = local_row(&t, ids[at + i]);
            memcpy(t.weights + r * t.dim, rows + fr + i * t.dim, sizeof(float) * (size_t)t.dim);
            if (t.swidth > 0)
                memcpy(t.state + r * t.sstride, state + fs + i * t.swidth,
                       sizeof(float) * (size_t)t.swidth);
            t.clocks[r] = clocks[at + i];
        }
        at += n;
        fr += n * t.dim;
        fs += n * t.swidth;
    }
}
