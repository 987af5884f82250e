/* The CPU backend's C kernels, built and called by tritonq/kernels/cpu_native.py (its docstring says why and how
 * fast): paged attention (prefill and decode), RMSNorm (after a residual addition or not), SwiGLU's silu(g) * u,
 * linears over rows (small bf16 ones at few rows; all in the batch-invariant mode), rotary embedding, the KV write
 * and the greedy rows of a sampling step.
 *
 * Paged attention (prefill chunks and decode rows in one call; shapes as tritonq/kernels/attention/). Scores,
 * softmax and the sums are float32; the probabilities are rounded to the input dtype before the PV product and the
 * output is rounded once, as in the Triton kernels.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_f32(float x) { return x; }
static inline float to_f32(float x) { return x; }
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {  /* round to nearest even; a NaN stays a NaN (a select: loops vectorise) */
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 64;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
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

/* One work item: sequence b, kv head h, its queries q0 .. q0 + nq - 1 (of n_q = cu[b + 1] - cu[b], at positions
 * ctx - n_q + i); their nq * G query heads are the item's rows. Keys come in tiles of TILE consecutive positions
 * (aligned, so with page_size >= TILE a tile lies in one page): the tile's keys are converted to float32 and
 * transposed, kt[d][l], so each row's TILE scores are one vector of D fused multiply-adds (no horizontal sum per
 * key), and its values converted, vt[l][d]. Softmax is online, per row: running max m, sum s (float32) and
 * accumulator acc[D]; each tile's probabilities are rounded to the input dtype before the PV product, as in the
 * Triton kernels. A key j is visible to the query at position p iff j <= p and (window 0 or p - j < window); a row
 * with no visible key gives zeros. D is a compile-time constant for the common head sizes (the loops over d
 * unroll into registers). */
#define TILE 16
#define SUBTILES 4  /* key tiles per step of a row in the AVX-512 item: one softmax update per 64 keys */

/* Where key j's row of kv head h starts in the pages (elements): page pages[j / ps], row j % ps (ps = 1 << shift),
 * each row holding every kv head's D values. */
static inline int64_t key_row(const int32_t* pages, int64_t j, int64_t ps, int64_t shift, int64_t row_stride,
                              int64_t h, int64_t D) {
    return ((int64_t)pages[j >> shift] * ps + (j & (ps - 1))) * row_stride + h * D;
}

/* An item's rows out: each accumulator divided by its row's sum, in the dtype (zeros where no key was visible). */
#define WRITE_ROWS(T, STORE)                                                                                    \
    for (int64_t i = 0; i < nq; i++)                                                                            \
        for (int64_t g = 0; g < G; g++) {                                                                       \
            const int64_t r = i * G + g;                                                                        \
            T* o = out + ((cu[b] + q0 + i) * H + h * G + g) * D;                                                \
            const float norm = sum[r] > 0.f ? 1.f / sum[r] : 0.f;  /* no visible key: zeros */                  \
            for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[r * D + d] * norm);                                \
        }
