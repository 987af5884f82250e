/* The CPU backend's C ABI: every function the library exports, as tritonq/kernels/cpu/native.py calls it through
 * ctypes (its SIGNATURES table must match these prototypes: tests/kernels/cpu/test_cpu_abi.py compares them).
 * dtype codes: 0 float32, 1 bfloat16, 2 float16. Functions returning int return 0 on success, -1 (out of memory,
 * or a slot out of range for tritonq_write_kv), -2 (float16 in a build whose compiler has no _Float16) and -3
 * (a weight layout tritonq_gguf_linear does not take).
 * omp_parallel: the address of GOMP_parallel of the OpenMP runtime torch runs on, or NULL for one thread. */
#ifndef TRITONQ_CPU_H
#define TRITONQ_CPU_H

#include <stdint.h>

/* attention.c: paged attention over packed queries, prefill chunks and decode rows in one call. */
int tritonq_paged_attention(void* omp_parallel, int threads, int dtype, const void* q, const void* k_pages,
                            const void* v_pages, const int32_t* table, int64_t table_w, const int32_t* cu,
                            const int32_t* ctx_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                            int64_t window, float scale, void* out, int64_t block);
/* 1 when this build computes float16, else 0. */
int tritonq_has_float16(void);

/* rows.c: a sampling step's greedy rows, RMSNorm (with the residual addition or not), SwiGLU's product, rotary
 * embedding and the KV write. */
void tritonq_greedy_rows(const float* logits, int64_t R, int64_t V, int64_t stride, int64_t* tokens,
                         double* logprobs);
int tritonq_rms_norm(int dtype, const void* x, const void* h, int64_t R, int64_t D, int64_t stride_x,
                     int64_t stride_h, const void* w, float eps, void* sum, void* y);
int tritonq_silu_mul(int dtype, const void* gu, int64_t R, int64_t I, int64_t stride, void* y);
int tritonq_rope(int dtype, const void* x, int64_t R, int64_t H, int64_t D, int64_t stride_r, int64_t stride_h,
                 const void* cos, const void* sin, void* y);
int tritonq_write_kv(char* k_pages, char* v_pages, const char* k, const char* v, const int64_t* slots, int64_t T,
                     int64_t num_slots, int64_t row_k, int64_t row_v, int64_t stride_k, int64_t stride_v);

/* linear.c: y [M, N] = x [M, K] @ w (k-major [K, Np]) (+ bias), each output one multiply-add chain in k order. */
int tritonq_small_linear(void* omp_parallel, int threads, int dtype, const void* x, int64_t M, int64_t K,
                         int64_t stride_x, const void* w, int64_t N, int64_t Np, const float* bias, void* y);
/* linear.c: y [M, N] float32 = x [M, K] float32 @ W^T (+ bias), W int8 codes times a float32 scale per group of k,
 * in column blocks (native.int8_linear_weight's layout); each output one multiply-add chain in k order. */
int tritonq_int8_linear(void* omp_parallel, int threads, const float* x, int64_t M, int64_t K, int64_t stride_x,
                        const int8_t* codes, const float* scales, int64_t group, int64_t N, const float* bias,
                        float* y);
/* linear.c: y [M, N] float32 = x [M, K] float32 @ W^T (+ bias), W a GGUF block format in GGUFWeight's planes read
 * as stored (lo, hi or NULL, scales, offsets or NULL, the IQ4 code table or NULL); each output one multiply-add
 * chain in k order. Returns -3 for bits, group or K it does not take. */
int tritonq_gguf_linear(void* omp_parallel, int threads, const float* x, int64_t M, int64_t K, int64_t stride_x,
                        const int32_t* lo, const int32_t* hi, int64_t bits, int64_t zero, const float* code,
                        const float* scales, const float* offsets, int64_t group, int64_t N, const float* bias,
                        float* y);

#endif
