/* Several tables' ids packed into one id space (cache/kernels/pack_ids.py). */
#include <stdint.h>

/* out = the k parts one after the other, part j's ids parts[j] [sizes[j]] each plus
   base[j], checked in range on the way: 0 <= id < rows[j]. Returns the first part with
   an id out of range (out is then incomplete), or -1. One pass over the ids, where numpy
   concatenates, takes segment minima and maxima and adds the repeated bases in five. */
int64_t hr_pack_ids(int64_t k, const int64_t* const* parts, const int64_t* sizes,
                    const int64_t* base, const int64_t* rows, int64_t* out) {
    for (int64_t j = 0; j < k; ++j) {
        const int64_t* x = parts[j];
        int64_t n = sizes[j], b = base[j];
        uint64_t r = (uint64_t)rows[j];
        int bad = 0;
        /* (uint64_t)id >= rows catches negative ids too */
        for (int64_t i = 0; i < n; ++i) {
            bad |= (uint64_t)x[i] >= r;
            out[i] = x[i] + b;
        }
        if (bad) return j;
        out += n;
    }
    return -1;
}
