/* No fused multiply-add: -march=native enables FMA where the CPU has it, and contracting
   a*b+c there would make the bits depend on the machine (every CPU rounds alike here). */
#pragma GCC optimize ("fp-contract=off")
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld(const float* p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static float dot(const float* a, const float* b, int64_t d) {
    v8 acc = {0};
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) acc += ld(a + k) * ld(b + k);
    float s = hsum(acc);
    for (; k < d; ++k) s += a[k] * b[k];
    return s;
}

/* Feature i of sample b is the row rows[i] + b * stride ([D] floats): N separate
   [B, D] tensors (stride D) or one [B, N, D] tensor (rows[i] = t + i * D, stride N * D).
   out [B, W] (see the Python module). */
void hr_interaction_fwd(int64_t B, int64_t N, int64_t D, const float* const* rows,
                        int64_t stride, float* out, int64_t W, int with_first, int nthreads) {
    if (B < 64) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        float* o = out + b * W;
        int64_t k = 0;
        if (with_first) { memcpy(o, rows[0] + b * stride, (size_t)D * sizeof(float)); k = D; }
        for (int64_t i = 1; i < N; ++i) {
            const float* ti = rows[i] + b * stride;
            int64_t j = 0;
            if (D % 8 == 0) {
                for (; j + 4 <= i; j += 4) {  /* four dot products share the loads of t_i */
                    const float* t0 = rows[j] + b * stride;
                    const float* t1 = rows[j + 1] + b * stride;
                    const float* t2 = rows[j + 2] + b * stride;
                    const float* t3 = rows[j + 3] + b * stride;
                    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int64_t d = 0; d < D; d += 8) {
                        v8 x = ld(ti + d);
                        a0 += x * ld(t0 + d);
                        a1 += x * ld(t1 + d);
                        a2 += x * ld(t2 + d);
                        a3 += x * ld(t3 + d);
                    }
                    o[k++] = hsum(a0); o[k++] = hsum(a1); o[k++] = hsum(a2); o[k++] = hsum(a3);
                }
            }
            for (; j < i; ++j) o[k++] = dot(ti, rows[j] + b * stride, D);
        }
        for (; k < W; ++k) o[k] = 0.0f;
    }
}

/* g [B, W] (gradient of out), the rows as in the forward -> dt [B, N, D]. */
void hr_interaction_bwd(int64_t B, int64_t N, int64_t D, const float* const* rows,
                        int64_t stride, const float* g, int64_t W, int with_first, float* dt,
                        int nthreads) {
    if (B < 64) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
#define ROW(j) (rows[j] + b * stride)
        const float* gp = g + b * W + (with_first ? D : 0);  /* pair gradients */
        float* db = dt + b * N * D;
        for (int64_t i = 0; i < N; ++i) {
            float* di = db + i * D;
            int64_t d0 = 0;
            for (; d0 + 64 <= D; d0 += 64) {  /* 64 columns in 8 registers */
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int64_t j = 0; j < N; ++j) {
                    if (j == i) continue;
                    float s = i > j ? gp[i * (i - 1) / 2 + j] : gp[j * (j - 1) / 2 + i];
                    v8 gv = {s, s, s, s, s, s, s, s};
                    const float* tj = ROW(j) + d0;
                    a0 += gv * ld(tj);      a1 += gv * ld(tj + 8);
                    a2 += gv * ld(tj + 16); a3 += gv * ld(tj + 24);
                    a4 += gv * ld(tj + 32); a5 += gv * ld(tj + 40);
                    a6 += gv * ld(tj + 48); a7 += gv * ld(tj + 56);
                }
                st(di + d0, a0);      st(di + d0 + 8, a1);
                st(di + d0 + 16, a2); st(di + d0 + 24, a3);
                st(di + d0 + 32, a4); st(di + d0 + 40, a5);
                st(di + d0 + 48, a6); st(di + d0 + 56, a7);
            }
            for (; d0 + 8 <= D; d0 += 8) {
                v8 a = {0};
                for (int64_t j = 0; j < N; ++j) {
                    if (j == i) continue;
                    float s = i > j ? gp[i * (i - 1) / 2 + j] : gp[j * (j - 1) / 2 + i];
                    v8 gv = {s, s, s, s, s, s, s, s};
                    a += gv * ld(ROW(j) + d0);
                }
                st(di + d0, a);
            }
            for (; d0 < D; ++d0) {
                float a = 0.0f;
                for (int64_t j = 0; j < N; ++j) {
                    if (j == i) continue;
                    float s = i > j ? gp[i * (i - 1) / 2 + j] : gp[j * (j - 1) / 2 + i];
                    a += s * ROW(j)[d0];
                }
                di[d0] = a;
            }
        }
        if (with_first) {
            const float* g0 = g + b * W;
            for (int64_t d = 0; d < D; ++d) db[d] += g0[d];
        }
#undef ROW
    }
}