#define ITEM(NAME, T, LOAD, STORE, DIM)                                                                         \
static void NAME(const T* q, const T* kp, const T* vp, const int32_t* table, int64_t table_w, const int32_t* cu, \
                 const int32_t* ctx_lens, int64_t H, int64_t Hkv, int64_t D_, int64_t ps, int64_t window,        \
                 float scale, T* out, int64_t b, int64_t h, int64_t q0, int64_t nq, float* buf) {                 \
    const int64_t D = DIM ? DIM : D_, G = H / Hkv, rows = nq * G, n_q = cu[b + 1] - cu[b], ctx = ctx_lens[b];   \
    const int64_t row_stride = Hkv * D, shift = __builtin_ctzll((unsigned long long)ps);                        \
    const int64_t pos0 = ctx - n_q + q0, last = pos0 + nq - 1;  /* positions of the first and last query */    \
    int64_t first = window > 0 ? pos0 - window + 1 : 0;  /* the first key any of the rows sees */               \
    if (first < 0) first = 0;                                                                                   \
    const int32_t* pages = table + b * table_w;                                                                 \
    float *kt = buf, *vt = kt + D * TILE, *qf = vt + TILE * D, *acc = qf + rows * D, *mx = acc + rows * D;      \
    float* sum = mx + rows;                                                                                     \
    for (int64_t i = 0; i < nq; i++)                                                                            \
        for (int64_t g = 0; g < G; g++) {                                                                       \
            const T* qr = q + ((cu[b] + q0 + i) * H + h * G + g) * D;                                           \
            const int64_t r = i * G + g;                                                                        \
            for (int64_t d = 0; d < D; d++) { qf[r * D + d] = LOAD(qr[d]) * scale; acc[r * D + d] = 0.f; }     \
            mx[r] = -INFINITY;                                                                                  \
            sum[r] = 0.f;                                                                                       \
        }                                                                                                       \
    for (int64_t t0 = first & ~(int64_t)(TILE - 1); t0 <= last; t0 += TILE) {                                   \
        for (int64_t l = 0; l < TILE; l++) {  /* keys outside first .. last are zeros (and masked below) */    \
            const int64_t j = t0 + l;                                                                           \
            if (j < first || j > last) {                                                                        \
                for (int64_t d = 0; d < D; d++) { kt[d * TILE + l] = 0.f; vt[l * D + d] = 0.f; }               \
                continue;                                                                                       \
            }                                                                                                   \
            const int64_t at = key_row(pages, j, ps, shift, row_stride, h, D);                                  \
            const T *k = kp + at, *v = vp + at;                                                                 \
            for (int64_t d = 0; d < D; d++) kt[d * TILE + l] = LOAD(k[d]);                                      \
            for (int64_t d = 0; d < D; d++) vt[l * D + d] = LOAD(v[d]);                                         \
        }                                                                                                       \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const int64_t p = pos0 + r / G, lo = window > 0 && p - window + 1 > first ? p - window + 1 : first; \
            if (p < t0 || lo > t0 + TILE - 1) continue;  /* no key of this tile is visible to the row */        \
            const float* qr = qf + r * D;                                                                       \
            float s[TILE], e[TILE];                                                                             \
            for (int64_t l = 0; l < TILE; l++) s[l] = 0.f;                                                      \
            for (int64_t d = 0; d < D; d++)                                                                     \
                for (int64_t l = 0; l < TILE; l++) s[l] += qr[d] * kt[d * TILE + l];                           \
            for (int64_t l = 0; l < TILE; l++) s[l] = t0 + l >= lo && t0 + l <= p ? s[l] : -INFINITY;           \
            for (int64_t l = 0; l < TILE; l++) e[l] = s[l];                                                     \
            for (int64_t w = TILE / 2; w > 0; w /= 2)  /* the tile's max by halving: no loop-carried reduction */  \
                for (int64_t l = 0; l < w; l++) e[l] = e[l] > e[l + w] ? e[l] : e[l + w];                       \
            const float m = e[0] > mx[r] ? e[0] : mx[r], correction = exp_f32(mx[r] - m);                       \
            /* separate loops: gcc vectorises each, not their fusion */                                         \
            for (int64_t l = 0; l < TILE; l++) e[l] = s[l] == -INFINITY ? 0.f : exp_f32(s[l] - m);             \
            float total = 0.f;                                                                                  \
            for (int64_t l = 0; l < TILE; l++) total += e[l];                                                   \
            for (int64_t l = 0; l < TILE; l++) e[l] = LOAD(STORE(e[l]));                                        \
            sum[r] = sum[r] * correction + total;                                                               \
            mx[r] = m;                                                                                          \
            float* a = acc + r * D;                                                                             \
            for (int64_t d = 0; d < D; d++) a[d] *= correction;                                                 \
            for (int64_t l = 0; l < TILE; l++)                                                                  \
                for (int64_t d = 0; d < D; d++) a[d] += e[l] * vt[l * D + d];                                   \
        }                                                                                                       \
    }                                                                                                           \
    WRITE_ROWS(T, STORE)                                                                                        \
}

#ifdef __AVX512F__
/* The same item with AVX-512 intrinsics, for D a multiple of 16: gcc does not find this schedule on its own (it
 * spills the transposed tile through scalar stores, whose vector reloads then stall). The tile's keys are
 * transposed in registers, 16 x 16 floats at a time; each row's 16 scores are D broadcast multiply-adds; the
 * accumulator is a row of D floats updated with one multiply-add per key and 16 columns. Spans start at multiples
 * of 64 keys, so a query's softmax updates group the same keys whichever item computes it (a decode row or a row of
 * a prefill chunk, with a sliding window too): a row's result does not depend on the other queries of the step. */
