/* The CPU backend's C kernels, built and called by tritonq/kernels/cpu_native.py (its docstring says why and how
 * fast): paged decode attention, RMSNorm and the greedy rows of a sampling step.
 *
 * Decode attention. Shapes as tritonq/kernels/attention/: q and out [B, H, D]; k and v pages
 * [P, page_size, Hkv, D] contiguous, so one token's row holds every kv head (Hkv * D values); block_table
 * [B, table_w] int32; lens [B] int32. Sequence b attends keys max(0, lens[b] - window) .. lens[b] - 1 (window 0:
 * all of them); query head i reads kv head i / (H / Hkv) (GQA). Scores, softmax and the sums are float32; the
 * probabilities are rounded to the input dtype before the PV product and the output is rounded once, as in the
 * Triton kernels.
 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_f32(float x) { return x; }
static inline float to_f32(float x) { return x; }
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {  /* round to nearest even; a NaN stays a NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* e^x in float32 (Cephes' expf: Cody-Waite reduction by ln 2, a degree-7 polynomial; within 2 ulp) in plain
 * arithmetic, so that loops over it vectorise (libm's expf is a call per element). x below -87.3 gives e^-87.3
 * (~1e-38, nothing next to the 1 of a row's largest term), +inf overflows to inf, NaN stays NaN. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#ifdef __FLT16_MAX__
static inline float from_f16(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t to_f16(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
#endif

/* One work item: sequence b, kv heads h0 .. h0 + hc - 1 (their hc * G query heads are the item's rows).
 * The keys are read token by token, all of the item's heads at once, so a page streams through in order;
 * D is a compile-time constant in the common head sizes, so the dot products unroll into vector registers. */
