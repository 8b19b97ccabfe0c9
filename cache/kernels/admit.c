/* An admission of a pull's misses in one pass (cache/kernels/admit.py). Compiled after
   records.c in one library: a victim leaves by its evict_one and a fresh record is
   written by its install_one, the very code of the separate eviction and install. */
#include <stdint.h>
#include <string.h>

/* The decided admission of ids [k] (distinct, not cached; the order the slots go in):
   1. evict_one of each of victims [nv] in order, those with pending updates packed into
      out_* (as hr_cache_evict), and every victim pushed on the free stack
      free_slots[0 .. n_free) (top last): free_slots[n_free + j] := victims[j];
   2. the first n = min(k, n_free + nv) ids take slots off the top of the stack:
      slots[i] := free_slots[n_free + nv - 1 - i];
   3. for each: map[ids[i]] := slots[i], row_id[slots[i]] := ids[i], its record written by
      install_one from fresh [m, d] at row sel[i] read at fresh_clock[sel[i]] by request
      seq with prefetch mark pf, own8[slots[i]] := 0, and (fresh_state not NULL) the
      record's state_dim floats at state_at := fresh_state[sel[i]] ([m, state_dim]).
   Record words are int64 words rw + d floats into a record of w floats. A victim's d
   floats out of its record are those at sum_at: rw (its pending sum) or 0 (its row, for
   a cache that writes its copies back; q floats at stat_at are then its state). *pending := how
   many victims had pending updates. Returns n (the caller's stack holds n_free + nv - n
   slots after). */
int64_t hr_cache_admit(int64_t nv, const int64_t* victims, int64_t k, const int64_t* ids,
                       int64_t* free_slots, int64_t n_free, int64_t d, int64_t rw, int kind,
                       int64_t w, int64_t stat_at, int64_t q, int64_t state_at,
                       int64_t state_dim, float* slab, int64_t* row_id, int32_t* map,
                       int64_t* key, int64_t free_key, uint8_t* own8, const float* fresh,
                       const int64_t* sel, const int64_t* fresh_clock, const float* fresh_state,
                       int64_t seq, int64_t pf, int64_t* out_ids, float* out_sums,
                       int64_t* out_counts, float* out_stats, int64_t* pending,
                       int64_t* slots, int64_t sum_at) {
    int64_t m = rw + d, p = 0;
    for (int64_t j = 0; j < nv; ++j) {
        prefetch_victim(slab, j + AHEAD < nv ? victims[j + AHEAD] : -1, m, w, row_id, key, map,
                        j + 2 < nv ? victims[j + 2] : -1);
        p += evict_one(victims[j], d, sum_at, w, m, stat_at, q, slab, row_id, map, key, free_key, p,
                       out_ids, out_sums, out_counts, out_stats);
        free_slots[n_free + j] = victims[j];
    }
    *pending = p;
    int64_t top = n_free + nv, n = k < top ? k : top;
    for (int64_t i = 0; i < n; ++i) slots[i] = free_slots[top - 1 - i];
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            prefetch_record(slab, slots[i + AHEAD], w);
            __builtin_prefetch(map + ids[i + AHEAD], 1, 0);
            __builtin_prefetch(row_id + slots[i + AHEAD], 1, 0);
            __builtin_prefetch(own8 + slots[i + AHEAD], 1, 0);
        }
        int64_t s = slots[i], r = sel[i];
        map[ids[i]] = (int32_t)s;
        row_id[s] = ids[i];
        install_one(d, rw, kind, w, s, d > 0 ? fresh + r * d : 0, fresh_clock[r], seq, pf, slab);
        own8[s] = 0;
        if (fresh_state && state_dim > 0)
            memcpy(slab + s * w + state_at, fresh_state + r * state_dim,
                   sizeof(float) * (size_t)state_dim);
    }
    return n;
}
