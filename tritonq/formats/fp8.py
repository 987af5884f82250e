"""FP8 checkpoints -> FP8Weight.

quant_method "fp8" (AutoFP8 / llm-compressor exports, DeepSeek-V3, transformers FineGrainedFP8):
  per tensor:  P.weight float8_e4m3fn [N, K], P.weight_scale fp32 [] (or [1]);
  block:       config weight_block_size [bn, bk]; P.weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]
               (despite the name, W = weight * weight_scale_inv);
  activation_scheme "static" adds P.input_scale fp32 [], "dynamic" quantizes per token at run time.
quant_method "fbgemm_fp8" (Meta's FP8 Llama): per channel, P.weight_scale fp32 [N, 1], dynamic.
Ignore lists: modules_to_not_convert / ignored_layers.
"""
from __future__ import annotations

import math

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_fp8_split, read_shard
from tritonq.quant.weights import FP8Weight

SUPPORTED_FMTS = ("e4m3",)
SUPPORTED_ACTIVATION_SCHEMES = ("dynamic", "static")


class FP8Loader(WeightsLoader):

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        q = config["quantization_config"]
        if q.get("fmt", "e4m3") not in SUPPORTED_FMTS:
            raise ValueError(f"fp8 fmt={q.get('fmt')!r} is not supported (supported: {SUPPORTED_FMTS})")
        self.activation_scheme = q.get("activation_scheme", "dynamic")
        if self.activation_scheme not in SUPPORTED_ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme={self.activation_scheme!r} is not supported "
                             f"(supported: {SUPPORTED_ACTIVATION_SCHEMES})")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"fp8 weight_block_size={block} is not supported (expected two positive ints, e.g. [128, 128])")
        self.block_size = None if block is None else tuple(block)
        ignore = (q.get("modules_to_not_convert") or []) + (q.get("ignored_layers") or [])
        super().__init__(weights, config, dtype, device, ignore, rank=rank, world=world)
        self.marker = "weight_scale" if self.block_size is None else "weight_scale_inv"

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> FP8Weight:
        """Shards slice the weight; a per-tensor scale is replicated, a per-channel one sliced with N
        (kept whole by a row shard), block scales sliced by block (a shard never cuts a block)."""
        N, K = self.weights.get_shape(f"{prefix}.weight")
        check_fp8_split(prefix, shard, N, K, self.block_size, "weight_scale_inv")
        weight = read_shard(self.weights, f"{prefix}.weight", shard, column=0, row=1, dtype=torch.float8_e4m3fn)
        if self.block_size is not None:
            bn, bk = self.block_size
            scale = read_shard(self.weights, f"{prefix}.weight_scale_inv", shard, column=0, row=1, dtype=torch.float32,
                              shape=(math.ceil(N / bn), math.ceil(K / bk)))
        else:
            shape = self.weights.get_shape(f"{prefix}.weight_scale")
            if math.prod(shape) == 1:
                scale = self.weights.get_tensor(f"{prefix}.weight_scale", dtype=torch.float32).reshape(())
            elif shape == (N, 1):
                scale = read_shard(self.weights, f"{prefix}.weight_scale", shard, column=0, row=None, dtype=torch.float32)
            else:
                raise ValueError(f"{self.weights.folder}: tensor '{prefix}.weight_scale' has shape {list(shape)}, "
                                 f"expected [] (per tensor) or [{N}, 1] (per channel)")
        input_scale = None
        if self.activation_scheme == "static":
            input_scale = self.input_scale(f"{prefix}.input_scale", dtype=torch.float32)
        return FP8Weight(weight.to(self.device), scale.to(self.device), self.block_size, input_scale)