#include <immintrin.h>

static inline void transpose16(__m512 r[16]) {  /* r[i][j] <- r[j][i] */
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44); r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44); r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88); t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88); r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}
static inline __m512 exp_v(__m512 x) {  /* exp_f32, 16 lanes: the same steps */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 round16_f32(__m512 x) { return x; }
static inline __m512 round16_bf16(__m512 x) {  /* to bfloat16 and back: round to nearest even, NaN kept */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __m512i kept = _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_castsi512_ps(kept);  /* only probabilities in [0, 1] are rounded here: no NaN */
}
static inline __m512 round16_f16(__m512 x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }

#define ITEM_AVX512(NAME, T, LOAD, STORE, LOAD16, ROUND16)                                                             \
static void NAME(const T* q, const T* kp, const T* vp, const int32_t* table, int64_t table_w, const int32_t* cu,       \
                 const int32_t* ctx_lens, int64_t H, int64_t Hkv, int64_t D, int64_t ps, int64_t window,               \
                 float scale, T* out, int64_t b, int64_t h, int64_t q0, int64_t nq, float* buf) {                      \
    const int64_t G = H / Hkv, rows = nq * G, n_q = cu[b + 1] - cu[b], ctx = ctx_lens[b], C = D / 16;                  \
    const int64_t row_stride = Hkv * D, shift = __builtin_ctzll((unsigned long long)ps), SPAN = TILE * SUBTILES;       \
    const int64_t pos0 = ctx - n_q + q0, last = pos0 + nq - 1;                                                         \
    int64_t first = window > 0 ? pos0 - window + 1 : 0;                                                                \
    if (first < 0) first = 0;                                                                                          \
    const int32_t* pages = table + b * table_w;                                                                        \
    float *kt = buf, *vt = kt + D * SPAN, *qf = vt + SPAN * D, *acc = qf + rows * D, *mx = acc + rows * D;             \
    float *sum = mx + rows, e[TILE * SUBTILES] __attribute__((aligned(64)));                                           \
    for (int64_t i = 0; i < nq; i++)                                                                                   \
        for (int64_t g = 0; g < G; g++) {                                                                              \
            const T* qr = q + ((cu[b] + q0 + i) * H + h * G + g) * D;                                                  \
            const int64_t r = i * G + g;                                                                               \
            for (int64_t c = 0; c < C; c++) {                                                                          \
                _mm512_storeu_ps(qf + r * D + c * 16, _mm512_mul_ps(LOAD16(qr + c * 16), _mm512_set1_ps(scale)));      \
                _mm512_storeu_ps(acc + r * D + c * 16, _mm512_setzero_ps());                                           \
            }                                                                                                          \
            mx[r] = -INFINITY;                                                                                         \
            sum[r] = 0.f;                                                                                              \
        }                                                                                                              \
    for (int64_t t0 = first & ~(SPAN - 1); t0 <= last; t0 += SPAN) {  /* spans at multiples of 64: see above */        \
        const int64_t tiles = (last - t0) / TILE + 1 < SUBTILES ? (last - t0) / TILE + 1 : SUBTILES;                   \
        const T *krow[TILE * SUBTILES], *vrow[TILE * SUBTILES];                                                        \
        for (int64_t l = 0; l < TILE * tiles; l++) {                                                                   \
            const int64_t j = t0 + l;                                                                                  \
            if (j < first || j > last) { krow[l] = vrow[l] = 0; continue; }                                            \
            const int64_t at = key_row(pages, j, ps, shift, row_stride, h, D);                                         \
            krow[l] = kp + at;                                                                                         \
            vrow[l] = vp + at;                                                                                         \
        }                                                                                                              \
        for (int64_t l = 0, j = t0 + SPAN; l < SPAN && j <= last; l++, j++) {  /* the next span's rows: */             \
            const int64_t at = key_row(pages, j, ps, shift, row_stride, h, D);                                         \
            for (int64_t x = 0; x < D * (int64_t)sizeof(T); x += 64) {  /* pages are scattered: no prefetcher */       \
                __builtin_prefetch((const char*)(kp + at) + x);                                                        \
                __builtin_prefetch((const char*)(vp + at) + x);                                                        \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t s = 0; s < tiles; s++)                                                                            \
            for (int64_t c = 0; c < C; c++) {  /* tile s: kt[s][d][l] for d in c * 16 .. c * 16 + 15; vt[l][d] */      \
                __m512 t[16];                                                                                          \
                for (int64_t l = 0; l < TILE; l++) {                                                                   \
                    const T *k = krow[s * TILE + l], *v = vrow[s * TILE + l];                                          \
                    t[l] = k ? LOAD16(k + c * 16) : _mm512_setzero_ps();                                               \
                    _mm512_storeu_ps(vt + (s * TILE + l) * D + c * 16, v ? LOAD16(v + c * 16) : _mm512_setzero_ps());  \
                }                                                                                                      \
                transpose16(t);                                                                                        \
                for (int64_t i = 0; i < 16; i++) _mm512_storeu_ps(kt + (s * D + c * 16 + i) * TILE, t[i]);             \
            }                                                                                                          \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const int64_t p = pos0 + r / G, lo = window > 0 && p - window + 1 > first ? p - window + 1 : first;        \
            const int64_t end = t0 + TILE * tiles - 1;                                                                 \
            if (p < t0 || lo > end) continue;  /* no key of this span is visible to the row */                         \
            const int64_t a0 = lo > t0 ? lo - t0 : 0, a1 = p < end ? p - t0 : end - t0;  /* visible: a0 .. a1 */       \
            const int64_t s0 = a0 / TILE, s1 = a1 / TILE;                                                              \
            const float* qr = qf + r * D;                                                                              \
            __m512 sc[SUBTILES], top = _mm512_set1_ps(-INFINITY);                                                      \
            __mmask16 visible[SUBTILES];                                                                               \
            for (int64_t s = s0; s <= s1; s++) {                                                                       \
                const int64_t l0 = s == s0 ? a0 - s * TILE : 0, l1 = s == s1 ? a1 - s * TILE : TILE - 1;               \
                visible[s] = (__mmask16)((0xffffu >> (15 - l1)) & (0xffffu << l0));                                    \
                const float* k = kt + s * D * TILE;                                                                    \
                __m512 d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps();  /* two chains: latency */                  \
                for (int64_t d = 0; d < D; d += 2) {                                                                   \
                    d0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d]), _mm512_loadu_ps(k + d * TILE), d0);                    \
                    d1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + 1]), _mm512_loadu_ps(k + (d + 1) * TILE), d1);          \
                }                                                                                                      \
                sc[s] = _mm512_add_ps(d0, d1);                                                                         \
                top = _mm512_mask_max_ps(top, visible[s], top, sc[s]);                                                 \
            }                                                                                                          \
            const float span_max = _mm512_reduce_max_ps(top);                                                          \
            const float m = span_max > mx[r] ? span_max : mx[r], correction = exp_f32(mx[r] - m);                      \
            __m512 total = _mm512_setzero_ps();                                                                        \
            for (int64_t s = s0; s <= s1; s++) {                                                                       \
                const __m512 x = _mm512_maskz_mov_ps(visible[s], exp_v(_mm512_sub_ps(sc[s], _mm512_set1_ps(m))));      \
                total = _mm512_add_ps(total, x);                                                                       \
                _mm512_store_ps(e + s * TILE, ROUND16(x));                                                             \
            }                                                                                                          \
            sum[r] = sum[r] * correction + _mm512_reduce_add_ps(total);                                                \
            mx[r] = m;                                                                                                 \
            float* a = acc + r * D;                                                                                    \
            for (int64_t c = 0; c < C; c++) {  /* two chains over the keys: latency */                                 \
                __m512 v0 = _mm512_mul_ps(_mm512_loadu_ps(a + c * 16), _mm512_set1_ps(correction));                    \
                __m512 v1 = _mm512_setzero_ps();                                                                       \
                int64_t l = a0;                                                                                        \
                for (; l + 1 <= a1; l += 2) {                                                                          \
                    v0 = _mm512_fmadd_ps(_mm512_set1_ps(e[l]), _mm512_loadu_ps(vt + l * D + c * 16), v0);              \
                    v1 = _mm512_fmadd_ps(_mm512_set1_ps(e[l + 1]), _mm512_loadu_ps(vt + (l + 1) * D + c * 16), v1);    \
                }                                                                                                      \
                if (l <= a1) v0 = _mm512_fmadd_ps(_mm512_set1_ps(e[l]), _mm512_loadu_ps(vt + l * D + c * 16), v0);     \
                _mm512_storeu_ps(a + c * 16, _mm512_add_ps(v0, v1));                                                   \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    WRITE_ROWS(T, STORE)                                                                                               \
}
ITEM_AVX512(item_avx512_f32, float, from_f32, to_f32, load16_f32, round16_f32)
ITEM_AVX512(item_avx512_bf16, uint16_t, from_bf16, to_bf16, load16_bf16, round16_bf16)
#ifdef __FLT16_MAX__
ITEM_AVX512(item_avx512_f16, uint16_t, from_f16, to_f16, load16_f16, round16_f16)
#endif
#endif

