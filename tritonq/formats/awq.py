"""AutoAWQ GEMM checkpoints -> Int4Weight.

config.json: quantization_config {quant_method: awq, bits: 4, group_size, zero_point: true,
version: gemm, modules_to_not_convert}. Per linear P: P.qweight int32 [K, N/8] and P.qzeros
int32 [G, N/8] packed along N in AWQ order, P.scales fp16 [G, N]. Repacked on load into the
internal layout (packed along K) with packing.awq_to_int4.
"""
from __future__ import annotations

import torch

from tritonq.formats.base import Int4Weight, Weights, WeightsLoader
from tritonq.formats.packing import awq_to_int4

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128, 256)


class AWQLoader(WeightsLoader):
    marker = "qweight"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device):
        q = config["quantization_config"]
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {q.get('version')!r} is not supported (supported: 'gemm'); GEMV "
                             "checkpoints pack along K ([N, K/8]) — re-export the model with AutoAWQ version='gemm'")
        if q.get("bits", q.get("w_bit")) != 4:
            raise ValueError(f"AWQ bits={q.get('bits', q.get('w_bit'))} is not supported (supported: 4)")
        self.group_size = q.get("group_size", q.get("q_group_size"))
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ group_size={self.group_size} is not supported (supported: {SUPPORTED_GROUP_SIZES})")
        if not q.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported (supported: true, the AutoAWQ GEMM default)")
        super().__init__(weights, config, dtype, device, q.get("modules_to_not_convert"))

    def quantized_linear(self, prefix: str) -> Int4Weight:
        qweight = self.weights.get_tensor(f"{prefix}.qweight", dtype=torch.int32)
        K, n_packed = qweight.shape
        N = n_packed * 8
        group_size = K if self.group_size == -1 else self.group_size
        if K % group_size:
            raise ValueError(f"{prefix}.qweight: K={K} is not a multiple of group_size={group_size}")
        G = K // group_size
        scales = self.weights.get_tensor(f"{prefix}.scales", dtype=torch.float16, shape=(G, N))
        qzeros = self.weights.get_tensor(f"{prefix}.qzeros", dtype=torch.int32, shape=(G, n_packed))
        w = awq_to_int4(qweight.to(self.device), qzeros.to(self.device), scales.to(self.device), group_size)
        return Int4Weight(w.qweight, w.scales.to(self.dtype), w.zeros.to(self.dtype), None, w.group_size, 4)
