"""Attention over a paged KV cache: causal prefill (flash-attention 2) and split-KV decode
(flash-decoding), with GQA, and the write of new keys into the pages.

The cache is paged, as vLLM's PagedAttention: pages [P, page_size, Hkv, D] shared by all sequences
and a block table [B, max_pages] int32 mapping position n of sequence b to page
block_table[b, n // page_size], row n % page_size. page_size is a power of two >= 16 so a decode
key tile never spans two pages. Shapes (T new tokens, B sequences, H query heads, Hkv key/value
heads, H % Hkv == 0):
  write_kv_slots(k_pages, v_pages, k [T,Hkv,Dqk], v [T,Hkv,Dv], slot_mapping [T] int64)
      token t to page slot // page_size, row slot % page_size; slot < 0 skipped (padding).
  paged_prefill_attention(q [T,H,Dqk], k_pages, v_pages, cu_seqlens_q [B+1] int32,
                          context_lens [B] int32, block_table, scale, window=0) -> [T,H,Dv]
      packed varlen queries (the last q_len_b positions of each sequence) against the sequence's
      keys 0..context_lens[b]-1 (cached prefix + the new tokens, written first), causal.
  decode_attention(q [B,H,Dqk], k_pages, v_pages, cache_lens [B] int32, block_table, scale,
                   window=0) -> [B,H,Dv]
      one query per sequence against positions 0..cache_lens[b]-1 (the new token's included).
Sliding window (window > 0): key j is visible to query p iff j <= p and p - j < window,
transformers' convention; key blocks wholly outside are not loaded.
Attention sinks (gpt-oss; sinks [H] fp32, optional): head h's learned logit sinks[h] joins the softmax
denominator only, as a key with a zero value row would: out = sum_j e^(s_j) v_j / (e^(sinks[h]) +
sum_j e^(s_j)). Prefill starts each row's online softmax from that virtual key (running max sinks[h],
sum 1); decode adds it once, in the merge of the KV splits, so the splits themselves are unchanged.
ALiBi (alibi_slopes [H] fp32, keyword-only, MPT): query head h's score of key j at query position p gains
slopes[h] * (j - p) after the scale (softmax ignores the per-row constant, so this equals MPT's slopes * j).
dtypes: fp16, bf16 or fp32 (all inputs the same); accumulation and softmax are fp32; outputs are
in q's dtype (fp32 inputs use TF32 tensor-core dots on GPUs).

Head dims need not be powers of two and Dqk may differ from Dv (DeepSeek-V2: 192 / 128; its
absorbed-MLA decode: 576 / 512). Tensors are never padded in memory: the kernels hold each head
dim in power-of-two register blocks and mask the lanes past D (masked lanes are not loaded, so
memory traffic is unaffected). The qk dim is split into the largest power of two plus a
power-of-two tail, accumulated by two tl.dots into one score tile (`qk_blocks`): 192 = 128 + 64,
96 = 64 + 32 and 576 = 512 + 64 waste nothing; a ragged tail such as 72 = 64 + (8 -> 16) runs
its masked lanes through the dot. Dv is one block of next_pow2(Dv): 128 and 512 cost nothing,
while e.g. Dv = 96 pads to 128, i.e. 33% extra PV FLOPs, accumulator registers and V tile
shared memory.

Quantized KV cache (`QuantizedPages`, kv_cache_dtype "fp8" / "int8" in tritonq.load): pages hold 8-bit
values and a scale (value = page x scale), 1 byte per element instead of 2:
  fp8   float8_e4m3fn pages, one fp32 scale per tensor (per layer, for k and for v; the checkpoint's
        self_attn.k_scale / v_scale, else 1.0 as vLLM does). The kernels read and write the bytes with
        integer ops (`common.e4m3_bits_to_fp16` / `e4m3_bits_from_fp32`, exact), so sm_75 / sm_80, where
        Triton has no e4m3 type, run the same kernels as sm_89 / sm_90.
  int8  int8 pages and fp32 scales [P, page_size, Hkv] beside them, one per token and kv head:
        scale = absmax(row) / 127, values rounded half up (floor(x / scale + 0.5)). A cache whose
        k and v share one scale tensor (MLA's latent, v = k[..., :Dv]) takes one scale for both rows.
write_kv_slots quantizes; the attention kernels load the 8-bit tile, convert it to the dot's dtype
(exact: |int8| <= 127 and every e4m3 value are fp16 / bf16 values) and apply the scales in registers
to what they multiply: per-key scales to the score columns (k) and to the probabilities before the PV
dot (v); fp8's per-tensor scales once, to qk_scale and to the output. Without QuantizedPages the
kernels compile exactly as before (KV_FP8 / KV_INT8 False, no scale pointers).

On CPU tensors (unless TRITON_INTERPRET=1) the CPU backend runs instead: torch's fused CPU attention
over each sequence's real keys and an index_copy_ of the new keys (kernels/cpu/attention.py).
TRITONQ_BACKEND=torch runs the torch references (float32 compute), the test oracle.

Files, one job each: `pages.py` (QuantizedPages, page layouts, shared constants), `jit.py` (the @triton.jit
kernels), `configs.py` (launch configs and how one is chosen), `launch.py` (checks and launchers),
`reference.py` (torch references), `tune.py` (tuning declarations). This module re-exports their names.
"""
from tritonq.kernels.attention.configs import (DecodeConfig, PrefillConfig, check_decode_config, check_prefill_config,
                                               config_bucket, decode_config, fit_decode_config, head_blocks,
                                               launch_config, paged_block_n, paged_prefill_config, qk_blocks)
from tritonq.kernels.attention.jit import (_decode_merge_kernel, _decode_split_kernel, _paged_prefill_kernel,
                                           _write_slots_kernel)
from tritonq.kernels.attention.launch import (_check_prefill_lens, _check_slots, alibi_slopes, decode_attention,
                                              decode_launches, paged_prefill_attention, paged_prefill_launch,
                                              rope_write_kv_slots, write_kv_slots, write_kv_slots_launch)
from tritonq.kernels.attention.pages import (KV_FP8_MAX, KV_INT8_MAX, KV_SCALE_EPS, LOG2E, QuantizedPages,
                                             dequantize_pages, paged_cache, paged_prompts, read_kv_rows,
                                             shares_scale)
from tritonq.kernels.attention.reference import (decode_attention_reference, gather_pages,
                                                 paged_prefill_attention_reference, quantize_kv_reference,
                                                 write_kv_slots_reference)
from tritonq.kernels.attention.tune import (DECODE_FORMAT, DECODE_SPACE, PREFILL_FORMAT, PREFILL_SPACE, TUNE_PAGE_SIZE,
                                            TUNE_TOL, _tune_shape, decode_aot_launch,
                                            decode_sweep_space, prefill_aot_launch, prefill_sweep_space)
