/* What the CPU backend's C files share (not part of the ABI, see tritonq_cpu.h): the element types' conversions
 * to and from float32, a vectorisable e^x, AVX-512 loads and roundings of 16 lanes, the per-dtype instantiation
 * macros and the OpenMP runtime's parallel-region entry. */
#ifndef TRITONQ_SIMD_H
#define TRITONQ_SIMD_H

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

#ifdef __AVX512F__
#include <immintrin.h>

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
#endif

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

/* libgomp's entry for a parallel region (LLVM's and Intel's OpenMP runtimes export it too): fn(data) on a team of
 * num_threads threads, the caller one of them; returns when every thread has returned. */
typedef void (*omp_parallel_fn)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);

#endif
