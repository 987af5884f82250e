/* Linears over rows: small bf16 ones at few rows, every linear of the batch-invariant mode, 8-bit codes. */
#include "tritonq_cpu.h"
#include "simd.h"

/* A linear over rows (a decode step of a small model; every linear in the batch-invariant mode): y [M, N] = x [M, K]
 * @ w (+ bias), w stored k-major [K, Np] (Np = N rounded up to SMALL_COLS, the padding columns zero), x rows stride_x
 * elements apart, bias float32 [N] or NULL, y [M, N] contiguous; products and sums in float32 (a bf16 or fp16
 * product is exact there), rounded to the dtype once, after the bias. A block of up to SMALL_ROWS rows and SMALL_COLS
 * columns keeps its sums in registers while the weight's rows stream by, so each weight value is read once per
 * SMALL_ROWS rows and no horizontal sum is needed. Each output is one chain of multiply-adds in k order, whatever
 * the row count, the block a row falls in or the thread that runs it: a row's result does not depend on the other
 * rows (kernels/cpu/dense.py: where oneDNN's per-call cost dominates, and the batch-invariant mode). */
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

/* A linear over int8 codes with a float32 scale per group of k (symmetric 8-bit: GGUF Q8_0, GPTQ 8-bit sym):
 * y [M, N] = x [M, K] @ W^T (+ bias), W[n, k] = codes * scale as float32, x and y float32 (x rows stride_x apart,
 * y contiguous). codes int8 [Np / INT8_COLS, K, INT8_COLS] and scales [Np / INT8_COLS, K / group, INT8_COLS]: each
 * block of INT8_COLS columns is one contiguous stream (a cache line of codes per k), padding columns zero. Each
 * weight is read once per INT8_ROWS rows, its float value (code times scale, one rounding) made in registers, and
 * each output is one chain of multiply-adds in k order whatever the row count or thread: a row's result does not
 * depend on the other rows, and the values are those of the weight dequantized to float32 and summed in k order. */
#define INT8_COLS 64
#define INT8_ROWS 4
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void int8_block(const float* x, int64_t R, int64_t K,
        int64_t stride_x, const int8_t* codes, const float* scales, int64_t group, float out[INT8_ROWS][INT8_COLS]) {
    __m512 acc[INT8_ROWS][INT8_COLS / 16];
    for (int64_t r = 0; r < R; r++)
        for (int c = 0; c < INT8_COLS / 16; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += group) {
        __m512 s[INT8_COLS / 16];
        for (int c = 0; c < INT8_COLS / 16; c++) s[c] = _mm512_loadu_ps(scales + k0 / group * INT8_COLS + 16 * c);
        for (int64_t k = k0; k < k0 + group; k++) {
            const int8_t* wk = codes + k * INT8_COLS;
            __m512 wv[INT8_COLS / 16];
            for (int c = 0; c < INT8_COLS / 16; c++)
                wv[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                          _mm_loadu_si128((const __m128i*)(wk + 16 * c)))), s[c]);
            for (int64_t r = 0; r < R; r++) {
                const __m512 xr = _mm512_set1_ps(x[r * stride_x + k]);
                for (int c = 0; c < INT8_COLS / 16; c++) acc[r][c] = _mm512_fmadd_ps(xr, wv[c], acc[r][c]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int c = 0; c < INT8_COLS / 16; c++) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
}
#else
static inline __attribute__((always_inline)) void int8_block(const float* x, int64_t R, int64_t K,
        int64_t stride_x, const int8_t* codes, const float* scales, int64_t group, float out[INT8_ROWS][INT8_COLS]) {
    for (int64_t r = 0; r < R; r++)
        for (int c = 0; c < INT8_COLS; c++) out[r][c] = 0.f;
    for (int64_t k = 0; k < K; k++) {  /* the AVX-512 item's steps: the weight's value, then one multiply-add */
        const float* s = scales + k / group * INT8_COLS;
        float w[INT8_COLS];
        for (int c = 0; c < INT8_COLS; c++) w[c] = (float)codes[k * INT8_COLS + c] * s[c];
        for (int64_t r = 0; r < R; r++) {
            const float xr = x[r * stride_x + k];
            for (int c = 0; c < INT8_COLS; c++) out[r][c] += xr * w[c];
        }
    }
}
#endif

/* The arguments of one tritonq_int8_linear call, shared by the threads that run its items. */
typedef struct {
    const float* x;
    int64_t M, K, stride_x;
    const int8_t* codes;
    const float* scales;
    int64_t group, N;
    const float* bias;
    float* y;
    int64_t claimed;  /* items claimed (atomic) */
} int8_linear_call;

/* One thread's share of a call: items (row block, column block) claimed one at a time until none is left. */
static void int8_linear_items(void* arg) {
    int8_linear_call* a = arg;
    const int64_t col_blocks = (a->N + INT8_COLS - 1) / INT8_COLS;
    const int64_t total = (a->M + INT8_ROWS - 1) / INT8_ROWS * col_blocks;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&a->claimed, 1, __ATOMIC_RELAXED);
        if (item >= total) break;
        const int64_t m0 = item / col_blocks * INT8_ROWS, b = item % col_blocks, n0 = b * INT8_COLS;
        const int64_t R = a->M - m0 < INT8_ROWS ? a->M - m0 : INT8_ROWS;
        const float* xm = a->x + m0 * a->stride_x;
        const int8_t* codes = a->codes + b * a->K * INT8_COLS;
        const float* scales = a->scales + b * (a->K / a->group) * INT8_COLS;
        float out[INT8_ROWS][INT8_COLS];
        switch (R) {  /* a constant row count: the block's loops unroll and its sums stay in registers */
            case 1: int8_block(xm, 1, a->K, a->stride_x, codes, scales, a->group, out); break;
            case 2: int8_block(xm, 2, a->K, a->stride_x, codes, scales, a->group, out); break;
            case 3: int8_block(xm, 3, a->K, a->stride_x, codes, scales, a->group, out); break;
            default: int8_block(xm, 4, a->K, a->stride_x, codes, scales, a->group, out); break;
        }
        const int64_t cols = a->N - n0 < INT8_COLS ? a->N - n0 : INT8_COLS;
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++)
                a->y[(m0 + r) * a->N + n0 + c] = out[r][c] + (a->bias ? a->bias[n0 + c] : 0.f);
    }
}

