/* The row-wise kernels: greedy sampling rows, RMSNorm (after a residual addition or not), SwiGLU's
 * silu(g) * u, rotary embedding and the KV write. */
#include "tritonq_cpu.h"
#include "simd.h"

/* The largest of x[0 .. n - 1], for rows without NaN or infinities (the caller checks): finite-math lets the
 * reduction vectorise. */
__attribute__((optimize("finite-math-only"))) static float row_max(const float* x, int64_t n) {
    float m = x[0];
    for (int64_t j = 1; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* Greedy rows of a sampling step: for each row r of logits [R, V] float32 (rows `stride` floats apart), tokens[r] =
 * the first index of its largest logit and logprobs[r] = that token's log-probability, log_softmax(row)[token] =
 * -log(sum_j e^(x_j - max)); tokens[r] = -1 when the row holds a NaN or an infinity (its distribution means
 * nothing). One pass for the maximum, one for the sum: the sum vectorises through exp_f32. */
void tritonq_greedy_rows(const float* logits, int64_t R, int64_t V, int64_t stride, int64_t* tokens, double* logprobs) {
    for (int64_t r = 0; r < R; r++) {
        const float* x = logits + r * stride;
        int bad = 0;  /* a NaN or an infinity: all exponent bits set (integer test: no float flag can fold it) */
        for (int64_t j = 0; j < V; j++) {
            uint32_t u;
            memcpy(&u, &x[j], 4);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        if (bad) { tokens[r] = -1; logprobs[r] = 0.0; continue; }
        const float m = row_max(x, V);
        int64_t first = 0;  /* the first index of m: the first block of 64 holding it (vectorised test), then in it */
        for (;; first += 64) {
            int found = 0;
            const int64_t n = V - first < 64 ? V - first : 64;
            for (int64_t l = 0; l < n; l++) found |= x[first + l] == m;
            if (found) break;
        }
        while (x[first] != m) first++;
        float sum = 0.f;
        for (int64_t j = 0; j < V; j++) sum += exp_f32(x[j] - m);
        tokens[r] = first;
        logprobs[r] = -log((double)sum);
    }
}

/* RMSNorm of rows: y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), the statistics in float32, the normalised row
 * rounded to the dtype and then multiplied by the weight in the dtype (one more rounding), as the torch reference
 * (kernels/norm_rope.rms_norm_reference, HF Llama's order). x rows stride_x elements apart, y [R, D] contiguous,
 * w [D]. With h (rows stride_h apart) the row normalised is x[r] + h[r] rounded to the dtype, as torch's addition
 * rounds it, and that sum is written to sum [R, D] contiguous too (a pre-norm layer's residual stream: one pass
 * instead of an addition and a norm). dtype as tritonq_paged_attention's. */
#define RMS_NORM(SUFFIX, T, LOAD, STORE)                                                                          \
static void rms_norm_##SUFFIX(const T* x, const T* h, int64_t R, int64_t D, int64_t stride_x, int64_t stride_h,  \
                              const T* w, float eps, T* sum, T* y) {                                             \
    for (int64_t r = 0; r < R; r++) {                                                                            \
        const T* xr = x + r * stride_x;                                                                          \
        T* yr = y + r * D;                                                                                       \
        if (h) {                                                                                                 \
            const T* hr = h + r * stride_h;                                                                      \
            T* sr = sum + r * D;                                                                                 \
            for (int64_t d = 0; d < D; d++) sr[d] = STORE(LOAD(xr[d]) + LOAD(hr[d]));                          \
            xr = sr;                                                                                             \
        }                                                                                                        \
        float squares = 0.f;                                                                                     \
        for (int64_t d = 0; d < D; d++) { const float v = LOAD(xr[d]); squares += v * v; }                     \
        const float rstd = 1.f / sqrtf(squares / (float)D + eps);                                                \
        for (int64_t d = 0; d < D; d++) yr[d] = STORE(LOAD(w[d]) * LOAD(STORE(LOAD(xr[d]) * rstd)));           \
    }                                                                                                            \
}
EACH_DTYPE(RMS_NORM)

/* Returns 0, or -2 for float16 in a build without it. h and sum NULL: no addition. */
int tritonq_rms_norm(int dtype, const void* x, const void* h, int64_t R, int64_t D, int64_t stride_x, int64_t stride_h,
                     const void* w, float eps, void* sum, void* y) {
    CALL_FOR_DTYPE(dtype, rms_norm, x, h, R, D, stride_x, stride_h, w, eps, sum, y);
    return 0;
}

/* SwiGLU's product: y[r] = silu(g[r]) * u[r] for rows of gu [R, 2I] (g its first I values, u the rest; rows stride
 * elements apart) into y [R, I] contiguous, rounded as torch's F.silu(g) * u rounds it: silu(g) = g / (1 + e^-g) in
 * float32 rounded to the dtype, then the product rounded. One pass instead of a split, a silu and a multiply. */
#define SILU_MUL(SUFFIX, T, LOAD, STORE)                                                                        \
static void silu_mul_##SUFFIX(const T* gu, int64_t R, int64_t I, int64_t stride, T* y) {                        \
    for (int64_t r = 0; r < R; r++) {                                                                           \
        const T *g = gu + r * stride, *u = g + I;                                                               \
        T* yr = y + r * I;                                                                                      \
        for (int64_t i = 0; i < I; i++) {                                                                       \
            const float x = LOAD(g[i]);                                                                         \
            yr[i] = STORE(LOAD(STORE(x / (1.f + exp_f32(-x)))) * LOAD(u[i]));                                   \
        }                                                                                                       \
    }                                                                                                           \
}
EACH_DTYPE(SILU_MUL)

/* dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0; -2 when this build has no float16. */
int tritonq_silu_mul(int dtype, const void* gu, int64_t R, int64_t I, int64_t stride, void* y) {
    CALL_FOR_DTYPE(dtype, silu_mul, gu, R, I, stride, y);
    return 0;
}

/* Rotary embedding of rows r of x [R, H, D] (rows stride_r apart, heads stride_h apart, D contiguous) by cos / sin
 * [R, D] (contiguous, x's dtype), into y [R, H, D] contiguous: y = x * cos + rotate_half(x) * sin with
 * rotate_half(x) = (-x[D/2:], x[:D/2]), rounded as norm_rope.apply_rope's torch ops round it: x * cos to the dtype,
 * then the sum (one rounding after float32 arithmetic). */
#define ROPE(SUFFIX, T, LOAD, STORE)                                                                            \
static void rope_##SUFFIX(const T* x, int64_t R, int64_t H, int64_t D, int64_t stride_r, int64_t stride_h,       \
                          const T* cos, const T* sin, T* y) {                                                    \
    const int64_t half = D / 2;                                                                                 \
    for (int64_t r = 0; r < R; r++) {                                                                           \
        const T *c = cos + r * D, *s = sin + r * D;                                                             \
        for (int64_t h = 0; h < H; h++) {                                                                       \
            const T* xr = x + r * stride_r + h * stride_h;                                                      \
            T* yr = y + (r * H + h) * D;                                                                        \
            for (int64_t d = 0; d < half; d++)                                                                  \
                yr[d] = STORE(LOAD(STORE(LOAD(xr[d]) * LOAD(c[d]))) - LOAD(xr[d + half]) * LOAD(s[d]));         \
            for (int64_t d = half; d < D; d++)                                                                  \
                yr[d] = STORE(LOAD(STORE(LOAD(xr[d]) * LOAD(c[d]))) + LOAD(xr[d - half]) * LOAD(s[d]));         \
        }                                                                                                       \
    }                                                                                                           \
}
EACH_DTYPE(ROPE)

/* dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0; -2 when this build has no float16. */
int tritonq_rope(int dtype, const void* x, int64_t R, int64_t H, int64_t D, int64_t stride_r, int64_t stride_h,
                 const void* cos, const void* sin, void* y) {
    CALL_FOR_DTYPE(dtype, rope, x, R, H, D, stride_r, stride_h, cos, sin, y);
    return 0;
}

/* A step's new keys and values into their page slots: token t's rows k + t * stride_k and v + t * stride_v
 * (row_k / row_v bytes each: all kv heads of the token) go to row slots[t] of the pages seen as rows (num_slots of
 * them); a slot < 0 is skipped (padding). Returns 0; -1, writing nothing, when a slot is num_slots or more. */
int tritonq_write_kv(char* k_pages, char* v_pages, const char* k, const char* v, const int64_t* slots, int64_t T,
                     int64_t num_slots, int64_t row_k, int64_t row_v, int64_t stride_k, int64_t stride_v) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_pages + slot * row_k, k + t * stride_k, (size_t)row_k);
        memcpy(v_pages + slot * row_v, v + t * stride_v, (size_t)row_v);
    }
    return 0;
}