#ifdef __AVX512F__  /* head dims that are multiples of 16 take the AVX-512 item */
#define ITEMS(SUFFIX, T, LOAD, STORE) ITEM(item_##SUFFIX##_any, T, LOAD, STORE, 0)
#else
#define ITEMS(SUFFIX, T, LOAD, STORE)                                                                           \
    ITEM(item_##SUFFIX##_any, T, LOAD, STORE, 0) ITEM(item_##SUFFIX##_32, T, LOAD, STORE, 32)                  \
    ITEM(item_##SUFFIX##_64, T, LOAD, STORE, 64) ITEM(item_##SUFFIX##_128, T, LOAD, STORE, 128)
#endif
ITEMS(f32, float, from_f32, to_f32)
ITEMS(bf16, uint16_t, from_bf16, to_bf16)
#ifdef __FLT16_MAX__
ITEMS(f16, uint16_t, from_f16, to_f16)
#endif

#define CALL(SUFFIX, T, DIM) item_##SUFFIX##_##DIM((const T*)q, (const T*)k_pages, (const T*)v_pages, table,  \
    table_w, cu, ctx_lens, H, Hkv, D, page_size, window, scale, (T*)out, b, h, q0, nq, buf)
#ifdef __AVX512F__
#define DISPATCH(SUFFIX, T) do {                                                                                 \
    if (D % 16 == 0) item_avx512_##SUFFIX((const T*)q, (const T*)k_pages, (const T*)v_pages, table, table_w, cu,  \
                                          ctx_lens, H, Hkv, D, page_size, window, scale, (T*)out, b, h, q0, nq, buf); \
    else CALL(SUFFIX, T, any); } while (0)