/* group divides K. With omp_parallel (GOMP_parallel, as tritonq_paged_attention takes it) and threads > 1 the items
 * are shared by a team of torch's OpenMP threads. Returns 0. */
int tritonq_int8_linear(void* omp_parallel, int threads, const float* x, int64_t M, int64_t K, int64_t stride_x,
                        const int8_t* codes, const float* scales, int64_t group, int64_t N, const float* bias,
                        float* y) {
    int8_linear_call call = {x, M, K, stride_x, codes, scales, group, N, bias, y, 0};
    const int64_t items = (M + INT8_ROWS - 1) / INT8_ROWS * ((N + INT8_COLS - 1) / INT8_COLS);
    const int64_t team = threads < items ? threads : items;
    if (omp_parallel && team > 1) ((omp_parallel_fn)omp_parallel)(int8_linear_items, &call, (unsigned)team, 0);
    else int8_linear_items(&call);
    return 0;
}

/* A linear over GGUF's block formats as tritonq keeps them (quant/weights.py GGUFWeight), read in place:
 * y [M, N] = x [M, K] @ W^T (+ bias), x and y float32. Planes, each [rows, N] int32 / float32, N contiguous:
 * lo [K / 8, N] (the code's low 4 bits, k = 8 row + j at bits 4j), hi [K * H / 32, N] (H = bits - 4 high bits,
 * k at bits H (k mod 32 / H)) or NULL, scales and offsets (or NULL) [K / group, N], code float32 [16] (IQ4) or
 * NULL. W[n, k] = fma(v, scale, offset) with v = code[q] or q, the offset -zero * scale where there are none (zero
 * is 0 or a power of two: that product is exact, and q * scale - zero * scale = (q - zero) * scale, exact too):
 * each product is exact in float32, so this is the format's value with its one rounding. An item is a block of
 * rows (4, or from GGUF_TALL_M rows on 8: each weight value made once per 8 rows instead of 4) and of up to
 * GGUF_CHUNK columns, run a panel of 32 k at a time across its blocks of 64 (8 rows: 32) columns, so that the planes'
 * rows (4 N bytes apart) are read in runs of the item's width; within a panel a block's sums stay in registers and
 * its weight values are made there from the words of 8 (lo) or 32 / H (hi) k, the next panel's rows prefetched.
 * Whatever the blocks, the row count or the thread, each output is one chain of multiply-adds in k order over the
 * same values (its sum kept exactly in memory between panels): a row's result does not depend on the other rows.
 * K is a multiple of 32 (GGUF's smallest block). */
