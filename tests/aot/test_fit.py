"""Every launch the runtime makes fits every GPU target it runs on, for every dtype `load()` accepts there.

The launches are the launchers' own (each kernel file's builder over meta tensors: signature, strides,
divisibility hints and default config as at run time), at representative shapes: int4 / fp8 GEMMs at
M = 1, 16, 256 (a 4096 x 4096 layer), the GGUF block-format GEMM (Q4_K, Q5_K, Q6_K at the same M, Q4_K at 8 too: the
largest of its decode word path; Q2_K at 1 and 256;
Q5_0, Q3_K at 1) and its
expert GEMM (Q4_K, Q6_K, IQ4_XS on Qwen3-30B-A3B's experts; one token's Q4_K word path and Q6_K down from sm_80), the
batch-invariant mode's dense GEMM, paged prefill and split-KV decode
attention for head dims 64, 128, 192 / 128 and MLA's latent 576 / 512 (GQA 32 / 8, MLA 16 / 1; 16- and 64-token
pages, a sliding window), gpt-oss's attention with sinks (64 / 64 heads, 128-token window: prefill, decode split
and merge), decode at a batch that needs one split (the merge folded into it, with and without sinks), the MoE
token alignment (one program), the MoE routing (with the alignment in one program; alone over a grid), fused MoE
on DeepSeek-V2-Lite's experts (dense, int4, fp8 weight-only, fp8 W8A8 from sm_89) and on gpt-oss-20b's MXFP4
experts (biases, clamped SwiGLU), rms_norm (alone and after the residual add), SiLU-mul,
Gated DeltaNet's kernels at Qwen3.5's shapes (chunked and recurrent delta rule, conv and its update, gated
RMSNorm), the rope + qk-norm KV write, the fp8 activation quantization, and the KV-cache launches over 8-bit
pages (kv_cache_dtype int8 / fp8: the write, paged prefill, decode and MLA's latent decode; e4m3 travels as bytes,
decoded with integer ops on every target).
Each is AOT-compiled (kernels/aot.py: the whole NVIDIA pipeline and the bundled ptxas,
no GPU) for sm_75 (T4), sm_80 (A100), sm_89 (L4/L40) and sm_90 (H100/H200) x `gpu_compute_dtypes(cc)`,
and must:
  * fit the target's shared memory per block (`aot.SHARED_MEMORY_LIMIT`, CUDA's opt-in maximum: 64 KB,
    163 KB, 99 KB, 227 KB), else Triton raises OutOfResources at the first launch;
  * not spill registers (`SPILL_ALLOWED` lists the measured exceptions, sm_75 GEMMs, with why);
  * use tensor cores where a dot has them: mma.sync on sm_80/89, wgmma on sm_90 for dots of >= 64 rows
    (warp-group tiles; 16-row decode tiles take mma.sync); none on sm_75, where Triton 3.x lowers tl.dot
    to FMA (the test fails if a Triton brings mma back there, so that docs and defaults get revisited).

The same cases run twice: under the installed Triton, and under Triton 3.6.0 (the GPU machine's image),
installed apart with `pip install --target build/triton-3.6.0 --no-deps triton==3.6.0` (the README's
set-up; torch imports with it for meta-tensor launch building). Without that folder the 3.6 cases skip,
or fail under CI=true. The compiles run once per Triton, in one child process (conftest's
TRITON_INTERPRET=1 turns @triton.jit into interpreted functions, which cannot be compiled), over a
process pool, and report back as JSON; `python tests/aot/test_fit.py` prints that JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from tritonq.kernels import attention, common, deltanet, dense_gemm, fp8_gemm, gguf_gemm, int4_gemm, int8_gemm, moe
from tritonq.kernels.aot import SHARED_MEMORY_LIMIT, SM_COUNT
from tritonq.kernels.common import Launch, gpu_compute_dtypes
from tritonq.kernels.norm_rope import rms_norm_launch, silu_mul_launch
from tritonq.quant.weights import DenseWeight

try:
    from child_process import ROOT, json_from_child
except ImportError:  # run as a script by the child itself
    from tests.child_process import ROOT, json_from_child

TARGETS = (75, 80, 89, 90)
TRITON_36 = ROOT / "build" / "triton-3.6.0"
N = K = 4096  # a Llama-7B-sized layer
MOE_PROBLEM = (512, 64, 6, 2048, 1408)  # tokens, experts, top-k, D, I: DeepSeek-V2-Lite's experts
GGUF_MOE_PROBLEM = (512, 128, 8, 2048, 768)  # tokens, experts, top-k, D, I: Qwen3-30B-A3B's experts
GPT_OSS_MOE_PROBLEM = (512, 32, 4, 2880, 2880)  # gpt-oss-20b's experts (MXFP4, biases, clamped SwiGLU)
GPT_OSS_WINDOW = 128  # gpt-oss attention: 64 / 64 heads, sinks, 128-token window on alternate layers
# (Dqk, Dv), page size, window: Llama/Qwen 128, small models 64, DeepSeek's expanded 192 / 128 and
# latent 576 / 512; 64-token pages and sliding windows change the key gather (registers).
PREFILL = [((64, 64), 16, 0), ((128, 128), 16, 0), ((192, 128), 16, 0), ((576, 512), 16, 0),
           ((128, 128), 64, 0), ((192, 128), 16, 4096)]
DECODE = [((64, 64), 16, 0), ((128, 128), 16, 0), ((192, 128), 16, 0), ((576, 512), 16, 0),
          ((576, 512), 64, 0), ((128, 128), 16, 4096)]
# The launches compiled for a target's other dtype (fp16 beside the default bf16 from sm_80): one per kernel
# family. fp16 and bf16 compiled to the same shared memory, spills and tensor-core use in all 149 cases of
# the full set on sm_80/89/90 (Triton 3.9), so the full set runs in the default dtype only (CI time).
OTHER_DTYPE_CASES = ("int4 M256", "w8a8 M256", "fp8 block M256", "fp8 weight-only block M256",
                     "prefill 128/128 page16 window0", "decode 576/512 page16 window0", "moe int4 gate_up M64",
                     "rms_norm 8192", "moe mxfp4 gpt-oss gate_up M64")

# {(cc, case): bytes}: the register spills accepted (the most measured under Triton 3.9.0 and 3.6.0).
# sm_75 (T4) only: its dots run on FMA (no mma before sm_80), and the GEMM / MoE tiles are the sm_80+
# defaults (int4_gemm and moe pick tiles without the compute capability); spills there cost speed, not
# correctness. A T4 tile set for them is the next step (measure on a T4 first). Attention fits without.
SPILL_ALLOWED: dict[tuple[int, str], int] = {
    (75, "int4 M256"): 200,  # 3.9: 200, 3.6: 88 (fp32 dequantization before: 196)
    (75, "moe int8 gate_up M64"): 2420,  # 3.9: 2404, 3.6: 2420
    (75, "moe int4-act-order gate_up M64"): 1292,  # 3.9: 1292, 3.6: 1040
    (75, "moe fp8-channel gate_up M64"): 2108,  # 3.9: 1676, 3.6: 2108 (before the unmasked K loop: 1784, 1364)
    (75, "moe fp8-tensor gate_up M64"): 2108,  # 3.9: 1676, 3.6: 2108 (before the unmasked K loop: 1784, 1364)
    (75, "int4 act-order M256"): 196,  # 3.9: 196, 3.6: 0 (sorted by group; the per-row gather: 9734, 9276)
    (75, "int8 M256"): 200,  # 3.9: 200, 3.6: 88
    (75, "nf4 M1"): 364,  # 3.9: 364, 3.6: 312
    (75, "nf4 M256"): 11476,  # 3.9: 9992, 3.6: 11476: the code-table gather of a whole tile (like act-order's scales)
    (75, "fp8 weight-only block M1"): 2236,  # 3.9: 2236, 3.6: 2184 (IEEE dots: 2228 before)
    (75, "fp8 weight-only block M16"): 2236,  # 3.9: 2236, 3.6: 2180
    (75, "fp8 weight-only block M256"): 7628,  # 3.9: 7628, 3.6: 6836
    (75, "fp8 channel o add-norm M16"): 2236,  # 3.9: 2236, 3.6: 2192: the weight-only decode tile above, + the norm
    (75, "fp8 weight-only channel M256"): 7452,  # 3.9: 7452, 3.6: 6960
    (75, "moe dense gate_up M16"): 2020,  # 3.9: 2020, 3.6: 1200
    (75, "moe dense gate_up M64"): 1696,  # 3.9: 1696, 3.6: 1048
    (75, "moe dense down M64"): 460,  # 3.9: 460, 3.6: 376 (before the slot-sum epilogue: 444)
    (75, "moe int4 gate_up M16"): 2248,  # 3.9: 2144, 3.6: 2248 (fp32 dequantization before: 2036, 2084)
    (75, "moe int4 gate_up M64"): 2344,  # 3.9: 2344, 3.6: 2288 (fp32 dequantization before: 2204, 2280)
    (75, "moe fp8 gate_up M16"): 1804,  # 3.9: 1804, 3.6: 1132
    (75, "moe fp8 gate_up M64"): 1968,  # 3.9: 1648, 3.6: 1968 (before the unmasked K loop: 1624, 1092)
    (75, "moe fp8 down M64"): 440,  # 3.9: 440, 3.6: 376 (before the slot-sum epilogue: 436)
    (75, "moe mxfp4 gpt-oss gate_up M16"): 2232,  # 3.9: 2232, 3.6: 2064
    (75, "moe mxfp4 gpt-oss gate_up M64"): 2412,  # 3.9: 2412, 3.6: 2208
    # GGUF block formats: each weight formed in fp32 before the FMA dot (the K-quants' exact values)
    (75, "gguf Q4_K M256"): 200,  # 3.9: 200, 3.6: 88
    (75, "gguf Q5_K M1"): 12, (75, "gguf Q5_K M16"): 8,  # 3.9 (3.6: none)
    (75, "gguf Q5_K M256"): 220,  # 3.9: 220, 3.6: 92
    (75, "gguf Q6_K M1"): 24, (75, "gguf Q6_K M16"): 24,  # 3.9 (3.6: none)
    (75, "gguf Q6_K M256"): 260,  # 3.9: 260, 3.6: 128
    (75, "gguf Q5_0 M1"): 20,  # 3.9 (3.6: none)
    (75, "gguf IQ4_XS M1"): 2548,  # 3.9: 2548, 3.6: 2164: the level-table gather of a whole tile, as nf4's
    (75, "gguf IQ4_XS M256"): 11476,  # 3.9: 9992, 3.6: 11476
    (75, "gguf Q2_K M256"): 212,  # 3.9: 212, 3.6: 100
    (75, "moe gguf Q4_K gate_up M16"): 1984,  # 3.9: 1984, 3.6: 1980 (two dequantized fp32 tiles, as moe int4's)
    (75, "moe gguf Q4_K gate_up M64"): 2204,  # 3.9: 2204, 3.6: 2164
    (75, "moe gguf Q6_K gate_up M64"): 2324,  # 3.9: 2324, 3.6: 2288
    (75, "moe gguf IQ4_XS gate_up M64"): 340,  # 3.9: 340, 3.6: 104 (BLOCK_K 32: gguf_gemm.CODE_BLOCK_K)
    # int8 KV pages: the per-key scales of a 128 x 32 score tile take the last registers on sm_89 (255; sm_80 183,
    # no spill); 4 bytes, measured under 3.9 (3.6: none). (MLA's latent decode over them spilled 4 B under 3.6
    # until its V tiles came as byte pairs: none since.)
    (89, "prefill 128/128 kv int8"): 4,
    # gpt-oss's MXFP4 down GEMM at decode on sm_89: the slot-sum epilogue beside the word decode's registers (each
    # alone: none); 16 bytes under 3.9, none under 3.6
    (89, "moe mxfp4 gpt-oss down M16"): 16,
    # Gated DeltaNet's chunk kernel holds a whole chunk (32 tokens, Dk = 128) and its state tile in one program's
    # registers (255 used from sm_80): a few bytes; at 64 tokens 2.7 KB (docs/kernels.md#gated-deltanet). sm_75 as
    # the GEMMs there (FMA dots).
    (75, "deltanet chunk"): 3640,  # 3.9: 3640, 3.6: 3600
    (80, "deltanet chunk"): 24,  # 3.9: 24, 3.6: 8
    (89, "deltanet chunk"): 52,  # 3.9: 52, 3.6: 48
    (90, "deltanet chunk"): 28,  # 3.9: 28, 3.6: 28
}


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _heads(d_qk: int) -> tuple[int, int]:
    """(H, Hkv): GQA 4 (Llama-3 8B's 32 / 8); MLA latent 16 / 1 (V2-Lite, one shared latent head)."""
    return (16, 1) if d_qk == 576 else (32, 8)


def _pages(d_qk: int, d_v: int, page_size: int, num_pages: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v pages as the model allocates them: MLA's v is a view of the latent pages."""
    k = _meta(num_pages, page_size, _heads(d_qk)[1], d_qk, dtype=dtype)
    return k, (k[..., :d_v] if d_qk == 576 else _meta(*k.shape[:3], d_v, dtype=dtype))


def _quantized_pages(kind: str, d_qk: int, d_v: int, page_size: int,
                     num_pages: int) -> tuple[attention.QuantizedPages, attention.QuantizedPages]:
    """8-bit k, v pages with their scales as KVLayout allocates them (MLA: v a view sharing k's scale)."""
    k, v = _pages(d_qk, d_v, page_size, num_pages, torch.int8 if kind == "int8" else torch.float8_e4m3fn)

    def scale():
        return _meta(*k.shape[:3], dtype=torch.float32) if kind == "int8" else _meta((), dtype=torch.float32)
    k_pages = attention.QuantizedPages(k, scale())
    return k_pages, attention.QuantizedPages(v, k_pages.scale if d_qk == 576 else scale())


def launches(cc: int, dtype: torch.dtype) -> dict[str, Launch]:
    """{case: Launch}: the runtime's default launches on sm_`cc` for a model in dtype."""
    out, i32 = {}, dict(dtype=torch.int32)
    for M in (1, 16, 256):
        out[f"int4 M{M}"] = int4_gemm.aot_launch(int4_gemm.default_config(M, N, K, cc=cc), M, N, K, dtype, cc=cc)
    config = int4_gemm.default_config(256, N, K, cc=cc)  # GPTQ act-order (sorted by group, x permuted) and 8-bit
    out["int4 act-order M256"] = int4_gemm.aot_launch(config, 256, N, K, dtype, zeros=False, act_order=True, cc=cc)
    out["int8 M256"] = int4_gemm.aot_launch(config, 256, N, K, dtype, bits=8, cc=cc)
    for M in (1, 256):  # bitsandbytes nf4 / fp4: a code-table gather per weight, fp32 absmax per 64 rows
        out[f"nf4 M{M}"] = int4_gemm.aot_launch(int4_gemm.default_config(M, N, K, cc=cc), M, N, K, dtype, code=True,
                                                cc=cc)
    # GGUF block formats (GGUFWeight): 4-bit codes + offsets per 32 (Q4_K, as Q4_1), 5-bit (Q5_K as Q5_1; Q5_0 without
    # offsets), 6-bit with scales per 16 (Q6_K); 2- / 3-bit codes in the 4-bit plane, scales per 16 (Q2_K with offsets,
    # Q3_K without); IQ4_XS (as IQ4_NL): a 16-level code table gathered per weight
    for name, bits, group, offsets, rows in (("Q4_K", 4, 32, True, (1, 8, 16, 256)), ("Q5_K", 5, 32, True, (1, 16, 256)),
                                             ("Q6_K", 6, 16, False, (1, 16, 256)), ("Q5_0", 5, 32, False, (1,)),
                                             ("Q2_K", 4, 16, True, (1, 256)), ("Q3_K", 4, 16, False, (1,)),
                                             ("IQ4_XS", 4, 32, False, (1, 256))):
        for M in rows:
            out[f"gguf {name} M{M}"] = gguf_gemm.aot_launch(None, M, N, K, bits, group, offsets, dtype,
                                                            code=name == "IQ4_XS", cc=cc)
    # GGUF experts (fused_moe's GGUF kernel) on Qwen3-30B-A3B's shapes: Q4_K gate/up at the smallest and largest
    # tile and Q6_K down (a Q4_K_M file's experts), Q6_K and IQ4_XS gate/up at the largest (two accumulators)
    for name, bits, group, offsets, gate_up, config in (
            ("Q4_K", 4, 32, True, True, moe.DEFAULT_CONFIGS[0][1]), ("Q4_K", 4, 32, True, True, moe.DEFAULT_CONFIGS[-1][1]),
            ("Q6_K", 6, 16, False, False, moe.DEFAULT_CONFIGS[-1][1]),
            ("Q6_K", 6, 16, False, True, moe.DEFAULT_CONFIGS[-1][1]),
            ("IQ4_XS", 4, 32, False, True, moe.DEFAULT_CONFIGS[-1][1])):
        out[f"moe gguf {name} {'gate_up' if gate_up else 'down'} M{config.BLOCK_M}"] = gguf_gemm.aot_moe_launch(
            config, GGUF_MOE_PROBLEM, gate_up, bits, group, offsets, dtype, code=name == "IQ4_XS")
    if cc >= 80:  # one token from sm_80 (16-bit): Q4_K on the decode word path, a row block per routed expert, which
        # the Q6_K down shares (kernels/moe/launch.py's diagonal_path; its tile moe.configs.gguf_word_config)
        config = moe.default_config(1, GGUF_MOE_PROBLEM[2], GGUF_MOE_PROBLEM[1], diagonal=True)
        for name, bits, group, offsets, gate_up in (("Q4_K", 4, 32, True, True), ("Q4_K", 4, 32, True, False),
                                                    ("Q6_K", 6, 16, False, False)):
            out[f"moe gguf {name} {'gate_up' if gate_up else 'down'} M1"] = gguf_gemm.aot_moe_launch(
                config if bits == 4 else moe.GGUF_FEW_ROWS_CONFIG,
                (1, *GGUF_MOE_PROBLEM[1:]), gate_up, bits, group, offsets, dtype, cc=cc)
    # fp8: e4m3 x e4m3 dots from sm_89 (block-scaled and per-channel weights), the weight-only path (weights
    # decoded in the kernel) below sm_89 and for weight-only checkpoints everywhere.
    paths = [("fp8", False), ("fp8 weight-only", True)] if cc >= 89 else [("fp8 weight-only", True)]
    for path, weight_only in paths:
        shapes = ((1, True), (16, True), (256, True), (256, False)) if path == paths[0][0] else ((256, True),)
        for M, block in shapes:
            config = fp8_gemm.default_config(M, N, K, cc=cc, block_scaled=block, weight_only=weight_only)
            out[f"{path} {'block' if block else 'channel'} M{M}"] = fp8_gemm.aot_launch(
                config, M, N, K, 80 if weight_only else cc, dtype, block, bias=True)
    # W8A8 int8: int8 x int8 dots (fp16 dots of the int8 codes on sm_75), per-token activations, and the static
    # asymmetric epilogue (zero-point correction from the weight tiles' column sums)
    for M in (1, 16, 256):
        out[f"w8a8 M{M}"] = int8_gemm.aot_launch(int8_gemm.default_config(M, N, K, cc), M, N, K, cc, dtype, bias=True)
    out["w8a8 asymmetric M256"] = int8_gemm.aot_launch(int8_gemm.default_config(256, N, K, cc), 256, N, K, cc, dtype,
                                                       asymmetric=True)
    out["w8a8 quantize per token"] = int8_gemm.quantize_activation_int8_launch(
        _meta(256, K, dtype=dtype), _meta(256, K, dtype=torch.int8), _meta(256, dtype=torch.float32), None, static=False)
    # the batch-invariant mode's dense GEMM (one config for every M)
    out["dense batch-invariant"] = dense_gemm.dense_gemm_launch(
        _meta(256, K, dtype=dtype), DenseWeight(_meta(N, K, dtype=dtype), _meta(N, dtype=dtype)),
        _meta(256, N, dtype=dtype), cc)
    # the decode layer's fused epilogues: gate_up with SwiGLU (int4 split-K, dense by row index) and o_proj with
    # the residual addition and the RMSNorm of the whole rows (the row block's last tile)
    dense_w = DenseWeight(_meta(N, K, dtype=dtype))
    out["dense gate_up swiglu M16"] = dense_gemm.dense_gemm_launch(_meta(16, K, dtype=dtype), dense_w,
                                                                 _meta(16, N // 2, dtype=dtype), cc, silu_mul=True)
    out["int4 gate_up swiglu M1"] = int4_gemm.aot_launch(int4_gemm.default_config(1, N, K, cc=cc), 1, N, K, dtype,
                                                         cc=cc)
    out["int4 gate_up swiglu M1"].args["SILU_MUL"] = True
    epilogue = dict(ADD_NORM=True, eps=1e-6, row_arrivals_ptr=_meta(1, **i32), norm_w_ptr=_meta(N, dtype=dtype),
                    sumsq_ptr=_meta(N // 16, 16, dtype=torch.float32))
    out["int4 o add-norm M16"] = int4_gemm.aot_launch(int4_gemm.default_config(16, N, K, cc=cc), 16, N, K, dtype,
                                                       cc=cc)
    out["int4 o add-norm M16"].args.update(epilogue)
    out["dense o add-norm M16"] = dense_gemm.dense_gemm_launch(_meta(16, K, dtype=dtype), dense_w,
                                                             _meta(16, N, dtype=dtype), cc)
    out["dense o add-norm M16"].args.update(epilogue, GROUP_M=1)
    # fp8 per channel (e4m3 dots from sm_89, the activations quantized in the GEMM; weight-only below) and W8A8
    out["fp8 channel o add-norm M16"] = fp8_gemm.aot_launch(fp8_gemm.default_config(16, N, K, cc=cc), 16, N, K, cc,
                                                            dtype, block=False)
    out["w8a8 o add-norm M16"] = int8_gemm.aot_launch(int8_gemm.default_config(16, N, K, cc), 16, N, K, cc, dtype)
    for name in ("fp8 channel o add-norm M16", "w8a8 o add-norm M16"):
        out[name].args.update(epilogue, GROUP_M=1)
    if cc >= 89:  # activations quantized per 128-group (block-scaled weights)
        out["fp8 quantize group128"] = fp8_gemm.quantize_activation_launch(
            _meta(256, K, dtype=dtype), _meta(256, K, dtype=torch.float8_e4m3fn),
            _meta(256, K // 128, dtype=torch.float32), 128, static=False)
    for (d_qk, d_v), page_size, window in PREFILL:
        if cc < 80 and d_qk == 576:
            continue  # no tile fits (paged_prefill_config); the runtime's latent prefill expands to 192 / 128
        H, _ = _heads(d_qk)
        config = attention.paged_prefill_config(*attention.head_blocks(d_qk, d_v), cc)
        k, v = _pages(d_qk, d_v, page_size, 1024, dtype)
        out[f"prefill {d_qk}/{d_v} page{page_size} window{window}"] = attention.paged_prefill_launch(
            _meta(2048, H, d_qk, dtype=dtype), k, v, _meta(5, **i32), _meta(4, **i32),
            _meta(4, 4096 // page_size, **i32), d_qk ** -0.5, window, config)[0]
    for (d_qk, d_v), page_size, window in DECODE:
        if cc < 80 and d_qk == 576:
            continue  # no tile fits: DeepSeek runs its expanded 192 / 128 attention there (models/deepseek_v2.py)
        H, H_kv = _heads(d_qk)
        config = attention.decode_config(1, H_kv, 32768, page_size, *attention.head_blocks(d_qk, d_v), SM_COUNT[cc])
        k, v = _pages(d_qk, d_v, page_size, 4096, dtype)
        split, merge, _ = attention.decode_launches(_meta(1, H, d_qk, dtype=dtype), k, v, _meta(1, **i32),
                                                    _meta(1, 32768 // page_size, **i32), d_qk ** -0.5, window, config)
        out[f"decode {d_qk}/{d_v} page{page_size} window{window}"] = split
        if page_size == 16 and not window:
            out[f"decode merge {d_qk}/{d_v}"] = merge
    # gpt-oss: attention sinks (prefill's initial state, decode's merge) over the 128-token window
    H, H_kv = _heads(64)
    sinks = _meta(H, dtype=torch.float32)
    k, v = _pages(64, 64, 16, 1024, dtype)
    config = attention.paged_prefill_config(*attention.head_blocks(64, 64), cc)
    out[f"prefill 64/64 page16 window{GPT_OSS_WINDOW} sinks"] = attention.paged_prefill_launch(
        _meta(2048, H, 64, dtype=dtype), k, v, _meta(5, **i32), _meta(4, **i32), _meta(4, 256, **i32), 0.125,
        GPT_OSS_WINDOW, config, sinks)[0]
    config = attention.decode_config(1, H_kv, GPT_OSS_WINDOW, 16, *attention.head_blocks(64, 64), SM_COUNT[cc])
    split, merge, _ = attention.decode_launches(_meta(1, H, 64, dtype=dtype), k, v, _meta(1, **i32),
                                                _meta(1, 256, **i32), 0.125, GPT_OSS_WINDOW, config, sinks)
    out[f"decode 64/64 page16 window{GPT_OSS_WINDOW} sinks"] = split
    out["decode merge 64/64 sinks"] = merge
    # batch x kv heads fill the GPU: one split, which writes the output itself (the merge folded in)
    for (d_qk, d_v), heads, sink in (((128, 128), _heads(128), None), ((64, 64), (H, H_kv), sinks)):
        config = attention.decode_config(256, heads[1], 32768, 16, *attention.head_blocks(d_qk, d_v), SM_COUNT[cc])
        assert config.NUM_SPLITS == 1, config
        k, v = _pages(d_qk, d_v, 16, 4096, dtype)
        split, merge, _ = attention.decode_launches(_meta(256, heads[0], d_qk, dtype=dtype), k, v, _meta(256, **i32),
                                                    _meta(256, 2048, **i32), d_qk ** -0.5, 0, config, sink)
        out[f"decode {d_qk}/{d_v} one split{' sinks' if sink is not None else ''}"] = split
    # ALiBi (MPT-7B: 32 heads of 128, multi-head): the bias tile beside the scores in prefill and decode
    slopes = _meta(32, dtype=torch.float32)
    k, v = _meta(1024, 16, 32, 128, dtype=dtype), _meta(1024, 16, 32, 128, dtype=dtype)
    out["prefill alibi 128/128 page16"] = attention.paged_prefill_launch(
        _meta(2048, 32, 128, dtype=dtype), k, v, _meta(5, **i32), _meta(4, **i32), _meta(4, 256, **i32), 128 ** -0.5,
        0, attention.paged_prefill_config(*attention.head_blocks(128, 128), cc), alibi_slopes=slopes)[0]
    config = attention.decode_config(1, 32, 32768, 16, *attention.head_blocks(128, 128), SM_COUNT[cc])
    out["decode alibi 128/128 page16"] = attention.decode_launches(
        _meta(1, 32, 128, dtype=dtype), k, v, _meta(1, **i32), _meta(1, 2048, **i32), 128 ** -0.5, 0, config,
        alibi_slopes=slopes)[0]
    for d_qk, d_v in ((128, 128), (576, 512)):
        if cc < 80 and d_qk == 576:
            continue
        k, v = _pages(d_qk, d_v, 16, 1024, dtype)
        out[f"write_kv_slots {d_qk}/{d_v}"] = attention.write_kv_slots_launch(
            k, v, _meta(64, _heads(d_qk)[1], d_qk, dtype=dtype), _meta(64, _heads(d_qk)[1], d_v, dtype=dtype),
            _meta(64, dtype=torch.int64))[0]
    # rope + qk-norm + the KV write in one launch (Qwen3-style 32 / 8 heads of 128)
    cos = _meta(64, 128, dtype=dtype)
    out["rope_write_kv_slots 128/128 qk-norm"] = attention.write_kv_slots_launch(
        *_pages(128, 128, 16, 1024, dtype), _meta(64, 8, 128, dtype=dtype), _meta(64, 8, 128, dtype=dtype),
        _meta(64, dtype=torch.int64), _meta(64, 32, 128, dtype=dtype), cos, cos, _meta(128, dtype=dtype),
        _meta(128, dtype=dtype), 1e-6)[0]
    for kind in ("int8", "fp8"):  # 8-bit KV pages (kv_cache_dtype): the same default configs over QuantizedPages
        for d_qk, d_v in ((128, 128), (576, 512)):
            if cc < 80 and d_qk == 576:
                continue  # DeepSeek runs expanded there (above)
            H, H_kv = _heads(d_qk)
            k, v = _quantized_pages(kind, d_qk, d_v, 16, 1024)
            if d_qk == 128:  # MLA's latent prefill expands the (dequantized) latent into plain pages
                config = attention.paged_prefill_config(*attention.head_blocks(d_qk, d_v), cc)
                out[f"prefill {d_qk}/{d_v} kv {kind}"] = attention.paged_prefill_launch(
                    _meta(2048, H, d_qk, dtype=dtype), k, v, _meta(5, **i32), _meta(4, **i32), _meta(4, 256, **i32),
                    d_qk ** -0.5, 0, config)[0]
            config = attention.decode_config(1, H_kv, 32768, 16, *attention.head_blocks(d_qk, d_v), SM_COUNT[cc])
            out[f"decode {d_qk}/{d_v} kv {kind}"] = attention.decode_launches(
                _meta(1, H, d_qk, dtype=dtype), k, v, _meta(1, **i32), _meta(1, 2048, **i32), d_qk ** -0.5, 0,
                config)[0]
            out[f"write_kv_slots {d_qk}/{d_v} kv {kind}"] = attention.write_kv_slots_launch(
                k, v, _meta(64, H_kv, d_qk, dtype=dtype), _meta(64, H_kv, d_v, dtype=dtype),
                _meta(64, dtype=torch.int64))[0]
    # gate/up (two accumulators) at the smallest tile (the decode tile of the word paths, int4 and MXFP4 from
    # sm_80: moe.WORD_DECODE_CONFIG) and the largest, down at the largest (and the word paths' decode tile)
    words = cc >= 80
    for kind in ("dense", "int4", "fp8"):
        smallest = moe.default_config(1, MOE_PROBLEM[2], MOE_PROBLEM[1], words=words and kind == "int4")
        for gate_up, config in ((True, smallest), (True, moe.DEFAULT_CONFIGS[-1][1]),
                                *([(False, smallest)] if kind == "int4" else []), (False, moe.DEFAULT_CONFIGS[-1][1])):
            out[f"moe {kind} {'gate_up' if gate_up else 'down'} M{config.BLOCK_M}"] = moe.aot_launch(
                config, (*MOE_PROBLEM, 0 if gate_up else 1), kind, native_fp8=cc >= 89, dtype=dtype, cc=cc)
    smallest = moe.default_config(1, GPT_OSS_MOE_PROBLEM[2], GPT_OSS_MOE_PROBLEM[1], words=words)
    for gate_up, config in ((True, smallest), (True, moe.DEFAULT_CONFIGS[-1][1]), (False, smallest),
                            (False, moe.DEFAULT_CONFIGS[-1][1])):
        out[f"moe mxfp4 gpt-oss {'gate_up' if gate_up else 'down'} M{config.BLOCK_M}"] = moe.aot_launch(
            config, (*GPT_OSS_MOE_PROBLEM, 0 if gate_up else 1), "mxfp4", dtype=dtype, gpt_oss=True, cc=cc)
    if words:  # MXFP4 experts with scales past 2^1: two packed multiplies per two codes (common.mxfp4_words_to_half)
        out["moe mxfp4 gpt-oss gate_up M16 large scales"] = moe.aot_launch(
            smallest, (*GPT_OSS_MOE_PROBLEM, 0), "mxfp4", dtype=dtype, gpt_oss=True, cc=cc,
            mxfp4_max_scale=common.MXFP4_FP16_MAX_SCALE)
    for kind in ("int8", "int4-act-order", "fp8-channel", "fp8-tensor"):  # the other experts packers write: gate/up
        config = moe.DEFAULT_CONFIGS[-1][1]  # at the largest tile (two accumulators: the most registers)
        out[f"moe {kind} gate_up M{config.BLOCK_M}"] = moe.aot_launch(config, (*MOE_PROBLEM, 0), kind,
                                                                     native_fp8=cc >= 89, dtype=dtype, cc=cc)
    if cc >= 89:  # W8A8 fp8 experts (e4m3 x e4m3 dots): block-scaled (per-tile scales, 1 x 128 activation groups)
        # and per-channel (per-token activations); below sm_89 fused_moe runs them weight-only (the cases above)
        for kind, gate_up, config in (("fp8", True, moe.DEFAULT_CONFIGS[0][1]), ("fp8", True, moe.DEFAULT_CONFIGS[-1][1]),
                                      ("fp8", False, moe.DEFAULT_CONFIGS[-1][1]),
                                      ("fp8-channel", True, moe.DEFAULT_CONFIGS[-1][1])):
            out[f"moe {kind} w8a8 {'gate_up' if gate_up else 'down'} M{config.BLOCK_M}"] = moe.aot_launch(
                config, (*MOE_PROBLEM, 0 if gate_up else 1), kind, dtype=dtype, w8a8=True)
        out["fp8 quantize per token"] = fp8_gemm.quantize_activation_launch(  # the MoE hidden [T*k, I]
            _meta(3072, 1408, dtype=dtype), _meta(3072, 1408, dtype=torch.float8_e4m3fn),
            _meta(3072, 1, dtype=torch.float32), 1408, static=False)
    # the MoE token alignment in one program: DeepSeek-V3's 256 experts (+ the dropped slots' virtual one), 16 x 8
    out["moe align 256 experts 16x8"] = moe.align_launch(_meta(16, 8, dtype=torch.int32), 16, 256, 128 + 1)[0]
    # routing + alignment in one program (DeepSeek-V3's grouped sigmoid router with its bias, 16 tokens) and routing
    # alone over a grid (DeepSeek-V2's 160 experts in 8 groups, 512 tokens: aligned by torch's scans after it)
    f32 = torch.float32
    out["moe route+align V3 256 experts 16x8"] = moe.route_launch(_meta(16, 256, dtype=f32), _meta(256, dtype=f32), 8,
                                                                  8, 4, "sigmoid", True, 2.5, 16, 256, 0)[0]
    out["moe route V2 160 experts 512x6"] = moe.route_launch(_meta(512, 160, dtype=f32), None, 6, 8, 3, "softmax",
                                                             False, 16.0, 64, 160, 0)[0]
    out["rms_norm 8192"] = rms_norm_launch(_meta(4, 8192, dtype=dtype), _meta(8192, dtype=dtype), 1e-5)[0]
    out["add_rms_norm 8192"] = rms_norm_launch(_meta(4, 8192, dtype=dtype), _meta(8192, dtype=dtype), 1e-5,
                                               add=_meta(4, 8192, dtype=dtype))[0]
    out["silu_mul 14336"] = silu_mul_launch(_meta(4, 2 * 14336, dtype=dtype))[0]
    out.update(_deltanet_launches(dtype))
    return out


def _deltanet_launches(dtype) -> dict[str, Launch]:
    """Gated DeltaNet at Qwen3.5's linear-attention shapes: 16 key / 32 value heads of 128, a conv over
    2 * 16 * 128 + 32 * 128 = 8192 channels of width 4; 4 sequences, 4096 tokens, a pool of 64 states."""
    T, B, Hk, Hv, D, pool, i32 = 4096, 4, 16, 32, 128, 64, torch.int32
    state, rows = _meta(pool, Hv, D, D, dtype=torch.float32), _meta(B, dtype=i32)
    out = {}
    for name, tokens, cu in (("deltanet chunk", T, _meta(B + 1, dtype=i32)), ("deltanet recurrent", B, None)):
        v = _meta(tokens, Hv, D, dtype=dtype)
        out[name] = deltanet.rule_launch(_meta(tokens, Hk, D, dtype=dtype), _meta(tokens, Hk, D, dtype=dtype), v,
                                         _meta(tokens, Hv, dtype=torch.float32), _meta(tokens, Hv, dtype=dtype),
                                         state, rows, cu, torch.empty_like(v), D ** -0.5, True)
    for name, tokens, cu in (("deltanet conv", T, _meta(B + 1, dtype=i32)), ("deltanet conv update", B, None)):
        x = _meta(tokens, 8192, dtype=dtype)
        out[name] = deltanet.conv_launch(x, _meta(8192, 4, dtype=dtype), None, _meta(pool, 8192, 3, dtype=dtype),
                                         rows, cu, torch.empty_like(x), "silu")
    x = _meta(T * Hv, D, dtype=dtype)
    out["deltanet gated_rms_norm"] = deltanet.gated_rms_norm_launch(x, x, _meta(D, dtype=dtype), 1e-6,
                                                                    torch.empty_like(x))
    return out


def dot_rows(launch: Launch) -> int | None:
    """Rows of the launch's largest tl.dot tiles (BLOCK_M, decode's BLOCK_H of query heads, the Gated DeltaNet
    chunk kernel's BLOCK_K: its state update, Dk x chunk x Dv columns); None: no dot."""
    deltanet_chunk = launch.args.get("BLOCK_K") if "C" in launch.args else None
    return launch.args.get("BLOCK_M", launch.args.get("BLOCK_H", deltanet_chunk))


def expected_tensor_cores(cc: int, rows: int | None) -> str | None:
    """'wgmma', 'mma' or None (no dot, or FMA): see the module docstring."""
    if rows is None or cc < 80:
        return None
    return "wgmma" if cc >= 90 and rows >= 64 else "mma"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


CASES = [(cc, _dtype_name(dtype), name) for cc in TARGETS for i, dtype in enumerate(gpu_compute_dtypes(cc))
         for name in launches(cc, dtype) if i == 0 or name in OTHER_DTYPE_CASES]


def _compile(case):
    """One case's compile report (run in the child's pool workers)."""
    from tritonq.kernels.aot import compile_launch

    cc, dtype, name = case
    launch = launches(cc, getattr(torch, dtype))[name]
    report = dataclasses.asdict(compile_launch(launch, cc))
    return report | {"dot_rows": dot_rows(launch), "num_warps": launch.num_warps, "num_stages": launch.num_stages}


def compile_all() -> dict:
    """{"triton": version, "reports": [[case, report], ...]} over every case, on a process pool."""
    import concurrent.futures
    import multiprocessing

    import triton

    with concurrent.futures.ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        reports = list(pool.map(_compile, CASES, chunksize=4))
    return {"triton": triton.__version__, "reports": [[list(c), r] for c, r in zip(CASES, reports)]}


_REPORTS: dict[str, dict] = {}  # compiled once per Triton and session


def reports_under(triton_install: str) -> dict:
    """{case: report} compiled under the installed Triton ("installed") or Triton 3.6.0 ("3.6")."""
    if triton_install not in _REPORTS:
        first = ()
        if triton_install == "3.6":
            if not (TRITON_36 / "triton").is_dir():
                message = (f"Triton 3.6.0 is not installed at {TRITON_36}: run `python -m pip install --upgrade --target "
                           f"{TRITON_36.relative_to(ROOT)} --no-deps triton==3.6.0` (the README's set-up)")
                if os.environ.get("CI") == "true":
                    pytest.fail(message)
                pytest.skip(message)
            first = (str(TRITON_36),)
        result = json_from_child([__file__], timeout=1800, first_on_path=first)
        if triton_install == "3.6":
            assert result["triton"] == "3.6.0", f"{TRITON_36} holds Triton {result['triton']}, expected 3.6.0"
        _REPORTS[triton_install] = {"triton": result["triton"],
                                    **{tuple(case): report for case, report in result["reports"]}}
    return _REPORTS[triton_install]


@pytest.mark.parametrize("triton_install", ["installed", "3.6"])
@pytest.mark.parametrize("cc, dtype, name", CASES, ids=[f"sm{c}-{d}-{n.replace(' ', '_')}" for c, d, n in CASES])
def test_launch_fits_target(triton_install, cc, dtype, name):
    reports = reports_under(triton_install)
    version, report = reports["triton"], reports[(cc, dtype, name)]
    print(f"\nTriton {version} sm_{cc} {dtype} {name}: {report}")
    assert report["shared_bytes"] <= SHARED_MEMORY_LIMIT[cc], (
        f"needs {report['shared_bytes']} B of shared memory, over sm_{cc}'s {SHARED_MEMORY_LIMIT[cc]} B per block")
    allowed = SPILL_ALLOWED.get((cc, name), 0)
    assert report["spills"] is not None and report["spills"] <= allowed, f"spills {report['spills']} B"
    expected = expected_tensor_cores(cc, report["dot_rows"])
    used = "wgmma" if report["uses_wgmma"] else "mma" if report["uses_mma"] else None
    assert used == expected, f"dots use {used}, expected {expected} (dot rows {report['dot_rows']})"


if __name__ == "__main__":  # the child: compile every case, print the JSON report on the last line
    sys.stdout.write(json.dumps(compile_all()) + "\n")