#else
#define DISPATCH(SUFFIX, T) do {                                                                                 \
    if (D == 32) CALL(SUFFIX, T, 32); else if (D == 64) CALL(SUFFIX, T, 64);                                   \
    else if (D == 128) CALL(SUFFIX, T, 128); else CALL(SUFFIX, T, any); } while (0)
#endif

/* The arguments of one tritonq_paged_attention call, shared by the threads that run its items. */
typedef struct {
    int dtype;
    const void *q, *k_pages, *v_pages;
    const int32_t *table, *cu, *ctx_lens;
    int64_t table_w, B, H, Hkv, D, page_size, window, block;
    float scale;
    void* out;
    const int64_t* starts;  /* starts[b]: sequence b's first item; starts[B]: the number of items */
    int64_t claimed, done;  /* items claimed, items written (atomic) */
} attention_call;

/* One thread's share of a call: items claimed one at a time from the last (a sequence's later query blocks see
 * more keys: the larger items go first) until none is left. A thread without memory for its scratch claims none. */
static void attention_items(void* arg) {
    attention_call* a = arg;
    const int64_t B = a->B, H = a->H, Hkv = a->Hkv, D = a->D, page_size = a->page_size, window = a->window;
    const int64_t block = a->block, table_w = a->table_w, total = a->starts[B];
    const void *q = a->q, *k_pages = a->k_pages, *v_pages = a->v_pages;
    const int32_t *table = a->table, *cu = a->cu, *ctx_lens = a->ctx_lens;
    const float scale = a->scale;
    void* out = a->out;
    float* buf = malloc(sizeof(float) * (2 * TILE * SUBTILES * D + 2 * block * (H / Hkv) * D + 2 * block * (H / Hkv)));
    if (!buf) return;
    for (;;) {
        const int64_t claimed = __atomic_fetch_add(&a->claimed, 1, __ATOMIC_RELAXED);
        if (claimed >= total) break;
        const int64_t item = total - 1 - claimed;
        int64_t lo = 0, hi = B - 1;  /* the sequence b with starts[b] <= item < starts[b + 1] */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (a->starts[mid] <= item) lo = mid; else hi = mid - 1;
        }
        const int64_t b = lo, h = (item - a->starts[b]) % Hkv, q0 = (item - a->starts[b]) / Hkv * block;
        const int64_t n_q = cu[b + 1] - cu[b], nq = n_q - q0 < block ? n_q - q0 : block;
        if (a->dtype == 1) DISPATCH(bf16, uint16_t);
#ifdef __FLT16_MAX__
        else if (a->dtype == 2) DISPATCH(f16, uint16_t);
#endif
        else DISPATCH(f32, float);
        __atomic_fetch_add(&a->done, 1, __ATOMIC_RELAXED);
    }
    free(buf);
}

