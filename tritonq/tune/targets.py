"""What `python -m tritonq.tune` tunes, one `TuneTarget` per --kernel name, built from what each kernel
declares in its own file (its sweep space, tuning shape format and AOT launch builder) plus what only the
tuner needs: random inputs, the torch reference to check candidates against, and the tolerance.

The kernels never import this module (imports point down: tune -> kernels).
"""
from __future__ import annotations

from dataclasses import asdict, replace

import torch

from tritonq.kernels.aot import compile_launch
from tritonq.tune.search import TuneTarget, kernel_dtype


def _lengths(batch: int, full: int) -> list[int]:
    """[batch] sequence lengths: the first at full length, the others random in [1, full]."""
    return [full] + torch.randint(1, full + 1, (batch - 1,)).tolist()


def int4_gemm() -> TuneTarget:
    """int4_gemm: asymmetric int4 weights (AWQ/GPTQ), fp16 on GPUs."""
    from tritonq.kernels import int4_gemm as k
    from tritonq.random_weights import random_int4_weight

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        return torch.randn(M, K, dtype=dtype, device=device), random_int4_weight(N, K, dtype, device,
                                                                                  k.tune_group_size(K))

    return TuneTarget(
        name="int4_gemm", space=k.sweep_space, make_inputs=make_inputs,
        run=lambda inputs, config: k.int4_gemm(*inputs, config=k.Int4GemmConfig(**config)),
        reference=lambda inputs: k.int4_gemm_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape, inputs[1]),
        aot=lambda config, shape, cc: compile_launch(k.aot_launch(k.Int4GemmConfig(**config), *shape), cc),
        # fp16 products summed in fp32 vs the fp32 reference: K * eps_fp16 * |x||w| stays well under this
        # at the |y| ~ 1 these inputs give; fp32 inputs (CPU dry run) are far tighter.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 128), (17, 96, 256)), default=lambda shape: asdict(k.default_config(*shape)))


def fp8_gemm() -> TuneTarget:
    """fp8_gemm: the path the runtime takes on this device, fp8 x fp8 (sm_89+) or weight-only below,
    stored under the kernel name the launcher looks up for that path."""
    from tritonq.kernels import fp8_gemm as k
    from tritonq.quant.rtn import quantize_fp8

    weight_only = torch.cuda.is_available() and not k.has_fp8_tensor_cores(torch.device("cuda"))
    cc = k.compute_capability(torch.device("cuda")) if torch.cuda.is_available() else None

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        w = quantize_fp8(torch.randn(N, K) * 0.05, scheme="block" if K % 128 == 0 else "channel").to(device)
        return torch.randn(M, K, dtype=dtype, device=device), w

    return TuneTarget(
        name="fp8_gemm_weight_only" if weight_only else "fp8_gemm", space=k.sweep_space, make_inputs=make_inputs,
        run=lambda inputs, config: k.fp8_gemm(*inputs, weight_only=weight_only, config=k.FP8GemmConfig(**config)),
        reference=lambda inputs: k.fp8_gemm_reference(*inputs, weight_only=weight_only),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape),
        aot=lambda config, shape, cc: compile_launch(k.aot_launch(k.FP8GemmConfig(**config), *shape, cc), cc),
        # Kernel and reference quantize activations identically and accumulate in fp32; what is
        # left is summation order and the fp16 output rounding, far below this at |y| ~ 1.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 256), (17, 96, 256)),
        default=lambda shape: asdict(k.default_config(*shape, cc=cc, block_scaled=shape[2] % 128 == 0,
                                                      weight_only=weight_only)))


def attention_prefill() -> TuneTarget:
    """Causal prefill of whole sequences over 16-token pages (what the models run for a new prompt),
    bucketed by head-dim blocks like `paged_prefill_config`."""
    from tritonq.kernels import attention as k

    def make_inputs(shape, device):
        B, S, H, H_kv, d_qk, d_v = shape
        dtype = kernel_dtype(device)
        q, key, v = (torch.randn(B, S, heads, d, dtype=dtype, device=device)
                     for heads, d in ((H, d_qk), (H_kv, d_qk), (H_kv, d_v)))
        return *k.paged_prompts(q, key, v, _lengths(B, S), k.TUNE_PAGE_SIZE), d_qk ** -0.5

    tol = k.TUNE_TOL[kernel_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))]
    return TuneTarget(
        name="attention_prefill", space=k.prefill_sweep_space, make_inputs=make_inputs,
        run=lambda inputs, config: k.paged_prefill_attention(*inputs, config=k.PrefillConfig(**config)),
        reference=lambda inputs: k.paged_prefill_attention_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(*k.head_blocks(inputs[0].shape[-1], inputs[2].shape[-1])),
        aot=lambda config, shape, cc: compile_launch(k.prefill_aot_launch(k.PrefillConfig(**config), shape), cc),
        atol=tol, rtol=tol, dry_run_shapes=((2, 40, 4, 2, 72, 40), (1, 130, 2, 1, 64, 64)),
        shape_format=k.PREFILL_FORMAT)


