"""Tuning declarations (python -m tritonq.tune --kernel attention_prefill / attention_decode): the swept
spaces, the shape formats, and the AOT launch builders over meta tensors."""
from __future__ import annotations

import itertools

import torch
import triton

from tritonq.kernels.attention.configs import DecodeConfig, PrefillConfig, fit_decode_config
from tritonq.kernels.attention.launch import decode_launches, paged_prefill_launch
from tritonq.kernels.common import Launch


# Values the tuner sweeps (the tuned fields of PrefillConfig / DecodeConfig), over 16-token pages (the
# engine's default block_size); a decode key tile lies in one page, so decode's BLOCK_N is <= the page.
PREFILL_SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
PREFILL_FORMAT = "BxSxHxHkvxDqkxDv"  # sequences, tokens of each (the first; others random), heads, head dims
DECODE_SPACE = {"BLOCK_N": [16, 32], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}
DECODE_FORMAT = "BxSmaxxHxHkvxDqkxDv"  # batch, cache capacity, heads, head dims
TUNE_PAGE_SIZE = 16
# Attention outputs are convex combinations of N(0, 1) value rows (|o| < ~4). In bf16 the kernel
# rounds p to bf16 before the PV dot and rounds the output (2^-9 relative each), so 2e-2 bounds
# it; fp32 (interpreter) differs only by summation order and exp2 vs exp.
TUNE_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _tune_shape(shape, target: str, shape_format: str) -> tuple[int, ...]:
    from tritonq.kernels.common import unpack_shape

    shape = unpack_shape(shape, target, shape_format)
    if shape[2] % shape[3]:
        raise ValueError(f"{target} shape {'x'.join(map(str, shape))}: query heads H={shape[2]} must be a "
                         f"multiple of kv heads Hkv={shape[3]}")
    return shape


def _candidates(space: dict, keep) -> list[dict]:
    """Every config of the product `space` ({field: values}) that keep(config) accepts, in order."""
    return [c for c in (dict(zip(space, values)) for values in itertools.product(*space.values())) if keep(c)]


def prefill_sweep_space(shape) -> list[dict]:
    """Tiles wider than the sequence (rounded up to a power of two) only compute padding."""
    _, S, *_ = _tune_shape(shape, "attention_prefill", PREFILL_FORMAT)
    return _candidates(PREFILL_SPACE, lambda c: c["BLOCK_M"] <= max(64, triton.next_power_of_2(S))
                       and c["BLOCK_N"] <= max(32, triton.next_power_of_2(S)))


def decode_sweep_space(shape) -> list[dict]:
    """Key tiles within a page, and not wider than the cache (rounded up to a power of two)."""
    _, S_max, *_ = _tune_shape(shape, "attention_decode", DECODE_FORMAT)
    widest = min(TUNE_PAGE_SIZE, max(16, triton.next_power_of_2(S_max)))
    return _candidates(DECODE_SPACE, lambda c: c["BLOCK_N"] <= widest)


def _meta_pages(B: int, S: int, H_kv: int, d_qk: int, d_v: int):
    """bf16 meta pages of TUNE_PAGE_SIZE for B sequences of S tokens, and their block table."""
    per_seq = -(-S // TUNE_PAGE_SIZE)
    meta = dict(dtype=torch.bfloat16, device="meta")
    return (torch.empty(B * per_seq, TUNE_PAGE_SIZE, H_kv, d_qk, **meta),
            torch.empty(B * per_seq, TUNE_PAGE_SIZE, H_kv, d_v, **meta),
            torch.empty(B, per_seq, dtype=torch.int32, device="meta"))


def prefill_aot_launch(config: PrefillConfig, shape) -> Launch:
    """`paged_prefill_launch` over meta tensors: B sequences of S new bf16 tokens over 16-token pages."""
    B, S, H, H_kv, d_qk, d_v = _tune_shape(shape, "attention_prefill", PREFILL_FORMAT)
    k_pages, v_pages, table = _meta_pages(B, S, H_kv, d_qk, d_v)
    i32 = dict(dtype=torch.int32, device="meta")
    q = torch.empty(B * S, H, d_qk, dtype=torch.bfloat16, device="meta")
    return paged_prefill_launch(q, k_pages, v_pages, torch.empty(B + 1, **i32), torch.empty(B, **i32), table,
                                d_qk ** -0.5, 0, config)[0]


def decode_aot_launch(config: dict, shape, cc: int) -> Launch:
    """The split kernel of `decode_launches` over meta tensors: bf16 q and 16-token bf16 pages,
    NUM_SPLITS as `decode_config` picks it on sm_`cc`'s usual SM count (`aot.SM_COUNT`)."""
    from tritonq.kernels.aot import SM_COUNT

    B, S_max, H, H_kv, d_qk, d_v = _tune_shape(shape, "attention_decode", DECODE_FORMAT)
    cfg = fit_decode_config(DecodeConfig(NUM_SPLITS=1, **config), B, H_kv, S_max, TUNE_PAGE_SIZE,
                            SM_COUNT.get(cc, 108))
    k_pages, v_pages, table = _meta_pages(B, S_max, H_kv, d_qk, d_v)
    q = torch.empty(B, H, d_qk, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(B, dtype=torch.int32, device="meta")
    return decode_launches(q, k_pages, v_pages, lens, table, d_qk ** -0.5, 0, cfg)[0]