/* libgomp's entry for a parallel region (LLVM's and Intel's OpenMP runtimes export it too): fn(data) on a team of
 * num_threads threads, the caller one of them; returns when every thread has returned. */
typedef void (*omp_parallel_fn)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);

/* Paged attention over packed queries, prefill and decode alike. q and out [T, H, D], sequence b's queries rows
 * cu[b] .. cu[b + 1] - 1 at positions ctx_lens[b] - n_q .. ctx_lens[b] - 1 (a decode row: n_q = 1); k and v pages
 * [P, page_size, Hkv, D] contiguous (one token's row holds every kv head); block_table [B, table_w] int32;
 * query head i reads kv head i / (H / Hkv) (GQA). Work items: a block of up to `block` queries of one sequence and
 * one kv head. With omp_parallel (GOMP_parallel of the OpenMP runtime torch runs on) and threads > 1 the items are
 * shared by a team of that runtime, i.e. torch's own worker threads, which spin for a while after each torch op: a
 * thread of our own would compete with them for the cores instead. dtype: 0 float32, 1 bfloat16, 2 float16. Returns
 * 0; -1 when out of memory, -2 when this build has no float16. */
int tritonq_paged_attention(void* omp_parallel, int threads, int dtype, const void* q, const void* k_pages,
                            const void* v_pages, const int32_t* table, int64_t table_w, const int32_t* cu,
                            const int32_t* ctx_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                            int64_t window, float scale, void* out, int64_t block) {
#ifndef __FLT16_MAX__
    if (dtype == 2) return -2;
#endif
    int64_t* starts = malloc(sizeof(int64_t) * (B + 1));
    if (!starts) return -1;
    starts[0] = 0;
    for (int64_t b = 0; b < B; b++) starts[b + 1] = starts[b] + (cu[b + 1] - cu[b] + block - 1) / block * Hkv;
    attention_call call = {dtype, q, k_pages, v_pages, table, cu, ctx_lens, table_w, B, H, Hkv, D, page_size,
                           window, block, scale, out, starts, 0, 0};
    const int64_t total = starts[B], team = threads < total ? threads : total;
    if (omp_parallel && team > 1) ((omp_parallel_fn)omp_parallel)(attention_items, &call, (unsigned)team, 0);
    else attention_items(&call);
    free(starts);
    return call.done == total ? 0 : -1;
}

/* 1 when this build computes float16 (the compiler has _Float16), else 0. */
int tritonq_has_float16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
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

/* The row-wise kernels below are written once as a macro F(SUFFIX, T, LOAD, STORE) of the element type and its
 * conversions to and from float32; EACH_DTYPE(F) instantiates F for float32, bfloat16 and (where the compiler has
 * _Float16) float16, and CALL_FOR_DTYPE(dtype, name, args...) calls name_<dtype>(args...) for the dtype code of
 * tritonq_paged_attention (0 float32, 1 bfloat16, 2 float16), returning -2 from the caller for float16 in a build
 * without it. */
#ifdef __FLT16_MAX__
#define EACH_DTYPE(F) F(f32, float, from_f32, to_f32) F(bf16, uint16_t, from_bf16, to_bf16) \
                      F(f16, uint16_t, from_f16, to_f16)
