/* The frequency sketch's two passes (cache/sketch.py): the counter of id x in row d is
   ((x * mult[d]) mod 2**64) >> shift, at flat position d * width + that. */
#include <stdint.h>

#define AHEAD 8 /* ids hashed and prefetched ahead: their counter misses overlap */

static inline int64_t pos(uint64_t x, uint64_t m, int64_t shift, int64_t base) {
    return (int64_t)((x * m) >> shift) + base;
}

/* counters[h_d(ids[i])] += 1 for every row d and id i (duplicates count each time). */
void hr_sketch_add(int64_t n, const int64_t* ids, int64_t depth, const uint64_t* mult,
                   int64_t shift, int64_t width, int32_t* counters) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            uint64_t y = (uint64_t)ids[i + AHEAD];
            for (int64_t d = 0; d < depth; ++d)
                __builtin_prefetch(counters + pos(y, mult[d], shift, d * width), 1, 0);
        }
        uint64_t x = (uint64_t)ids[i];
        for (int64_t d = 0; d < depth; ++d) counters[pos(x, mult[d], shift, d * width)] += 1;
    }
}

/* out[i] = min over rows d of counters[h_d(ids[i])]. */
void hr_sketch_estimate(int64_t n, const int64_t* ids, int64_t depth, const uint64_t* mult,
                        int64_t shift, int64_t width, const int32_t* counters, int64_t* out) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            uint64_t y = (uint64_t)ids[i + AHEAD];
            for (int64_t d = 0; d < depth; ++d)
                __builtin_prefetch(counters + pos(y, mult[d], shift, d * width), 0, 0);
        }
        uint64_t x = (uint64_t)ids[i];
        int32_t m = counters[pos(x, mult[0], shift, 0)];
        for (int64_t d = 1; d < depth; ++d) {
            int32_t c = counters[pos(x, mult[d], shift, d * width)];
            if (c < m) m = c;
        }
        out[i] = m;
    }
}
