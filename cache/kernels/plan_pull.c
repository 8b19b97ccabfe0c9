/* The plan of a sole writer's serving pull in one pass (cache/kernels/plan_pull.py).
   Compiled after sketch.c in one library: an id is counted by sketch.c's own line_of and
   slot_of. */
#include <stdint.h>

/* Ids ahead whose slot map entry and sketch line are prefetched, and how far ahead of
   the current id its slot's own8 byte and eviction key are (the map entry read then was
   prefetched PLAN_AHEAD - PLAN_OWN_AHEAD ids before). In the cache benchmark's steady
   state (~30 k ids a step, TinyLFU: the keys written by the second loop) 24 and 12 took
   the call ~0.09 ms less of its ~1.6 ms than 16 and 10 did; 32 and 16 were no faster,
   12 and 8 slower. */
#define PLAN_AHEAD 24
#define PLAN_OWN_AHEAD 12

/* For the batch's distinct ids [n] (increasing):
   - slots[i] := map[ids[i]] (the dense id -> slot map, int32, -1: not cached);
   - counters (NULL: no sketch): each id counted once, as hr_sketch_add;
   - the asks of hr_cache_ask: the misses and the cached rows whose OWN (own8 [C] below
     own8_max, else the record's word own_at) exceeds bound, their indices into asked [n]
     and copy clocks (record word clock_at; fill for a miss) into clock [n], in order;
   - keys (NULL: none), the eviction policy's keys [C] (cache.policy): keys[s] := tick for
     each cached row s, which marks it used by batch `tick` (no victim search takes it);
   - est (NULL, or no sketch: none): each id's estimate once every id is counted, as
     hr_sketch_estimate, in a second loop (the estimates need the whole batch counted);
   - with est, keys and fmax > 0, the second loop, not the first, writes each cached row's
     key, as TinyLFU's use does: keys[s] := min(est[i], fmax) << tick_bits | tick (one
     access to the key where the serving pass would make another).
   Record words are int64 words m floats into a record of w floats. Returns the asks. */
int64_t hr_plan_pull(int64_t n, const int64_t* ids, const int32_t* map, int64_t* slots,
                     int64_t depth, const uint64_t* mult, int64_t lines, int32_t* counters,
                     int64_t m, int64_t w, const float* slab, const uint8_t* own8,
                     int64_t own8_max, int64_t clock_at, int64_t own_at, int64_t bound,
                     int64_t fill, int64_t* asked, int64_t* clock, int64_t* keys,
                     int64_t tick, int64_t* est, int64_t fmax, int64_t tick_bits) {
    int64_t k = 0, per = depth > 0 ? 16 / depth : 0;
    /* the keys with the estimates, in the second loop */
    int64_t* keys_est = counters && est && keys && fmax > 0 ? keys : 0;
    if (keys_est) keys = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (i + PLAN_AHEAD < n) {
            uint64_t y = (uint64_t)ids[i + PLAN_AHEAD];
            __builtin_prefetch(map + y, 0, 0);
            if (counters) __builtin_prefetch(counters + 16 * line_of(y, mult[0], lines), 1, 0);
        }
        if (i + PLAN_OWN_AHEAD < n) {
            int32_t t = map[ids[i + PLAN_OWN_AHEAD]];
            if (t >= 0) {
                __builtin_prefetch(own8 + t, 0, 0);
                if (keys) __builtin_prefetch(keys + t, 1, 0);
            }
        }
        uint64_t x = (uint64_t)ids[i];
        if (counters) {
            int32_t* line = counters + 16 * line_of(x, mult[0], lines);
            for (int64_t d = 0; d < depth; ++d) line[slot_of(x, mult[d], d, per)] += 1;
        }
        int64_t s = map[x];
        slots[i] = s;
        const int64_t* meta = s >= 0 ? (const int64_t*)(slab + s * w + m) : 0;
        if (s >= 0) {
            if (keys) keys[s] = tick;
            int64_t own = own8[s] < own8_max ? own8[s] : meta[own_at];
            if (own <= bound) continue;
        }
        asked[k] = i;
        clock[k++] = s < 0 ? fill : meta[clock_at];
    }
    if (!counters || !est) return k;
    for (int64_t i = 0; i < n; ++i) {
        if (i + SKETCH_AHEAD < n) {
            uint64_t y = (uint64_t)ids[i + SKETCH_AHEAD];
            __builtin_prefetch(counters + 16 * line_of(y, mult[0], lines), 0, 0);
            if (keys_est && slots[i + SKETCH_AHEAD] >= 0)
                __builtin_prefetch(keys_est + slots[i + SKETCH_AHEAD], 1, 0);
        }
        int64_t e = min_count((uint64_t)ids[i], depth, mult, lines, counters, per);
        est[i] = e;
        if (keys_est && slots[i] >= 0)
            keys_est[slots[i]] = ((e < fmax ? e : fmax) << tick_bits) + tick;
    }
    return k;
}