#define CALL_FOR_DTYPE(dtype, NAME, ...)                                                                          \
    do { if ((dtype) == 1) NAME##_bf16(__VA_ARGS__); else if ((dtype) == 2) NAME##_f16(__VA_ARGS__);             \
         else NAME##_f32(__VA_ARGS__); } while (0)
#else
#define EACH_DTYPE(F) F(f32, float, from_f32, to_f32) F(bf16, uint16_t, from_bf16, to_bf16)
#define CALL_FOR_DTYPE(dtype, NAME, ...)                                                                          \
    do { if ((dtype) == 2) return -2; if ((dtype) == 1) NAME##_bf16(__VA_ARGS__); else NAME##_f32(__VA_ARGS__); } \
    while (0)
#endif

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

/* A linear over rows (a decode step of a small model; every linear in the batch-invariant mode): y [M, N] = x [M, K]
 * @ w (+ bias), w stored k-major [K, Np] (Np = N rounded up to SMALL_COLS, the padding columns zero), x rows stride_x
 * elements apart, bias float32 [N] or NULL, y [M, N] contiguous; products and sums in float32 (a bf16 or fp16
 * product is exact there), rounded to the dtype once, after the bias. A block of up to SMALL_ROWS rows and SMALL_COLS
 * columns keeps its sums in registers while the weight's rows stream by, so each weight value is read once per
 * SMALL_ROWS rows and no horizontal sum is needed. Each output is one chain of multiply-adds in k order, whatever
 * the row count, the block a row falls in or the thread that runs it: a row's result does not depend on the other
 * rows (kernels/cpu_dense.py: where oneDNN's per-call cost dominates, and the batch-invariant mode). */
#define SMALL_COLS 64
#define SMALL_ROWS 4
#ifdef __AVX512F__
#define SMALL_BLOCK(SUFFIX, T, LOAD, STORE, LOAD16)                                                               \
static inline __attribute__((always_inline)) void small_block_##SUFFIX(const T* x, int64_t R, int64_t K,        \
        int64_t stride_x, const T* w, int64_t Np, float out[SMALL_ROWS][SMALL_COLS]) {                          \
    __m512 acc[SMALL_ROWS][SMALL_COLS / 16];                                                                     \
    for (int64_t r = 0; r < R; r++)                                                                              \
        for (int c = 0; c < SMALL_COLS / 16; c++) acc[r][c] = _mm512_setzero_ps();                               \
    for (int64_t k = 0; k < K; k++) {                                                                            \
        const T* wk = w + k * Np;                                                                                \
        __m512 wv[SMALL_COLS / 16];                                                                              \
        for (int c = 0; c < SMALL_COLS / 16; c++) wv[c] = LOAD16(wk + 16 * c);                                   \
        for (int64_t r = 0; r < R; r++) {                                                                        \
            const __m512 xr = _mm512_set1_ps(LOAD(x[r * stride_x + k]));                                         \
            for (int c = 0; c < SMALL_COLS / 16; c++) acc[r][c] = _mm512_fmadd_ps(xr, wv[c], acc[r][c]);         \
        }                                                                                                        \
    }                                                                                                            \
    for (int64_t r = 0; r < R; r++)                                                                              \
        for (int c = 0; c < SMALL_COLS / 16; c++) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);                  \
}
#define SMALL_BLOCKS(F) F(f32, float, from_f32, to_f32, load16_f32) F(bf16, uint16_t, from_bf16, to_bf16, load16_bf16)
#define SMALL_BLOCKS_F16(F) F(f16, uint16_t, from_f16, to_f16, load16_f16)
#else
#define SMALL_BLOCK(SUFFIX, T, LOAD, STORE, LOAD16)                                                               \
static inline __attribute__((always_inline)) void small_block_##SUFFIX(const T* x, int64_t R, int64_t K,        \
        int64_t stride_x, const T* w, int64_t Np, float out[SMALL_ROWS][SMALL_COLS]) {                          \
    for (int64_t r = 0; r < R; r++)                                                                              \
        for (int c = 0; c < SMALL_COLS; c++) out[r][c] = 0.f;                                                    \
    for (int64_t k = 0; k < K; k++)                                                                              \
        for (int64_t r = 0; r < R; r++) {                                                                        \
            const float xr = LOAD(x[r * stride_x + k]);                                                          \
            for (int c = 0; c < SMALL_COLS; c++) out[r][c] += xr * LOAD(w[k * Np + c]);                         \
        }                                                                                                        \
}
#define SMALL_BLOCKS(F) F(f32, float, from_f32, to_f32, 0) F(bf16, uint16_t, from_bf16, to_bf16, 0)
#define SMALL_BLOCKS_F16(F) F(f16, uint16_t, from_f16, to_f16, 0)
#endif

