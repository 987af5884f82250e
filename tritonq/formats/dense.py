"""Dense fp16 / bf16 / fp32 checkpoints, optionally round-to-nearest quantized on load.

quantize: None (dense), "fp8" (every linear, per-channel scales, dynamic activations),
"fp8-mlp" (MLP linears only, as TGI does for FP8 Llama), "int4" (every linear, asymmetric,
`group_size` rows per group). Embeddings, lm_head and MoE routers always stay dense.
"""
from __future__ import annotations

import torch

from tritonq.formats.base import WeightsLoader, always_dense
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_split, read_shard
from tritonq.quant.rtn import quantize_fp8, quantize_int4
from tritonq.quant.weights import Weight

QUANTIZE_ON_LOAD = (None, "fp8", "fp8-mlp", "int4")


class DenseLoader(WeightsLoader):
    marker = "weight"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, quantize: str | None = None,
                 group_size: int = 128, *, rank: int = 0, world: int = 1):
        if quantize not in QUANTIZE_ON_LOAD:
            raise ValueError(f"quantize={quantize!r} is not supported (supported: {QUANTIZE_ON_LOAD})")
        self.quantize, self.group_size = quantize, group_size
        super().__init__(weights, config, dtype, device, rank=rank, world=world)

    def is_quantized(self, prefix: str) -> bool:
        if self.quantize is None or always_dense(prefix):
            return False
        return self.quantize != "fp8-mlp" or ".mlp." in prefix

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        """Quantizes this rank's slice: int4 row shards keep whole groups (the same groups as
        unsharded); fp8 per-channel scales of a row shard cover only its K slice."""
        N, K = self.weights.get_shape(f"{prefix}.weight")
        if shard is not None:
            int4_row = self.quantize == "int4" and shard.parallel == "row" and self.group_size != -1
            check_split(prefix, shard, N if shard.parallel == "column" else K,
                             self.group_size if int4_row else 1, "a quantization group" if int4_row else "whole rows")
        w = read_shard(self.weights, f"{prefix}.weight", shard, column=0, row=1)
        if not w.is_floating_point() or w.ndim != 2:
            raise ValueError(f"{prefix}.weight in {self.weights.folder}: expected a float [N, K] matrix, "
                             f"got {w.dtype} {list(w.shape)}")
        w = w.to(self.device)
        if self.quantize == "int4":
            return quantize_int4(w, self.group_size, scale_dtype=self.dtype)
        return quantize_fp8(w, "channel")
