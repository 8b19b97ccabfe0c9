/* The victim search and TinyLFU's pool of victims (cache/kernels/victim_pool.py). */
#include <stdint.h>

#define AHEAD 8 /* entries ahead whose key and mark are prefetched */

/* marks[s] := v for the slots s >= 0 of protect [m], the marks ahead prefetched (random
   bytes of a scratch larger than the inner CPU caches) */
static void mark(int64_t m, const int64_t* protect, uint8_t* marks, uint8_t v) {
    for (int64_t i = 0; i < m; ++i) {
        if (i + AHEAD < m && protect[i + AHEAD] >= 0)
            __builtin_prefetch(marks + protect[i + AHEAD], 1, 0);
        if (protect[i] >= 0) marks[protect[i]] = v;
    }
}

/* out[0 .. r) = the positions j (increasing) of the first k entries s = pool[j] of pool
   [n] still valid: key[s] == then[j] (unchanged since the search that found it), (key[s]
   & low) < tick (not used by the current batch) and s not among protect [m] (entries < 0
   ignored). Returns r.

   marks [capacity] is all zero on entry and on return: protect's slots are marked for
   the scan and cleared after it. The pool holds a chunk of the capacity while a step
   wants a few thousand victims, so the scan stops at the k-th valid entry. */
int64_t hr_pool_valid(int64_t n, const int64_t* pool, const int64_t* then, const int64_t* key,
                      int64_t low, int64_t tick, int64_t m, const int64_t* protect,
                      uint8_t* marks, int64_t k, int64_t* out) {
    mark(m, protect, marks, 1);
    int64_t r = 0;
    for (int64_t j = 0; j < n && r < k; ++j) {
        if (j + AHEAD < n) {
            __builtin_prefetch(key + pool[j + AHEAD], 0, 0);
            __builtin_prefetch(marks + pool[j + AHEAD], 0, 0);
        }
        int64_t s = pool[j], v = key[s];
        if (v == then[j] && (v & low) < tick && !marks[s]) out[r++] = j;
    }
    mark(m, protect, marks, 0);
    return r;
}

/* The sample's k-th smallest (0-based rank k < n) by quickselect; reorders a. */
static int64_t select_rank(int64_t* a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t pivot = a[lo + (hi - lo) / 2], i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) ++i;
            while (a[j] > pivot) --j;
            if (i <= j) {
                int64_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

/* out[0 .. r) = the slots s of key [c], increasing, that may be evicted (key[s] != FREE,
   (key[s] & low) < tick, marks[s] == 0) with key[s] <= bound; *candidates = how many may
   be evicted. Returns r. Blocks of 64 slots: a first loop without branches or stores to
   out, which the compiler vectorises, flags the block's slots; a second writes those
   flagged (~1.7 ms for 2.6 M keys, where one loop doing both took ~3.4). */
static int64_t collect(int64_t c, const int64_t* restrict key, int64_t low, int64_t tick,
                       const uint8_t* restrict marks, int64_t bound, int64_t* restrict out,
                       int64_t* candidates) {
    const int64_t free_key = INT64_MAX;
    int64_t r = 0, cand = 0;
    uint8_t flag[64];
    for (int64_t s0 = 0; s0 < c; s0 += 64) {
        int64_t n = s0 + 64 < c ? 64 : c - s0;
        const int64_t* kb = key + s0;
        const uint8_t* mb = marks + s0;
        int64_t in_block = 0;
        uint8_t any = 0;
        for (int64_t j = 0; j < n; ++j) {
            int64_t v = kb[j];
            uint8_t ok = (uint8_t)((v != free_key) & ((v & low) < tick) & (mb[j] == 0));
            uint8_t take = ok & (uint8_t)(v <= bound);
            in_block += ok;
            flag[j] = take;
            any |= take;
        }
        cand += in_block;
        if (!any) continue;
        for (int64_t j = 0; j < n; ++j) {
            out[r] = s0 + j;
            r += flag[j];
        }
    }
    *candidates = cand;
    return r;
}

/* The slots a victim search of k rows looks at (cache/policy.py EvictionPolicy.victims):
   out[0 .. r) = the slots s of key [c], increasing, that may be evicted (key[s] != FREE,
   (key[s] & low) < tick, s not among protect [m], entries < 0 ignored) and whose key is at
   most a bound read off a strided sample of the keys (sample [c / step + 1] is scratch),
   so that they hold every candidate whose key is among the k smallest, ties at the k-th
   included; every candidate where there are at most k, or where the sample's bound falls
   short. *candidates = how many slots may be evicted. Returns r.

   One pass over the keys, where numpy took about eight (the evictable mask, the masked
   keys, the protected slots, the count, the bound's comparison and the slots under it).
   marks [c] is all zero on entry and on return, as for hr_pool_valid. */
int64_t hr_search_near(int64_t c, const int64_t* key, int64_t low, int64_t tick, int64_t m,
                       const int64_t* protect, uint8_t* marks, int64_t k, int64_t step,
                       int64_t* sample, int64_t* out, int64_t* candidates) {
    const int64_t free_key = INT64_MAX;
    mark(m, protect, marks, 1);
    int64_t bound = free_key - 1; /* every candidate */
    if (step > 0 && 4 * k <= c) {
        int64_t n = 0;
        for (int64_t s = 0; s < c; s += step) {
            int64_t v = key[s];
            int ok = (v != free_key) & ((v & low) < tick) & (marks[s] == 0);
            sample[n++] = ok ? v : free_key;
        }
        /* the rank of the k-th smallest key in the sample, with room for its error */
        int64_t rank = (5 * k * n) / (4 * c) + 64;
        if (rank > n - 1) rank = n - 1;
        int64_t b = select_rank(sample, n, rank);
        if (b != free_key) bound = b;
    }
    int64_t cand = 0;
    int64_t r = collect(c, key, low, tick, marks, bound, out, &cand);
    if (r < k && r < cand) /* the sample's bound fell short: every candidate */
        r = collect(c, key, low, tick, marks, free_key - 1, out, &cand);
    mark(m, protect, marks, 0);
    *candidates = cand;
    return r;
}

/* TinyLFU's halving of the eviction keys (cache/policy.py, EvictionPolicy.halve): every
   key other than free_key (the slot is empty) keeps its low bits (the last use) and has
   its high bits (the frequency) halved, in one branch-free pass; numpy took a mask, a
   gather, three temporaries of the capacity and a scatter: ~25 ms for 2.6 M keys on one
   core, and several times that where the temporaries' pages fault in. */
void hr_halve_keys(int64_t n, int64_t* key, int64_t free_key, int64_t low_bits) {
    const int64_t low = (int64_t)((((uint64_t)1) << low_bits) - 1);
    for (int64_t i = 0; i < n; ++i) {
        int64_t k = key[i];
        int64_t halved = ((k >> (low_bits + 1)) << low_bits) + (k & low);
        key[i] = k == free_key ? k : halved;
    }
}
