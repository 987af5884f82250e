"""Attention benchmark: `python -m tritonq.bench attention [--dtype bf16] [--json PATH]`.

On CUDA, in one run, times paged_prefill_attention (whole prompts over 16-token pages, the
engine's default, as the models run it) against torch SDPA on the same keys laid out contiguously
(causal; SDPA picks its backend: flash for bf16/fp16 head dim 128) and reports TFLOP/s counting
only real FLOPs (causal half, real head dims: 2*S^2/2*(Dqk+Dv) per head), and times
decode_attention over the pages against SDPA on a contiguous [B, Hkv, L, D] cache (enable_gqa)
and reports GB/s of K/V read and the fraction of the device's HBM bandwidth. Every row also gives
the max |ours - SDPA|.
On CPU (the CPU backend, kernels/cpu/attention.py) it times, side by side in one run, the
launchers against the torch references they replaced there (TRITONQ_BACKEND=torch's path): decode
at batch 1 / 16 / 64 with cache lengths drawn from 16..512, and prefill of 4 prompts of 16, 96, 176
and 256 tokens, GQA 16 / 8, head dim 64, fp32, 16-token pages, block tables as wide as the longest sequence
(the engine's are as wide as max_seq_len, which only the references pay for), and the write of the new
keys into the pages (write_kv_slots) of the batch-64 decode step and of the prompts (lens / tokens: the
keys written). ratio = reference ms / ours ms; max_err is against the reference. Under TRITON_INTERPRET=1
(the Triton kernels on CPU) or TRITONQ_BACKEND=torch it reports correctness only: max error vs SDPA on
small shapes.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from tritonq.bench.common import backend_label, device_peaks, print_table, results_path, time_ms, write_json
from tritonq.kernels import backend
from tritonq.kernels.attention import (decode_attention, decode_attention_reference, paged_cache,
                                       paged_prefill_attention, paged_prefill_attention_reference, paged_prompts,
                                       write_kv_slots, write_kv_slots_reference)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PAGE_SIZE = 16  # the engine's default block_size
# (label, B, S, H, Hkv, Dqk, Dv)
PREFILL_GPU = [("llama-8b", 1, 4096, 32, 8, 128, 128), ("llama-8b", 4, 2048, 32, 8, 128, 128),
               ("mha-d128", 2, 8192, 16, 16, 128, 128), ("mha-d64", 2, 8192, 16, 16, 64, 64),
               ("deepseek-v2-lite", 1, 4096, 16, 16, 192, 128)]
PREFILL_CPU = [("gqa-4", 2, 33, 4, 1, 128, 128), ("deepseek-192/128", 2, 33, 2, 2, 192, 128)]
# (label, B, L, H, Hkv, Dqk, Dv): L = cache length of every sequence
DECODE_GPU = [("llama-8b", 1, 8192, 32, 8, 128, 128), ("llama-8b", 1, 32768, 32, 8, 128, 128),
              ("llama-8b", 32, 4096, 32, 8, 128, 128), ("llama-8b", 128, 1024, 32, 8, 128, 128),
              ("deepseek-v2-lite", 8, 4096, 16, 16, 192, 128), ("v2-lite-mla-latent", 8, 4096, 16, 1, 576, 512)]
DECODE_CPU = [("gqa-4", 2, 300, 4, 1, 128, 128), ("deepseek-192/128", 2, 65, 2, 2, 192, 128)]

# CPU backend vs the references: (H, Hkv, D), decode batches with cache lengths drawn uniformly from
# CPU_LENS, prefill of CPU_PROMPTS prompts with lengths spread evenly over CPU_PROMPT_LENS
CPU_HEADS = (16, 8, 64)
CPU_DECODE_BATCHES = (1, 16, 64)
CPU_LENS = (16, 512)
CPU_PROMPTS, CPU_PROMPT_LENS = 4, (16, 256)


def sdpa_bhsd(q, k, v, scale, causal):
    """SDPA on [B, H, S, D] tensors (its native layout), GQA through enable_gqa."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def bench_prefill(shapes, dtype, device, on_gpu) -> list[dict]:
    rows = []
    for label, B, S, H, Hkv, Dqk, Dv in shapes:
        q = torch.randn(B, S, H, Dqk, dtype=dtype, device=device)
        k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device=device)
        v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device=device)
        scale = Dqk ** -0.5
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA gets its own layout
        args = paged_prompts(q, k, v, [S] * B, PAGE_SIZE)

        def ours_fn():
            return paged_prefill_attention(*args, scale)

        ours = ours_fn().view(B, S, H, Dv)
        base = sdpa_bhsd(qt, kt, vt, scale, True).transpose(1, 2)
        row = dict(kind="prefill", shape=label, B=B, S=S, H=H, Hkv=Hkv, Dqk=Dqk, Dv=Dv,
                   max_err=(ours.float() - base.float()).abs().max().item())
        if on_gpu:
            flops = 2 * B * H * S * S / 2 * (Dqk + Dv)
            t_ours = time_ms(ours_fn)
            t_base = time_ms(lambda: sdpa_bhsd(qt, kt, vt, scale, True))
            row |= dict(ms=t_ours, TFLOPs=flops / t_ours / 1e9, sdpa_ms=t_base,
                        sdpa_TFLOPs=flops / t_base / 1e9, ratio=t_base / t_ours)
        rows.append(row)
    return rows


