/* TinyLFU's pool of victims (cache/kernels/victim_pool.py). */
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

/* out[0 .. r) = the first k entries s of pool [n] (in pool order) still valid: key[s] ==
   then[j] (unchanged since the search that found it), (key[s] & low) < tick (not used by
   the current batch) and s not among protect [m] (entries < 0 ignored). Returns r.

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
        if (v == then[j] && (v & low) < tick && !marks[s]) out[r++] = s;
    }
    mark(m, protect, marks, 0);
    return r;
}