#define ITEM(NAME, T, LOAD, STORE, DIM)                                                                         \
static void NAME(const T* q, const T* kp, const T* vp, const int32_t* table, int64_t table_w,                  \
                 const int32_t* lens, int64_t H, int64_t Hkv, int64_t D_, int64_t ps, int64_t window,            \
                 float scale, T* out, int64_t b, int64_t h0, int64_t hc, float* scores, float* acc, float* qf) { \
    const int64_t D = DIM ? DIM : D_, G = H / Hkv, rows = hc * G, n = lens[b];                                  \
    const int64_t first = window > 0 && n > window ? n - window : 0, count = n - first;                         \
    const int64_t row_stride = Hkv * D, shift = __builtin_ctzll((unsigned long long)ps);                        \
    const int32_t* pages = table + b * table_w;                                                                 \
    T* o = out + (b * H + h0 * G) * D;                                                                          \
    if (count <= 0) {  /* no keys: zeros, as the kernels and references give */                                 \
        for (int64_t i = 0; i < rows * D; i++) o[i] = STORE(0.f);                                               \
        return;                                                                                                 \
    }                                                                                                           \
    const T* qb = q + (b * H + h0 * G) * D;                                                                     \
    for (int64_t i = 0; i < rows * D; i++) { qf[i] = LOAD(qb[i]) * scale; acc[i] = 0.f; }                      \
    for (int64_t j = 0, p = first; j < count; j++, p++) {  /* key p: row p % ps of page p / ps */              \
        const T* k = kp + ((int64_t)pages[p >> shift] * ps + (p & (ps - 1))) * row_stride + h0 * D;           \
        for (int64_t hh = 0, r = 0; hh < hc; hh++) {                                                            \
            const T* kh = k + hh * D;                                                                           \
            for (int64_t g = 0; g < G; g++, r++) {                                                              \
                const float* qr = qf + r * D;                                                                   \
                float s = 0.f;                                                                                  \
                for (int64_t d = 0; d < D; d++) s += qr[d] * LOAD(kh[d]);                                       \
                scores[r * count + j] = s;                                                                      \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int64_t r = 0; r < rows; r++) {  /* softmax; the sum stays float32, each probability is rounded */     \
        float* sc = scores + r * count;                                                                         \
        float m = -INFINITY, sum = 0.f;                                                                         \
        for (int64_t j = 0; j < count; j++) m = sc[j] > m ? sc[j] : m;                                          \
        for (int64_t j = 0; j < count; j++) { float e = exp_f32(sc[j] - m); sum += e; sc[j] = LOAD(STORE(e)); }\
        qf[r] = 1.f / sum;  /* q is no longer needed: its first rows hold the normalisers */                   \
    }                                                                                                           \
    for (int64_t j = 0, p = first; j < count; j++, p++) {                                                       \
        const T* v = vp + ((int64_t)pages[p >> shift] * ps + (p & (ps - 1))) * row_stride + h0 * D;           \
        for (int64_t hh = 0, r = 0; hh < hc; hh++) {                                                            \
            const T* vh = v + hh * D;                                                                           \
            for (int64_t g = 0; g < G; g++, r++) {                                                              \
                const float w = scores[r * count + j];                                                          \
                float* a = acc + r * D;                                                                         \
                for (int64_t d = 0; d < D; d++) a[d] += w * LOAD(vh[d]);                                        \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int64_t r = 0; r < rows; r++)                                                                          \
        for (int64_t d = 0; d < D; d++) o[r * D + d] = STORE(acc[r * D + d] * qf[r]);                          \
}

#define ITEMS(SUFFIX, T, LOAD, STORE)                                                                           \
    ITEM(item_##SUFFIX##_any, T, LOAD, STORE, 0) ITEM(item_##SUFFIX##_32, T, LOAD, STORE, 32)                  \
    ITEM(item_##SUFFIX##_64, T, LOAD, STORE, 64) ITEM(item_##SUFFIX##_128, T, LOAD, STORE, 128)
ITEMS(f32, float, from_f32, to_f32)
ITEMS(bf16, uint16_t, from_bf16, to_bf16)
#ifdef __FLT16_MAX__
ITEMS(f16, uint16_t, from_f16, to_f16)
#endif

#define CALL(SUFFIX, T, DIM) item_##SUFFIX##_##DIM((const T*)q, (const T*)k_pages, (const T*)v_pages, table,  \
    table_w, lens, H, Hkv, D, page_size, window, scale, (T*)out, item / chunks, (item % chunks) * hc, hc,       \
    scores, acc, qf)
#define DISPATCH(SUFFIX, T) do {                                                                                 \
    if (D == 32) CALL(SUFFIX, T, 32); else if (D == 64) CALL(SUFFIX, T, 64);                                   \
    else if (D == 128) CALL(SUFFIX, T, 128); else CALL(SUFFIX, T, any); } while (0)

/* Does work items until none is left: item i is sequence i / (Hkv / hc), kv heads (i % (Hkv / hc)) * hc ..,
 * claimed from counters[0]; counters[1] counts the items done. Several threads may run it at once on the
 * same arguments (each item is done by one of them); tritonq_wait_done waits for the others' items.
 * dtype: 0 float32, 1 bfloat16, 2 float16. max_keys: the most keys any sequence attends. Returns 0; -1 when
 * out of memory, -2 when this build has no float16 (both before claiming any item). */
int tritonq_decode_attention(int dtype, const void* q, const void* k_pages, const void* v_pages,
                             const int32_t* table, int64_t table_w, const int32_t* lens, int64_t B, int64_t H,
                             int64_t Hkv, int64_t D, int64_t page_size, int64_t window, float scale, void* out,
                             int64_t max_keys, int64_t hc, int64_t* counters) {
#ifndef __FLT16_MAX__
    if (dtype == 2) return -2;
#endif
    const int64_t chunks = Hkv / hc, rows = hc * (H / Hkv), total = B * chunks, keys = max_keys > 0 ? max_keys : 1;
    float* scores = malloc(sizeof(float) * (rows * keys + 2 * rows * D));
    if (!scores) return -1;
    float *acc = scores + rows * keys, *qf = acc + rows * D;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&counters[0], 1, __ATOMIC_RELAXED);
        if (item >= total) break;
        if (dtype == 1) DISPATCH(bf16, uint16_t);
#ifdef __FLT16_MAX__
        else if (dtype == 2) DISPATCH(f16, uint16_t);
#endif
        else DISPATCH(f32, float);
        __atomic_fetch_add(&counters[1], 1, __ATOMIC_RELEASE);
    }
    free(scores);
    return 0;
}

/* 1 when this build computes float16 (the compiler has _Float16), else 0. */
int tritonq_has_float16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* Returns once counters[1] reaches total: every claimed item is written. */
void tritonq_wait_done(int64_t* counters, int64_t total) {
    for (int spins = 0; __atomic_load_n(&counters[1], __ATOMIC_ACQUIRE) < total; spins++)
        if (spins > 64) sched_yield();
}

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
 * w [D]; dtype as tritonq_decode_attention's. */
#define RMS_NORM(SUFFIX, T, LOAD, STORE)                                                                          \
static void rms_norm_##SUFFIX(const T* x, int64_t R, int64_t D, int64_t stride_x, const T* w, float eps, T* y) { \
    for (int64_t r = 0; r < R; r++) {                                                                            \
        const T* xr = x + r * stride_x;                                                                          \
        T* yr = y + r * D;                                                                                       \
        float squares = 0.f;                                                                                     \
        for (int64_t d = 0; d < D; d++) { const float v = LOAD(xr[d]); squares += v * v; }                     \
        const float rstd = 1.f / sqrtf(squares / (float)D + eps);                                                \
        for (int64_t d = 0; d < D; d++) yr[d] = STORE(LOAD(w[d]) * LOAD(STORE(LOAD(xr[d]) * rstd)));           \
    }                                                                                                            \
}
RMS_NORM(f32, float, from_f32, to_f32)
RMS_NORM(bf16, uint16_t, from_bf16, to_bf16)
#ifdef __FLT16_MAX__
RMS_NORM(f16, uint16_t, from_f16, to_f16)
#endif

/* Returns 0, or -2 for float16 in a build without it. */
int tritonq_rms_norm(int dtype, const void* x, int64_t R, int64_t D, int64_t stride_x, const void* w, float eps,
                     void* y) {
    if (dtype == 1) rms_norm_bf16((const uint16_t*)x, R, D, stride_x, (const uint16_t*)w, eps, (uint16_t*)y);
#ifdef __FLT16_MAX__
    else if (dtype == 2) rms_norm_f16((const uint16_t*)x, R, D, stride_x, (const uint16_t*)w, eps, (uint16_t*)y);
#else
    else if (dtype == 2) return -2;
#endif
    else rms_norm_f32((const float*)x, R, D, stride_x, (const float*)w, eps, (float*)y);
    return 0;
}