def bench_decode(shapes, dtype, device, on_gpu) -> list[dict]:
    rows = []
    hbm_gbs = device_peaks()[1][0]
    for label, B, L, H, Hkv, Dqk, Dv in shapes:
        q = torch.randn(B, H, Dqk, dtype=dtype, device=device)
        k_cache = torch.randn(B, L, Hkv, Dqk, dtype=dtype, device=device)
        v_cache = torch.randn(B, L, Hkv, Dv, dtype=dtype, device=device)
        cache_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        scale = Dqk ** -0.5
        qt, kt, vt = q[:, :, None], k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
        k_pages, v_pages, table = paged_cache(k_cache, v_cache, PAGE_SIZE)
        ours = decode_attention(q, k_pages, v_pages, cache_lens, table, scale)
        base = sdpa_bhsd(qt, kt, vt, scale, False)[:, :, 0]
        row = dict(kind="decode", shape=label, B=B, S=L, H=H, Hkv=Hkv, Dqk=Dqk, Dv=Dv,
                   max_err=(ours.float() - base.float()).abs().max().item())
        if on_gpu:
            kv_bytes = B * L * Hkv * (Dqk + Dv) * k_cache.element_size()
            t_ours = time_ms(lambda: decode_attention(q, k_pages, v_pages, cache_lens, table, scale))
            t_base = time_ms(lambda: sdpa_bhsd(qt, kt, vt, scale, False))
            row |= dict(ms=t_ours, GBs=kv_bytes / t_ours / 1e6, hbm_frac=kv_bytes / t_ours / 1e6 / hbm_gbs,
                        sdpa_ms=t_base, sdpa_GBs=kv_bytes / t_base / 1e6, ratio=t_base / t_ours)
        rows.append(row)
    return rows