#define GGUF_ROWS 8       /* rows of the taller block */
#define GGUF_COLS 64      /* columns of the wider block */
#define GGUF_TALL_M 8     /* rows of a call from which its blocks are 8 x 32 */
#define GGUF_AHEAD 32     /* k prefetched ahead: the next panel */
#define GGUF_CHUNK 512    /* columns of an item */

/* The arguments of one tritonq_gguf_linear call, shared by the threads that run its items. */
typedef struct {
    const float* x;
    int64_t M, K, stride_x;
    const int32_t *lo, *hi;
    int64_t bits, zero;
    const float *code, *scales, *offsets;
    int64_t group, N;
    const float* bias;
    float* y;
    int64_t chunk;    /* columns of an item: a multiple of 64, at most GGUF_CHUNK */
    int64_t claimed;  /* items claimed (atomic) */
} gguf_linear_call;

#ifdef __AVX512F__
/* The panel k0 .. k0 + 31 of columns n0 .. n0 + cols - 1 (cols <= 16 V; masked loads past N) and R rows of x from
 * xm, its sums taken from and put back into sums: R, V (vectors of 16 columns), H (high bits) and the code table or
 * not are constants of each instantiation. */
static inline __attribute__((always_inline)) void gguf_block(const gguf_linear_call* a, const float* xm, int R,
        int64_t valid, int V, int H, int CODE, int64_t n0, int64_t cols, int64_t k0, float (*sums)[GGUF_CHUNK]) {
    const float* xr[GGUF_ROWS];  /* row r of the block, the last valid one for those past M */
    for (int r = 0; r < R; r++) xr[r] = xm + (r < valid ? r : valid - 1) * a->stride_x;
    const int64_t N = a->N, shift = a->group == 16 ? 4 : 5;
    __mmask16 mask[4];
    for (int c = 0; c < V; c++) {
        const int64_t left = cols - 16 * c;
        mask[c] = left >= 16 ? (__mmask16)0xffff : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1));
    }
    __m512 acc[GGUF_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < V; c++) acc[r][c] = _mm512_loadu_ps(sums[r] + 16 * c);
    const __m512 table = CODE ? _mm512_loadu_ps(a->code) : _mm512_setzero_ps();
    const __m512 minus_zero = _mm512_set1_ps(-(float)a->zero);
    const __m512i low4 = _mm512_set1_epi32(15);
    const int64_t kp = k0 + GGUF_AHEAD < a->K ? k0 + GGUF_AHEAD : k0;
    for (int c = 0; c < V; c++) {
        const int64_t at = n0 + 16 * c;
        for (int k8 = 0; k8 < 4; k8++) _mm_prefetch((const char*)(a->lo + (kp / 8 + k8) * N + at), _MM_HINT_T0);
        for (int h = 0; h < H; h++) _mm_prefetch((const char*)(a->hi + (kp * H / 32 + h) * N + at), _MM_HINT_T0);
        for (int g = 0; g < 32 >> shift; g++) {
            _mm_prefetch((const char*)(a->scales + ((kp >> shift) + g) * N + at), _MM_HINT_T0);
            if (a->offsets) _mm_prefetch((const char*)(a->offsets + ((kp >> shift) + g) * N + at), _MM_HINT_T0);
        }
    }
    for (int k16 = 0; k16 < 2; k16++) {  /* a group is 16 or 32 k: its scale row, read again for group 32 */
        __m512 s[4], o[4];
        __m512i hi[4];  /* the hi words of these 16 k (for H = 1, of these 32, read again) */
        for (int c = 0; c < V; c++) {
            const int64_t at = ((k0 + 16 * k16) >> shift) * N + n0 + 16 * c;
            if (H) hi[c] = _mm512_maskz_loadu_epi32(mask[c], a->hi + (k0 + 16 * k16) * H / 32 * N + n0 + 16 * c);
            s[c] = _mm512_maskz_loadu_ps(mask[c], a->scales + at);
            o[c] = a->offsets ? _mm512_maskz_loadu_ps(mask[c], a->offsets + at) : _mm512_mul_ps(s[c], minus_zero);
        }
        for (int k8 = 2 * k16; k8 < 2 * k16 + 2; k8++) {
            __m512i lo[4];
            for (int c = 0; c < V; c++)
                lo[c] = _mm512_maskz_loadu_epi32(mask[c], a->lo + (k0 / 8 + k8) * N + n0 + 16 * c);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int kk = 8 * k8 + j;
                __m512 w[4];
                for (int c = 0; c < V; c++) {
                    const __m512i nibbles = _mm512_srli_epi32(lo[c], 4 * j);
                    __m512i q;
                    if (H) {  /* k's high bits, bits H (kk mod 32 / H) of its hi word: to the top, then to 4 */
                        const __m512i high = _mm512_srli_epi32(
                            _mm512_slli_epi32(hi[c], 32 - H - H * (kk % (32 / H))), 28 - H);
                        /* bits 0-3 from nibbles, the rest from high (above 4 + H: zero): one select */
                        q = _mm512_ternarylogic_epi32(low4, nibbles, high, 0xCA);
                    } else {
                        q = _mm512_and_si512(nibbles, low4);
                    }
                    const __m512 v = CODE ? _mm512_permutexvar_ps(q, table) : _mm512_cvtepi32_ps(q);
                    w[c] = _mm512_fmadd_ps(v, s[c], o[c]);
                }
                for (int r = 0; r < R; r++) {
                    const __m512 xv = _mm512_set1_ps(xr[r][k0 + kk]);
                    for (int c = 0; c < V; c++) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < V; c++) _mm512_storeu_ps(sums[r] + 16 * c, acc[r][c]);
}
#else
static inline __attribute__((always_inline)) void gguf_block(const gguf_linear_call* a, const float* xm, int R,
        int64_t valid, int V, int H, int CODE, int64_t n0, int64_t cols, int64_t k0, float (*sums)[GGUF_CHUNK]) {
    const int64_t N = a->N;
    for (int64_t k = k0; k < k0 + 32; k++) {  /* the AVX-512 item's steps: the weight's value, then one multiply-add */
        const int32_t* lo = a->lo + k / 8 * N + n0;
        const int32_t* hi = H ? a->hi + k * H / 32 * N + n0 : NULL;
        const float* s = a->scales + k / a->group * N + n0;
        const float* o = a->offsets ? a->offsets + k / a->group * N + n0 : NULL;
        float w[GGUF_COLS];
        for (int c = 0; c < 16 * V; c++) {
            if (c >= cols) { w[c] = 0.f; continue; }
            int32_t q = (int32_t)(((uint32_t)lo[c] >> (4 * (k % 8))) & 15u);
            if (H) q |= (int32_t)((((uint32_t)hi[c] >> (H * (k % (32 / H)))) & ((1u << H) - 1)) << 4);
            w[c] = fmaf(CODE ? a->code[q] : (float)q, s[c], o ? o[c] : s[c] * -(float)a->zero);
        }
        for (int r = 0; r < R && r < valid; r++) {
            const float xr = xm[r * a->stride_x + k];
            for (int c = 0; c < 16 * V; c++) sums[r][c] = fmaf(xr, w[c], sums[r][c]);
        }
    }
}
#endif

/* An item's columns n0 .. n0 + cols - 1 (cols <= chunk) of R rows, a panel of 32 k at a time across its
 * blocks of 16 V columns (R, V, H and CODE constant: the block's loops unroll and its sums stay in registers within
 * a panel, in sums between panels), so that the planes' rows are read as runs of up to 4 GGUF_CHUNK bytes. */
static inline __attribute__((always_inline)) void gguf_item(const gguf_linear_call* a, const float* xm, int R,
        int64_t valid, int V, int H, int CODE, int64_t n0, int64_t cols, float (*sums)[GGUF_CHUNK]) {
    for (int64_t k0 = 0; k0 < a->K; k0 += 32)
        for (int64_t j = 0; j < cols; j += 16 * V)
            gguf_block(a, xm, R, valid, V, H, CODE, n0 + j, cols - j < 16 * V ? cols - j : 16 * V, k0,
                       (float (*)[GGUF_CHUNK])(sums[0] + j));
}

/* An item with H and CODE constant: blocks of 8 rows x 32 columns (the rows past M read the last row again (AVX-512;
 * the generic loop skips them), their sums dropped), or of 4 x 64 with R rows. */
#define GGUF_ITEM_CASES(H, CODE)                                                                                  \
    if (tall) gguf_item(a, xm, 8, R, 2, H, CODE, n0, cols, sums);                                                \
    else switch (R) {                                                                                            \
        case 1: gguf_item(a, xm, 1, 1, 4, H, CODE, n0, cols, sums); break;                                       \
        case 2: gguf_item(a, xm, 2, 2, 4, H, CODE, n0, cols, sums); break;                                       \
        case 3: gguf_item(a, xm, 3, 3, 4, H, CODE, n0, cols, sums); break;                                       \
        default: gguf_item(a, xm, 4, 4, 4, H, CODE, n0, cols, sums); break;                                      \
    }

/* One thread's share of a call: items (row block, chunk columns) claimed one at a time until none is left. */
static void gguf_linear_items(void* arg) {
    gguf_linear_call* a = arg;
    const int tall = a->M >= GGUF_TALL_M;
    const int64_t rows = tall ? 8 : 4;
    const int64_t col_chunks = (a->N + a->chunk - 1) / a->chunk, total = (a->M + rows - 1) / rows * col_chunks;
    float sums[GGUF_ROWS][GGUF_CHUNK];  /* the item's sums between panels (16 KB of this thread's stack) */
    for (;;) {
        const int64_t item = __atomic_fetch_add(&a->claimed, 1, __ATOMIC_RELAXED);
        if (item >= total) break;
        const int64_t m0 = item / col_chunks * rows, n0 = item % col_chunks * a->chunk;
        const int64_t R = a->M - m0 < rows ? a->M - m0 : rows;
        const int64_t cols = a->N - n0 < a->chunk ? a->N - n0 : a->chunk;
        const float* xm = a->x + m0 * a->stride_x;
        memset(sums, 0, sizeof(sums[0]) * rows);
        if (a->code) GGUF_ITEM_CASES(0, 1)
        else if (a->bits == 5) GGUF_ITEM_CASES(1, 0)
        else if (a->bits == 6) GGUF_ITEM_CASES(2, 0)
        else GGUF_ITEM_CASES(0, 0)
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++)
                a->y[(m0 + r) * a->N + n0 + c] = sums[r][c] + (a->bias ? a->bias[n0 + c] : 0.f);
    }
}

