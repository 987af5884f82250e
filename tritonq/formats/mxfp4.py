"""MXFP4 checkpoints (quant_method "mxfp4": OpenAI's gpt-oss) -> MXFP4Weight experts.

Only the fused MoE experts are quantized; attention, routers, embeddings and lm_head stay bf16
(config `modules_to_not_convert`, whose entries may hold `*` wildcards, e.g. "model.layers.*.self_attn").
Per layer L (transformers' integrations/mxfp4.py, which dequantizes them for its own reference):
  model.layers.L.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, D/32, 16]  two e2m1 codes a byte, low nibble first
  model.layers.L.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, D/32]      E8M0: x 2^(s - 127) per 32 along K
  model.layers.L.mlp.experts.gate_up_proj_bias    [E, 2I]                  gate / up rows interleaved
  model.layers.L.mlp.experts.down_proj_blocks / _scales / _bias            [E, D, I/32, 16] / [E, D, I/32] / [E, D]
i.e. rows are output features (N) and K runs along the blocks: the stacked [E, N, K] the MoE kernel reads.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_split, read_shard
from tritonq.quant.rtn import MXFP4_MAX_SCALE
from tritonq.quant.weights import MXFP4_GROUP, MXFP4Weight, Weight


class MXFP4Loader(WeightsLoader):

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        ignore = config["quantization_config"].get("modules_to_not_convert") or []
        super().__init__(weights, config, dtype, device, ignore, rank=rank, world=world)

    def is_ignored(self, prefix: str) -> bool:
        """An entry with wildcards matches the module or anything under it; a plain one as a substring."""
        return any(fnmatchcase(prefix, entry) or fnmatchcase(prefix, entry + ".*") if "*" in entry else entry in prefix
                   for entry in self.ignore)

    def is_quantized(self, prefix: str) -> bool:
        return not self.is_ignored(prefix) and self.weights.has_tensor(f"{prefix}_blocks")

    def quantized_experts(self, name: str, shape: tuple[int, int, int], shard: Shard | None) -> MXFP4Weight:
        """This rank's experts: a column shard takes output rows (dim 1), a row shard whole 32-element groups
        along K (dim 2 of both blocks and scales)."""
        E, N, K = shape
        if K % MXFP4_GROUP:
            raise ValueError(f"{self.weights.folder}: {name} has K={K} inputs, not a multiple of the MXFP4 group "
                             f"{MXFP4_GROUP}; the config does not match an MXFP4 checkpoint")
        if shard is not None and shard.parallel == "row":
            check_split(name, shard, K, MXFP4_GROUP, f"an MXFP4 group of {MXFP4_GROUP} inputs")
        blocks = read_shard(self.weights, f"{name}_blocks", shard, column=1, row=2, dtype=torch.uint8,
                           shape=(E, N, K // MXFP4_GROUP, 16))
        scales = read_shard(self.weights, f"{name}_scales", shard, column=1, row=2, dtype=torch.uint8, shape=(E, N, K // MXFP4_GROUP))
        if not scales.is_meta and int(scales.max()) > MXFP4_MAX_SCALE:
            raise ValueError(f"{self.weights.folder}: {name}_scales holds E8M0 exponent {int(scales.max())} "
                             f"(a scale of 2^{int(scales.max()) - 127}); the MXFP4 kernels take exponents up to "
                             f"{MXFP4_MAX_SCALE} (2^{MXFP4_MAX_SCALE - 127}), far beyond any trained weight")
        return MXFP4Weight(blocks.to(self.device).contiguous(), scales.to(self.device).contiguous())

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        raise ValueError(f"{self.weights.folder}: {prefix} is an MXFP4 linear; tritonq reads MXFP4 for fused MoE "
                         "experts only (gpt-oss), not for dense layers")
