"""Every Triton kernel at realistic shapes on the GPU (marked gpu: skipped without CUDA; the small odd
shapes of the other kernel tests run everywhere). Formerly `python -m tritonq.check`'s own cases;
err = max |ours - ref| / max |ref| against each kernel file's torch reference on the same device.
"""
import pytest
import tolerances
import torch


def _cases(device: str):
    """Yield (family, case name, ours, reference) with tensors on `device` (formerly tritonq.check's)."""
    from tritonq.random_weights import random_experts, random_fp8_weight
    from tritonq.kernels import attention as attn
    from tritonq.kernels import fp8_gemm as fp8
    from tritonq.kernels import int4_gemm as int4
    from tritonq.kernels import moe
    from tritonq.kernels.norm_rope import rms_norm, rms_norm_reference
    from tritonq.quant.rtn import quantize_int4

    on_gpu = device == "cuda"
    dtypes = [torch.float16, torch.bfloat16] if on_gpu else [torch.float16]
    ms = [1, 3, 17, 130]
    K, N = 4096 + 128, 4096 + 72

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
        lens = [1, 7, 300]
        for d_qk, d_v, H, H_kv in heads:
            B, S = len(lens), max(lens)
            seq = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(B, S, H, d_qk, device=device, dtype=dtype)
            k = torch.randn(B, S, H_kv, d_qk, device=device, dtype=dtype)
            v = torch.randn(B, S, H_kv, d_v, device=device, dtype=dtype)
            scale = d_qk ** -0.5
            prefill = (*attn.paged_prompts(q, k, v, lens, 16), scale)  # the engine's default page size
            _, k_pages, v_pages, _, _, table, _ = prefill
            if d_qk != 576:  # the latent mode prefills through its expanded heads: 576 / 512 decodes only here
                yield "attention", f"prefill {d_qk}/{d_v} H={H}/{H_kv} lens={lens} {dname}", \
                    attn.paged_prefill_attention(*prefill), attn.paged_prefill_attention_reference(*prefill)
            yield "attention", f"decode {d_qk}/{d_v} H={H}/{H_kv} lens={lens} {dname}", \
                attn.decode_attention(q[:, 0], k_pages, v_pages, seq, table, scale), \
                attn.decode_attention_reference(q[:, 0], k_pages, v_pages, seq, table, scale)
            pages = [torch.zeros(8, 16, H_kv, d, device=device, dtype=dtype) for d in (d_qk, d_v, d_qk, d_v)]
            slots = torch.tensor([3, 17, -1, 100, 127], dtype=torch.int64, device=device)  # -1: a padding row
            attn.write_kv_slots(pages[0], pages[1], k[0, :5], v[0, :5], slots)
            attn.write_kv_slots_reference(pages[2], pages[3], k[0, :5], v[0, :5], slots)
            yield "attention", f"write_kv_slots {d_qk}/{d_v} {dname}", \
                torch.cat([pages[0].flatten(), pages[1].flatten()]), torch.cat([pages[2].flatten(), pages[3].flatten()])

        # MoE: DeepSeek-V2-Lite-like shapes
        E, top_k, D, inter = 64, 6, 2048, 1408
        logits = torch.randn(max(ms) * 2, E, device=device)
        for n_group, topk_group in ((1, 1), (8, 3)):
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


def _error(ours, ref) -> float:
    """max |ours - ref| / max |ref|; integer outputs (routing ids) must be equal (else inf)."""
    if not ours.is_floating_point():
        return 0.0 if torch.equal(ours.cpu(), ref.cpu()) else float("inf")
    ours, ref = ours.float().cpu(), ref.float().cpu()
    if ours.shape != ref.shape:
        return float("inf")
    return float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


@pytest.mark.gpu
def test_every_kernel_at_realistic_shapes_on_the_gpu():
    """int4/fp8 GEMMs at K = 4224, N = 4168 and M = 1, 3, 17, 130; fp8 activation quantization; rms_norm;
    prefill/decode attention for Llama, DeepSeek-V2 expanded/latent and MQA heads; MoE routing and the
    fused experts at DeepSeek-V2-Lite sizes; in fp16 and bf16 (tolerance: tests/tolerances.py "large";
    fp8 activation codes 1e-6: both sides round to nearest even; routing ids exactly)."""
    failures, count = [], 0
    for family, case, ours, ref in _cases("cuda"):
        count += 1
        tol = 1e-6 if family == "fp8_quant" else tolerances.table("large").get(ours.dtype, 0.0)
        err = _error(ours, ref)
        if not err <= tol:
            failures.append(f"{family} {case}: err {err:.2e} > {tol:.0e}")
    assert not failures, f"{len(failures)} of {count} cases:\n" + "\n".join(failures)
