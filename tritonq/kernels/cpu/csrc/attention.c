/* Paged attention (prefill chunks and decode rows in one call; shapes as tritonq/kernels/attention/). Scores,
 * softmax and the sums are float32; the probabilities are rounded to the input dtype before the PV product and the
 * output is rounded once, as in the Triton kernels. Why: tritonq/kernels/cpu/native.py. */
#include "tritonq_cpu.h"
#include "simd.h"

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
