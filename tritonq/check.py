"""python -m tritonq.check: run every Triton kernel on this machine's GPU against its torch reference.

Each case builds random inputs at odd shapes (M = 1, 3, 17, 130; K, N not multiples of the
tiles), runs the Triton kernel and the kernel file's own `*_reference` (plain torch, float32
compute) on the same device, and prints the error relative to the reference's largest value:

    err = max |ours - ref| / max |ref|

Tolerances follow the output dtype: fp16 outputs round at 2^-11 relative, bf16 at 2^-8, and a
K-long fp32-accumulated dot adds little on top, so fp16 cases pass under 1e-2 and bf16 under
3e-2; integer outputs (routing ids) must be equal, and fp8 activation codes too (both sides round
to nearest even: 1e-6). Models: fp16 on the GPU against the fp32 CPU path through two layers,
5e-2; in the interpreter both are fp32: 1e-3. A tiny Llama (AWQ, GPTQ act-order, FP8
checkpoints from our writer) and a tiny DeepSeek-V2 (AWQ experts, expanded and latent attention)
then run end to end through the kernels and are compared with the CPU torch path. Exit status 1
if any case fails.

Without a GPU it runs the same cases, smaller (--quick), through Triton's interpreter, as CI does
(it sets TRITON_INTERPRET=1 itself when triton is not imported yet).
    python -m tritonq.check [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-3}


def _cases(device: str, quick: bool):
    """Yield (family, case name, ours, reference) with tensors on `device`."""
    import torch

    from tritonq.kernels import attention as attn
    from tritonq.kernels import fp8_gemm as fp8
    from tritonq.kernels import int4_gemm as int4
    from tritonq.kernels import moe
    from tritonq.kernels.norm_rope import rms_norm, rms_norm_reference
    from tritonq.quantize import quantize_int4
    from tritonq.random_weights import random_experts, random_fp8_weight

    on_gpu = device == "cuda"
    dtypes = [torch.float16, torch.bfloat16] if on_gpu else [torch.float16]
    ms = [1, 3, 17, 130] if not quick else [1, 17]
    K, N = (4096 + 128, 4096 + 72) if not quick else (256, 72)

    for dtype in dtypes:
        dname = str(dtype).removeprefix("torch.")
        for label, opts in (("asym g128", {"group_size": 128}), ("sym g64", {"group_size": 64, "sym": True}),
                            ("act-order g128", {"group_size": 128, "act_order": True}),
                            ("per-channel 8-bit", {"group_size": -1, "bits": 8})):
            w = quantize_int4(torch.randn(N, K) / K ** 0.5, scale_dtype=dtype, **opts)
            w = w.to(device)
            for M in ms:
                x = torch.randn(M, K, device=device, dtype=dtype)
                yield "int4_gemm", f"{label} {dname} M={M} N={N} K={K}", int4.int4_gemm(x, w), \
                    int4.int4_gemm_reference(x, w)

        schemes = ["tensor", "channel", "block"]
        paths = [True] if on_gpu and torch.cuda.get_device_capability() < (8, 9) else [False, True]
        for scheme in schemes:
            w = random_fp8_weight(N, K, scheme, device)
            for weight_only in paths:
                for M in ms:
                    x = torch.randn(M, K, device=device, dtype=dtype)
                    path = "weight-only" if weight_only else "fp8 x fp8"
                    yield "fp8_gemm", f"{scheme} {path} {dname} M={M}", fp8.fp8_gemm(x, w, weight_only), \
                        fp8.fp8_gemm_reference(x, w, weight_only)
        for group in (None, 128):
            x = torch.randn(max(ms), K, device=device, dtype=dtype) * 3
            q, s = fp8.quantize_activation_fp8(x, group)
            q_ref, s_ref = fp8.quantize_activation_fp8_reference(x, group)
            yield "fp8_quant", f"group={group} {dname}", _dequantize_activation(q, s, group), \
                _dequantize_activation(q_ref, s_ref, group)

        x = torch.randn(max(ms), K, device=device, dtype=dtype)
        weight = torch.rand(K, device=device, dtype=dtype) + 0.5
        yield "rms_norm", f"{dname} D={K}", rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)

        # attention: (head dim qk, head dim v, heads, kv heads); DeepSeek-V2 192/128 and latent 576/512
        heads = [(128, 128, 32, 8), (192, 128, 16, 16), (96, 96, 8, 1), (576, 512, 16, 1)]
        lens = [1, 7, 300] if not quick else [1, 7, 33]
        for d_qk, d_v, H, H_kv in heads if not quick else heads[1:3]:
            B, S = len(lens), max(lens)
            seq = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(B, S, H, d_qk, device=device, dtype=dtype)
            k = torch.randn(B, S, H_kv, d_qk, device=device, dtype=dtype)
            v = torch.randn(B, S, H_kv, d_v, device=device, dtype=dtype)
            scale = d_qk ** -0.5
            if d_qk != 576:  # the latent mode decodes only
                yield "attention", f"prefill {d_qk}/{d_v} H={H}/{H_kv} lens={lens} {dname}", \
                    attn.prefill_attention(q, k, v, seq, scale), attn.prefill_attention_reference(q, k, v, seq, scale)
            yield "attention", f"decode {d_qk}/{d_v} H={H}/{H_kv} lens={lens} {dname}", \
                attn.decode_attention(q[:, 0], k, v, seq, scale), \
                attn.decode_attention_reference(q[:, 0], k, v, seq, scale)
            k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
            k_ref, v_ref = torch.zeros_like(k), torch.zeros_like(v)
            start = torch.tensor([0, 3, S - 2], dtype=torch.int32, device=device)
            attn.write_kv_cache(k_cache, v_cache, k[:, :2], v[:, :2], start)
            attn.write_kv_cache_reference(k_ref, v_ref, k[:, :2], v[:, :2], start)
            yield "attention", f"write_kv_cache {d_qk}/{d_v} {dname}", torch.cat([k_cache.flatten(), v_cache.flatten()]), \
                torch.cat([k_ref.flatten(), v_ref.flatten()])

        # MoE: DeepSeek-V2-Lite-like shapes, scaled down in quick mode
        E, top_k, D, inter = (64, 6, 2048, 1408) if not quick else (8, 2, 128, 128)
        logits = torch.randn(max(ms) * 2, E, device=device)
        for n_group, topk_group in ((1, 1), (8 if not quick else 4, 3 if not quick else 2)):
            ours, ref = moe.grouped_topk(logits, top_k, n_group, topk_group), \
                moe.grouped_topk_reference(logits, top_k, n_group, topk_group)
            yield "moe_routing", f"E={E} n_group={n_group}", ours[1], ref[1]
        for kind in ("dense", "int4", "fp8"):
            gate_up, down = (random_experts(kind, E, n, k_, dtype, device) for n, k_ in ((2 * inter, D), (D, inter)))
            for T in ms:
                weights, ids = moe.grouped_topk(torch.randn(T, E, device=device), top_k)
                x = torch.randn(T, D, device=device, dtype=dtype)
                yield "fused_moe", f"{kind} {dname} T={T} E={E} top_k={top_k}", \
                    moe.fused_moe(x, gate_up, down, weights, ids), \
                    moe.fused_moe_reference(x, gate_up, down, weights, ids)


def _dequantize_activation(q, scales, group: int | None):
    """x_fp8 [M, K] and its per-token [M, 1] or per-group [M, G] scales -> float32 [M, K]."""
    if group is not None:
        scales = scales.repeat_interleave(group, 1)[:, :q.shape[1]]
    return q.float() * scales


@contextlib.contextmanager
def _torch_backend():
    """Run the torch references (the CPU runtime path) inside the block, whatever the device."""
    before = os.environ.get("TRITONQ_BACKEND")
    os.environ["TRITONQ_BACKEND"] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITONQ_BACKEND"]
        else:
            os.environ["TRITONQ_BACKEND"] = before


def _tiny_deepseek_v2(folder: Path, quick: bool) -> Path:
    """A seeded random DeepSeek-V2 (MLA with qk 128+64 / v 128 heads, 8 routed + 1 shared expert)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    nope, rope, v, lora = (16, 8, 16, 64) if quick else (128, 64, 128, 512)
    config = DeepseekV2Config(vocab_size=300, hidden_size=128 if quick else 256, intermediate_size=256,
                              moe_intermediate_size=64 if quick else 128, num_hidden_layers=2, num_attention_heads=4,
                              kv_lora_rank=lora, q_lora_rank=None, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                              v_head_dim=v, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=256,
                              bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(folder)
    return folder


def _model_cases(device: str, quick: bool):
    """Tiny Llama (AWQ, GPTQ act-order, FP8) and DeepSeek-V2 (AWQ experts, both attention modes) built
    from our writer's checkpoints: last-token logits through the Triton kernels on `device` (fp16 on a
    GPU; fp32 in the interpreter) vs the torch references in float32 on the CPU."""
    import torch
    from transformers import AutoConfig

    from tritonq.demo import write_tiny_llama
    from tritonq.engine.runner import prefill_logits
    from tritonq.formats.registry import get_loader
    from tritonq.models import model_class
    from tritonq.quantize import write_quantized

    dtype = torch.float16 if device == "cuda" else torch.float32
    ids = torch.tensor([[256] + list(b"Tell me about Triton")])
    with tempfile.TemporaryDirectory() as tmp:
        llama = write_tiny_llama(Path(tmp) / "llama", hidden_size=64 if quick else 256, num_layers=2)
        deepseek = _tiny_deepseek_v2(Path(tmp) / "deepseek", quick)
        models = [("llama", llama, fmt, opts, {}) for fmt, opts in
                  (("awq", {"group_size": 64}), ("gptq", {"group_size": 64, "act_order": True}), ("fp8", {}))]
        models += [("deepseek_v2", deepseek, "awq", {"group_size": 64}, {"attention_mode": mode})
                   for mode in ("expanded", "latent")]
        for arch, dense, fmt, opts, kwargs in models:
            folder = write_quantized(dense, Path(tmp) / f"{arch}-{fmt}", fmt, **opts)
            config = AutoConfig.from_pretrained(folder)
            logits = []
            for dev, dt, backend in ((device, dtype, contextlib.nullcontext), ("cpu", torch.float32, _torch_backend)):
                with backend():
                    m = model_class(config.model_type)(config, get_loader(folder, dt, dev), dt, dev, **kwargs)
                    out = prefill_logits(m, ids[0].tolist(), last_only=True)
                logits.append(out.float().cpu())
            mode = f" {kwargs['attention_mode']}" if kwargs else ""
            yield "model", f"tiny {arch}{mode} {fmt}: {device} kernels vs CPU torch", logits[0], logits[1]


def _error(ours, ref) -> float:
    import torch
    if not ours.is_floating_point():
        return 0.0 if torch.equal(ours.cpu(), ref.cpu()) else float("inf")
    ours, ref = ours.float().cpu(), ref.float().cpu()
    if ours.shape != ref.shape:
        return float("inf")
    return float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonq.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small shapes (always without a GPU, where the kernels run in Triton's interpreter)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    import torch
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # the interpreter is chosen when triton is first imported
            sys.exit("python -m tritonq.check: no CUDA device, and triton was imported without TRITON_INTERPRET=1; "
                     "run `TRITON_INTERPRET=1 python -m tritonq.check` to check the kernels through the interpreter")
        os.environ["TRITON_INTERPRET"] = "1"
        print("no CUDA device: running the --quick cases through Triton's interpreter (TRITON_INTERPRET=1)")
    device = "cuda" if on_gpu else "cpu"
    quick = args.quick or not on_gpu
    name = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    print(f"tritonq kernel check on {name}; err = max|ours - ref| / max|ref|")
    rows, failed = [], 0
    from itertools import chain
    cases = chain(_cases(device, quick), _model_cases(device, quick))
    for family, case, ours, ref in cases:
        err = _error(ours, ref)
        dtype = str(ours.dtype).removeprefix("torch.")
        tol = {"model": 5e-2 if on_gpu else 1e-3, "fp8_quant": 1e-6}.get(family, TOLERANCE.get(dtype, 0.0))
        ok = err <= tol
        failed += not ok
        rows.append({"family": family, "case": case, "err": err, "tol": tol, "ok": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {family:12s} {case:60s} err {err:.2e} (tol {tol:.0e})", flush=True)
    print(f"{len(rows) - failed} of {len(rows)} cases within tolerance")
    if args.json:
        from tritonq.bench.common import write_json
        write_json(args.json, "check", rows, device=name, command=f"python -m tritonq.check {' '.join(argv or [])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