/* bits 4, 5 or 6 (hi NULL for 4), group 16 or 32, K a multiple of 32, zero 0 or a power of two without offsets, code
 * with bits 4 and zero 0 only (every GGUFWeight format: Q2_K ... Q6_K, Q4_1, Q5_0, Q5_1, IQ4). With omp_parallel
 * (GOMP_parallel, as tritonq_paged_attention takes it) and threads > 1 the items are shared by a team of torch's
 * OpenMP threads. Returns 0; -3 for a weight outside that. */
int tritonq_gguf_linear(void* omp_parallel, int threads, const float* x, int64_t M, int64_t K, int64_t stride_x,
                        const int32_t* lo, const int32_t* hi, int64_t bits, int64_t zero, const float* code,
                        const float* scales, const float* offsets, int64_t group, int64_t N, const float* bias,
                        float* y) {
    if (bits < 4 || bits > 6 || (bits > 4) != (hi != NULL) || (code && (bits != 4 || zero)) || zero < 0
        || (zero & (zero - 1)) || (zero && offsets) || (group != 16 && group != 32) || K % 32)
        return -3;
    /* about 4 items a thread per row block (room to balance a loaded machine), 64 to GGUF_CHUNK columns each */
    const int64_t share = (N + 4 * threads - 1) / (4 * threads), wide = (share + 63) / 64 * 64;
    const int64_t chunk = wide < GGUF_CHUNK ? wide : GGUF_CHUNK;
    gguf_linear_call call = {x, M, K, stride_x, lo, hi, bits, zero, code, scales, offsets, group, N, bias, y, chunk, 0};
    const int64_t rows = M >= GGUF_TALL_M ? 8 : 4;
    const int64_t items = (M + rows - 1) / rows * ((N + chunk - 1) / chunk);
    const int64_t team = threads < items ? threads : items;
    if (omp_parallel && team > 1) ((omp_parallel_fn)omp_parallel)(gguf_linear_items, &call, (unsigned)team, 0);
    else gguf_linear_items(&call);
    return 0;
}