def alternating_ms(fns, rep: int = 7) -> list[float]:
    """Median milliseconds per call of each of fns, timed in turn within every repetition, so that all
    see the same load on a shared machine (after one warm-up call each)."""
    times = [[] for _ in fns]
    for i in range(rep + 1):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            if i:
                t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def bench_cpu_backend(dtype) -> list[dict]:
    """The CPU backend against the torch references on the same inputs, timed alternately in one run."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = CPU_HEADS
    scale = D ** -0.5
    cases = []
    for B in CPU_DECODE_BATCHES:
        lens = torch.randint(CPU_LENS[0], CPU_LENS[1] + 1, (B,), generator=g)
        S = int(lens.max())
        k, v = (torch.randn(B, S, Hkv, D, generator=g, dtype=dtype) for _ in range(2))
        q = torch.randn(B, H, D, generator=g, dtype=dtype)
        k_pages, v_pages, table = paged_cache(k, v, PAGE_SIZE, generator=g)
        args = (q, k_pages, v_pages, lens.int(), table, scale)
        cases.append(("decode", B, lens, partial(decode_attention, *args), partial(decode_attention_reference, *args)))
        if B == CPU_DECODE_BATCHES[-1]:  # the write of that step's new keys, one per sequence at its last position
            cases.append(_write_case(B, k_pages, v_pages, table, lens - 1, torch.ones_like(lens), g))
    lens = torch.linspace(*CPU_PROMPT_LENS, CPU_PROMPTS).int()  # evenly spread: the longest dominates the time
    S = int(lens.max())
    q, k, v = (torch.randn(CPU_PROMPTS, S, heads, D, generator=g, dtype=dtype) for heads in (H, Hkv, Hkv))
    args = (*paged_prompts(q, k, v, lens.tolist(), PAGE_SIZE, generator=g), scale)
    cases.append(("prefill", CPU_PROMPTS, lens, partial(paged_prefill_attention, *args),
                  partial(paged_prefill_attention_reference, *args)))
    cases.append(_write_case(CPU_PROMPTS, *args[1:3], args[5], torch.zeros_like(lens), lens, g))  # the prompts' keys
    rows = []
    for kind, B, lens, ours_fn, reference_fn in cases:
        ours, ref = ours_fn(), reference_fn()
        t_ours, t_ref = alternating_ms([ours_fn, reference_fn])
        rows.append(dict(kind=kind, B=B, lens=f"{int(lens.min())}..{int(lens.max())}", tokens=int(lens.sum()),
                         H=H, Hkv=Hkv, D=D, ms=t_ours, reference_ms=t_ref, ratio=t_ref / t_ours,
                         max_err=(ours.float() - ref.float()).abs().max().item()))
    return rows


def _write_case(B, k_pages, v_pages, table, starts, counts, g) -> tuple:
    """A "write" case: counts[b] new keys of sequence b at positions starts[b] .. into copies of its pages
    (one for write_kv_slots, one for the reference; each call returns its k pages)."""
    seq = torch.repeat_interleave(torch.arange(B), counts)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), counts.tolist())])
    slots = table[seq, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
    k, v = (torch.randn(len(slots), *pages.shape[2:], generator=g, dtype=pages.dtype) for pages in (k_pages, v_pages))

    def writer(write):
        k_copy, v_copy = k_pages.clone(), v_pages.clone()
        return lambda: write(k_copy, v_copy, k, v, slots) or k_copy
    return "write", B, counts, writer(write_kv_slots), writer(write_kv_slots_reference)


def main(argv: list[str]) -> None:
    on_gpu = torch.cuda.is_available()
    cpu_backend = not on_gpu and backend(torch.empty(0)) == "cpu"
    p = argparse.ArgumentParser(prog="python -m tritonq.bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="dtype on GPU (CPU uses float32)")
    p.add_argument("--json", default=results_path("attention_cpu.json" if cpu_backend else "attention.json"),
                   help="write the rows here (default, run inside the checkout: its bench/results/attention.json, "
                        "attention_cpu.json on the CPU backend)")
    args = p.parse_args(argv)
    dtype, device = (DTYPES[args.dtype], "cuda") if on_gpu else (torch.float32, "cpu")
    label = backend_label(device)
    if cpu_backend:
        rows = bench_cpu_backend(dtype)
        print(f"CPU attention ({label}, kernels/cpu/attention.py) vs the torch references; dtype: {dtype}; "
              f"{torch.get_num_threads()} threads; ratio = reference ms / ms")
        print_table(rows)
        if args.json:
            write_json(args.json, "attention", rows, baseline="torch references (decode_attention_reference, "
                       "paged_prefill_attention_reference, write_kv_slots_reference)", dtype=str(dtype),
                       backend=label, threads=torch.get_num_threads(),
                       command=f"python -m tritonq.bench attention {' '.join(argv)}")
        return
    prefill = bench_prefill(PREFILL_GPU if on_gpu else PREFILL_CPU, dtype, device, on_gpu)
    decode = bench_decode(DECODE_GPU if on_gpu else DECODE_CPU, dtype, device, on_gpu)
    print(f"attention vs torch SDPA; backend: {label}; dtype: {dtype}"
          + ("" if on_gpu else " (CPU: correctness only, no timings)"))
    print_table(prefill)
    print_table(decode)
    rows = prefill + decode
    if args.json:
        write_json(args.json, "attention", rows, baseline="torch.nn.functional.scaled_dot_product_attention",
                   dtype=str(dtype), backend=label, command=f"python -m tritonq.bench attention {' '.join(argv)}")
