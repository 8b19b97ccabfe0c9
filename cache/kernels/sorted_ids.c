/* Sorted id arrays (cache/kernels/sorted_ids.py). */
#include <stdint.h>

/* out[0 .. r) = the ids of a [n] not in b [m], in order; both strictly increasing.
   Returns r. One merge pass: O(n + m), where a binary search per id of a costs
   O(n log m) with a branch miss per level. */
int64_t hr_sorted_difference(int64_t n, const int64_t* a, int64_t m, const int64_t* b,
                             int64_t* out) {
    int64_t j = 0, r = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t x = a[i];
        while (j < m && b[j] < x) ++j;
        if (j < m && b[j] == x) continue;
        out[r++] = x;
    }
    return r;
}