/* One item of a call: rows m0 .. m0 + R - 1 (R <= SMALL_ROWS), columns n0 .. n0 + SMALL_COLS - 1. */
#define SMALL_ITEM(SUFFIX, T, LOAD, STORE, LOAD16)                                                                \
SMALL_BLOCK(SUFFIX, T, LOAD, STORE, LOAD16)                                                                      \
static void small_item_##SUFFIX(const T* x, int64_t M, int64_t K, int64_t stride_x, const T* w, int64_t N,       \
                                int64_t Np, const float* bias, T* y, int64_t m0, int64_t n0) {                   \
    float out[SMALL_ROWS][SMALL_COLS];                                                                           \
    const int64_t R = M - m0 < SMALL_ROWS ? M - m0 : SMALL_ROWS;                                                 \
    const T* xm = x + m0 * stride_x;                                                                             \
    switch (R) {  /* a constant row count: the block's loops unroll and its sums stay in registers */           \
        case 1: small_block_##SUFFIX(xm, 1, K, stride_x, w + n0, Np, out); break;                                \
        case 2: small_block_##SUFFIX(xm, 2, K, stride_x, w + n0, Np, out); break;                                \
        case 3: small_block_##SUFFIX(xm, 3, K, stride_x, w + n0, Np, out); break;                                \
        default: small_block_##SUFFIX(xm, 4, K, stride_x, w + n0, Np, out); break;                               \
    }                                                                                                            \
    const int64_t cols = N - n0 < SMALL_COLS ? N - n0 : SMALL_COLS;                                              \
    for (int64_t r = 0; r < R; r++)                                                                              \
        for (int64_t c = 0; c < cols; c++)                                                                       \
            y[(m0 + r) * N + n0 + c] = STORE(out[r][c] + (bias ? bias[n0 + c] : 0.f));                           \
}
SMALL_BLOCKS(SMALL_ITEM)
#ifdef __FLT16_MAX__
SMALL_BLOCKS_F16(SMALL_ITEM)
#endif

/* The arguments of one tritonq_small_linear call, shared by the threads that run its items. */
typedef struct {
    int dtype;
    const void *x, *w;
    int64_t M, K, stride_x, N, Np;
    const float* bias;
    void* y;
    int64_t claimed;  /* items claimed (atomic) */
} small_linear_call;

/* One thread's share of a call: items (row block, column block) claimed one at a time until none is left. */
static void small_linear_items(void* arg) {
    small_linear_call* a = arg;
    const int64_t col_blocks = (a->N + SMALL_COLS - 1) / SMALL_COLS;
    const int64_t total = (a->M + SMALL_ROWS - 1) / SMALL_ROWS * col_blocks;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&a->claimed, 1, __ATOMIC_RELAXED);
        if (item >= total) break;
        const int64_t m0 = item / col_blocks * SMALL_ROWS, n0 = item % col_blocks * SMALL_COLS;
#define SMALL_ARGS(T) (const T*)a->x, a->M, a->K, a->stride_x, (const T*)a->w, a->N, a->Np, a->bias, (T*)a->y, m0, n0
        if (a->dtype == 1) small_item_bf16(SMALL_ARGS(uint16_t));
#ifdef __FLT16_MAX__
        else if (a->dtype == 2) small_item_f16(SMALL_ARGS(uint16_t));
#endif
        else small_item_f32(SMALL_ARGS(float));
#undef SMALL_ARGS
    }
}

/* dtype as tritonq_paged_attention's (x, w and y of it). With omp_parallel (GOMP_parallel, as
 * tritonq_paged_attention takes it) and threads > 1 the items are shared by a team of torch's OpenMP threads.
 * Returns 0; -2 when this build has no float16. */
int tritonq_small_linear(void* omp_parallel, int threads, int dtype, const void* x, int64_t M, int64_t K,
                         int64_t stride_x, const void* w, int64_t N, int64_t Np, const float* bias, void* y) {
#ifndef __FLT16_MAX__
    if (dtype == 2) return -2;
#endif
    small_linear_call call = {dtype, x, w, M, K, stride_x, N, Np, bias, y, 0};
    const int64_t items = (M + SMALL_ROWS - 1) / SMALL_ROWS * ((N + SMALL_COLS - 1) / SMALL_COLS);
    const int64_t team = threads < items ? threads : items;
    if (omp_parallel && team > 1) ((omp_parallel_fn)omp_parallel)(small_linear_items, &call, (unsigned)team, 0);
    else small_linear_items(&call);
    return 0;
}
