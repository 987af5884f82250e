"""Launch configs: PrefillConfig / DecodeConfig, their head-dim buckets, and the one route that
chooses any launch's config (tuned JSON or the default, fitted to the page and the batch)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from tritonq.kernels import batch_invariant
from tritonq.kernels.common import check_launch_config, compute_capability, tuned_or_default


@dataclass(frozen=True)
class PrefillConfig:
    """Launch config of _paged_prefill_kernel; tuned JSON (attention_prefill) stores the same fields.
    v_pairs: 8-bit V pages read as byte pairs in 16-byte loads (jit._attend_tile), as decode always does;
    the default before sm_90, where the byte tiles came in 8-byte loads (sm_90's 128-row tiles spill with it)."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    v_pairs: bool = False


@dataclass(frozen=True)
class DecodeConfig:
    """Launch config of _decode_split_kernel. Tuned JSON stores BLOCK_N, num_warps, num_stages;
    NUM_SPLITS depends on batch and cache length, so it is always derived (`fit_decode_config`)."""
    BLOCK_N: int
    NUM_SPLITS: int
    num_warps: int
    num_stages: int


def qk_blocks(d_qk: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DR): the largest power of two <= d_qk plus a power-of-two tail block (0 if
    none). 192 = 128 + 64, 96 = 64 + 32, 576 = 512 + 64 waste nothing; 72 = 64 + 16 masks 8 lanes.
    Blocks are at least 16 wide, the smallest tl.dot operand."""
    main = max(16, 1 << (d_qk.bit_length() - 1))
    return main, (max(16, triton.next_power_of_2(d_qk - main)) if d_qk > main else 0)


def config_bucket(block_d: int, block_dr: int, block_dv: int) -> str:
    """Key of the tuned attention_prefill / attention_decode JSON: the head-dim register blocks."""
    return f"D{block_d}+{block_dr}_DV{block_dv}"


def paged_prefill_config(block_d: int, block_dr: int, block_dv: int, cc: int | None) -> PrefillConfig:
    """Tuned config of _paged_prefill_kernel for these head-dim blocks on this GPU (compute capability
    cc), else the default in code; cc None means the interpreter: 16 x 16 tiles, so that small test
    shapes still span several blocks and tails.

    Defaults (0 spills in AOT compiles at the launch's real divisibility hints and GQA, 32 / 8 heads;
    MLA 16 / 1): 128 query rows up to DeepSeek's 128 + 64 head dims, 64 for wider heads (256); 64-key
    tiles, but 32 before sm_90 above 64-wide heads (the per-key page gather's registers: 64 keys spill
    28 bytes at 128 / 128 and 80 at 256 / 256 on sm_80); MLA latent 576 / 512 heads a [16, 512] fp32
    accumulator as decode's, with 32-key tiles before sm_90 and 16 from sm_90 on (32 spill 4 bytes
    there with a window or 64-token pages).
    Before sm_80 (T4: 64 KB of shared memory per block; Triton 3.x lowers tl.dot to FMA there, no mma,
    and has no cp.async to pipeline): 64 query rows (32 for 256-wide heads), 16-key tiles, one stage:
    41-57 KB, no spills at head dims 64-192 (tests/aot/test_fit.py); 128-row tiles need 80-112 KB. No
    tile fits MLA's latent 576 / 512 there: the [16, 512] query and accumulator alone take 68 KB.
    """
    if cc is None:
        return PrefillConfig(16, 16, 1, 1)
    if cc < 80 and block_dv <= 256:
        narrow_heads = block_d + block_dr <= 192 and block_dv <= 128
        default = PrefillConfig(64 if narrow_heads else 32, 16, 8, 1)
    elif block_dv > 256:
        default = PrefillConfig(16, 32 if cc < 90 else 16, 8, 2)
    else:
        block_n = 64 if cc >= 90 or block_d + block_dr <= 64 else 32
        narrow_heads = block_d + block_dr <= 192 and block_dv <= 128
        default = PrefillConfig(128 if narrow_heads else 64, block_n, 8, 3 if narrow_heads else 2, v_pairs=cc < 90)
    return tuned_or_default("attention_prefill", config_bucket(block_d, block_dr, block_dv), default)


def decode_config(batch: int, kv_heads: int, max_len: int, page_size: int, block_d: int, block_dr: int,
                  block_dv: int, sm_count: int | None) -> DecodeConfig:
    """The decode launch config over pages of page_size: the tuned (else default) key tile, capped by
    `paged_block_n`, and splits so that batch x kv_heads x splits programs fill about two waves of
    sm_count SMs.

    Chosen from the cache capacity (not cache_lens, which live on the device) so the launch needs
    no host sync and stays CUDA-graph friendly; each split keeps at least 4 key tiles.
    sm_count None means the interpreter: 16-token tiles and up to 4 splits, so that small test
    caches span several tiles, several splits and empty splits.
    In the batch-invariant mode the splits are chosen as for a batch of one whatever the batch: a row's keys are then
    split at the same places (each split's length follows its own cache length) and merged in the same order.
    """
    batch = 1 if batch_invariant() else batch
    if sm_count is None:
        return fit_decode_config(DecodeConfig(16, 1, 1, 1), batch, kv_heads, max_len, page_size, None)
    # 32-key tiles (the most a page lookup allows, `paged_block_n`); 256-wide and MLA latent 576 / 512
    # values need 8 warps for their [16, Dv] fp32 accumulator.
    default = DecodeConfig(32, 1, 8 if block_dv > 128 else 4, 2)
    cfg = tuned_or_default("attention_decode", config_bucket(block_d, block_dr, block_dv), default)
    return fit_decode_config(cfg, batch, kv_heads, max_len, page_size, sm_count)


def paged_block_n(block_n: int, page_size: int) -> int:
    """The decode key tile: within one page, and at most 32 keys, since the per-key page lookup costs
    registers (sm_80, Dqk 128: 64-key tiles over 64-token pages spill 92 registers, 32-key tiles none)."""
    return min(block_n, page_size, 32)


def fit_decode_config(cfg: DecodeConfig, batch: int, kv_heads: int, max_len: int, page_size: int,
                      sm_count: int | None) -> DecodeConfig:
    """cfg with the key tile launched over pages of page_size (`paged_block_n`) and NUM_SPLITS derived
    (cfg's own is ignored): about two waves of programs on sm_count SMs, >= 4 key tiles per split; the
    interpreter (sm_count None) takes up to 4 splits."""
    block_n = paged_block_n(cfg.BLOCK_N, page_size)
    if sm_count is None:
        splits = min(4, triton.cdiv(max_len, block_n))
    else:
        wanted = triton.cdiv(2 * sm_count, batch * kv_heads)
        splits = max(1, min(wanted, triton.cdiv(max_len, 4 * block_n), 64))
    return replace(cfg, BLOCK_N=block_n, NUM_SPLITS=splits)


def check_prefill_config(config: PrefillConfig) -> None:
    """TypeError/ValueError unless `config` is a launchable PrefillConfig."""
    check_launch_config("paged_prefill_attention", config, PrefillConfig)
    if not isinstance(config.v_pairs, bool):
        raise TypeError(f"paged_prefill_attention: config.v_pairs = {config.v_pairs!r}, expected True or False")


def check_decode_config(config: DecodeConfig, page_size: int) -> None:
    """TypeError/ValueError unless `config` is a launchable DecodeConfig with BLOCK_N <= page_size."""
    check_launch_config("decode_attention", config, DecodeConfig)
    if config.BLOCK_N > page_size:
        raise ValueError(f"decode_attention: config.BLOCK_N = {config.BLOCK_N} exceeds the KV cache page size "
                         f"{page_size}; a key tile must lie in one page, so use BLOCK_N <= {page_size}")


def head_blocks(d_qk: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_DR, BLOCK_DV): the register blocks of the qk head dim (`qk_blocks`) and of the
    v head dim (a power of two >= 16); they key the tuned configs (`config_bucket`)."""
    return (*qk_blocks(d_qk), max(16, triton.next_power_of_2(d_v)))


def launch_config(kind: type[PrefillConfig] | type[DecodeConfig], q: torch.Tensor, k_pages: torch.Tensor,
                  v_pages: torch.Tensor, block_table: torch.Tensor, window: int = 0,
                  max_seq_len: int | None = None) -> PrefillConfig | DecodeConfig:
    """The one route from a launch's checked inputs to its config when the caller gives none: the head-dim
    bucket (`head_blocks`), the device (compute capability for prefill, SM count for decode), then the
    tuned JSON or the default (`paged_prefill_config` / `decode_config`). q [T or B, H, Dqk]; k_pages,
    v_pages [P, page_size, Hkv, D] (8-bit pages' data). A decode config follows the capacity, never
    cache_lens: max_seq_len, else the block table's width x page_size, capped by a window (the keys any
    query sees), so a growing sequence keeps one compiled kernel and the launch reads nothing from the device."""
    blocks = head_blocks(q.shape[-1], v_pages.shape[-1])
    if kind is PrefillConfig:
        return paged_prefill_config(*blocks, compute_capability(q.device))
    page_size = k_pages.shape[1]
    capacity = max_seq_len or block_table.shape[1] * page_size
    if window:
        capacity = min(capacity, window)
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
    return decode_config(q.shape[0], k_pages.shape[2], capacity, page_size, *blocks, sm_count)