def attention_decode() -> TuneTarget:
    """Split-KV decode over 16-token pages; NUM_SPLITS is not swept: the launcher derives it
    (`fit_decode_config`)."""
    from tritonq.kernels import attention as k

    def make_inputs(shape, device):
        B, S_max, H, H_kv, d_qk, d_v = shape
        dtype = kernel_dtype(device)
        k_pages, v_pages, table = k.paged_cache(torch.randn(B, S_max, H_kv, d_qk, dtype=dtype, device=device),
                                                torch.randn(B, S_max, H_kv, d_v, dtype=dtype, device=device),
                                                k.TUNE_PAGE_SIZE)
        q = torch.randn(B, H, d_qk, dtype=dtype, device=device)
        lens = torch.tensor(_lengths(B, S_max), dtype=torch.int32, device=device)
        return q, k_pages, v_pages, lens, table, d_qk ** -0.5

    def run(inputs, config):
        q, k_pages, _, _, table, _ = inputs
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
        capacity = table.shape[1] * k_pages.shape[1]
        cfg = k.fit_decode_config(k.DecodeConfig(NUM_SPLITS=1, **config), q.shape[0], k_pages.shape[2], capacity,
                                  k_pages.shape[1], sm_count)
        return k.decode_attention(*inputs, config=cfg)

    tol = k.TUNE_TOL[kernel_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))]
    return TuneTarget(
        name="attention_decode", space=k.decode_sweep_space, make_inputs=make_inputs, run=run,
        reference=lambda inputs: k.decode_attention_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(*k.head_blocks(inputs[0].shape[-1], inputs[2].shape[-1])),
        aot=lambda config, shape, cc: compile_launch(k.decode_aot_launch(config, shape, cc), cc),
        atol=tol, rtol=tol, dry_run_shapes=((3, 100, 8, 2, 72, 40), (2, 64, 16, 1, 576, 512)),
        shape_format=k.DECODE_FORMAT)


def moe() -> TuneTarget:
    """Fused MoE with int4 experts (group 128, asymmetric: AWQ/GPTQ checkpoints, as `bench moe`).

    The launcher looks up each GEMM under its own bucket (gate/up: N=I, K=D; down: N=D, K=I), so
    a shape is two problems. A candidate for one GEMM runs with the other GEMM's default config
    (`default_config`) at the candidate's BLOCK_M, since both share one token alignment; the
    whole fused_moe is checked and timed.
    """
    from tritonq.kernels import moe as k
    from tritonq.random_weights import random_experts

    def make_inputs(problem, device):
        T, E, top_k, D, inter, gemm = k.tune_problem(problem)
        dtype = kernel_dtype(device)
        x = torch.randn(T, D, dtype=dtype, device=device)
        gate_up = random_experts("int4", E, 2 * inter, D, dtype, device)
        down = random_experts("int4", E, D, inter, dtype, device)
        weights, ids = k.grouped_topk(torch.randn(T, E, device=device), top_k, renormalize=True)
        return x, gate_up, down, weights, ids, gemm

    def run(inputs, config):
        x, gate_up, down, weights, ids, gemm = inputs
        tuned = k.MoEConfig(**config)
        other = replace(k.default_config(*ids.shape, gate_up.qweight.shape[0]), BLOCK_M=tuned.BLOCK_M)
        return k.fused_moe(x, gate_up, down, weights, ids, config=(tuned, other) if gemm == 0 else (other, tuned))

    def bucket(inputs):
        x, _, down, _, _, gemm = inputs
        (T, D), (E, inter) = x.shape, (down.qweight.shape[0], down.qweight.shape[1] * 8)
        return k.config_bucket(T, E, inter, D) if gemm == 0 else k.config_bucket(T, E, D, inter)

    on_gpu = torch.cuda.is_available()
    return TuneTarget(
        name="moe", space=k.sweep_space, make_inputs=make_inputs, run=run,
        reference=lambda inputs: k.fused_moe_reference(*inputs[:5]), bucket=bucket,
        aot=lambda config, problem, cc: compile_launch(k.aot_launch(k.MoEConfig(**config), problem), cc),
        # bf16: x, the dequantized weights and the SiLU-and-mul hidden are each rounded to bf16 (8-bit
        # mantissa) before a GEMM, at unit-scale outputs (tests/kernels/test_moe.py's bound); fp32
        # (interpreter, exact fp32 dots) differs only by summation order.
        atol=5e-2 if on_gpu else 1e-4, rtol=5e-2 if on_gpu else 1e-4,
        dry_run_shapes=((3, 8, 2, 64, 96), (40, 4, 2, 128, 64)), shape_format=k.TUNE_FORMAT,
        problems=lambda shape: [(*k.tune_problem(shape)[:5], gemm) for gemm in range(len(k.TUNE_GEMMS))],
        default=lambda problem: asdict(k.default_config(problem[0], problem[2], problem[1])))

