"""Launch configs of the expert GEMM: MoEConfig, the defaults in code by tokens per expert, the tuned
JSON's bucket key (configs/moe/<gpu>.json), and how a launch's config is chosen and checked."""
from __future__ import annotations

from dataclasses import dataclass

import triton

from tritonq.kernels.common import check_launch_config, config_rows, tuned_or_default


@dataclass(frozen=True)
class MoEConfig:
    """Launch config of one _moe_gemm_kernel GEMM (the fields of its tuned JSON entry)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


# Defaults by tokens per expert (T * k / E), checked by AOT to compile without register spills
# on sm_80 and sm_90 for dense, int4 and fp8 weights.
DEFAULT_CONFIGS = (  # (min tokens per expert, config)
    (0, MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (16, MoEConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
    (64, MoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
)


def config_bucket(tokens: int, num_experts: int, N: int, K: int) -> str:
    """Key of a tuned configs/moe/<gpu>.json entry for one of the two GEMMs (gate/up: N = I, K = D;
    down: N = D, K = I): tokens rounded up to a power of two, exact E, N, K."""
    return f"M{triton.next_power_of_2(tokens)}_E{num_experts}_N{N}_K{K}"


# The decode tile (below DEFAULT_CONFIGS' second threshold) of experts decoded from 32-bit words (int4, MXFP4 on sm_80+:
# `launch.word_path`): twice the K rows, 128 weights a thread per tile and iteration, over which the loop's address
# and scale work spreads (docs/gpu_kernels.md); same grid.
WORD_DECODE_CONFIG = MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def gguf_word_config(tokens: int) -> MoEConfig:
    """The tile of GGUF experts on the decode word path (gguf_gemm's `_diagonal_dot`, `launch.diagonal_path`): row
    blocks of the tokens rounded up to a power of two (no expert gets more rows: one block per routed expert), a K
    tile of 512 / rows (at least 128) whose groups of 32 fill the dot's 16 rows (32 at 8 rows), 64 dot columns
    (gate/up: 32 gate columns and their up columns), 8 warps, 2 stages: gguf_gemm.default_config's decode word tile."""
    rows = triton.next_power_of_2(tokens)
    return MoEConfig(BLOCK_M=rows, BLOCK_N=64, BLOCK_K=max(128, 512 // rows), num_warps=8, num_stages=2)


# GGUF experts forming fp32 weights at the word path's row blocks (the GEMMs share one alignment: a Q4_K_M file's Q6_K
# down beside its Q4_K gate/up): a K tile of 128 over 4 warps (one row's 16 x 64 x 64 default spills 4 B on sm_80 under
# Triton 3.6; Q6_K down's ALU a weight 10.9 / 12.0 on sm_80 / 90 against 12.0 / 13.7); BLOCK_M: the shared row block.
GGUF_FEW_ROWS_CONFIG = MoEConfig(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def default_config(tokens: int, top_k: int, num_experts: int, words: bool = False,
                   diagonal: bool = False) -> MoEConfig:
    """The default in code for this many tokens per expert; words: the experts decode from 32-bit words; diagonal:
    GGUF's decode word path (`gguf_word_config`)."""
    if diagonal:
        return gguf_word_config(tokens)
    per_expert = tokens * top_k / num_experts
    config = [config for threshold, config in DEFAULT_CONFIGS if per_expert >= threshold][-1]
    return WORD_DECODE_CONFIG if words and config == DEFAULT_CONFIGS[0][1] else config


def _config(tokens: int, top_k: int, num_experts: int, N: int, K: int, words: bool = False,
            diagonal: bool = False) -> MoEConfig:
    """Tuned config for this GEMM's shape bucket, else the default for its tokens per expert (and decode path);
    tokens is `config_rows`'s (one config for every batch in the batch-invariant mode)."""
    tokens = config_rows(tokens)
    return tuned_or_default("moe", config_bucket(tokens, num_experts, N, K),
                            default_config(tokens, top_k, num_experts, words, diagonal))


def check_config(config) -> tuple[MoEConfig, MoEConfig]:
    """A MoEConfig (both GEMMs) or a (gate_up, down) pair -> the pair; ValueError if not launchable."""
    pair = (config, config) if isinstance(config, MoEConfig) else config
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(c, MoEConfig) for c in pair)):
        raise ValueError(f"fused_moe: config must be a MoEConfig or a (gate_up, down) pair of them, "
                         f"got {type(config).__name__}")
    for c in pair:
        check_launch_config("fused_moe", c, MoEConfig)
    if pair[0].BLOCK_M != pair[1].BLOCK_M:
        raise ValueError(f"fused_moe: the gate_up and down configs have BLOCK_M {pair[0].BLOCK_M} and "
                         f"{pair[1].BLOCK_M}; both GEMMs share one token alignment, so BLOCK_M must match")
    return pair
