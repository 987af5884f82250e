"""AutoAWQ GEMM checkpoints -> Int4Weight.

config.json: quantization_config {quant_method: awq, bits: 4, group_size, zero_point: true,
version: gemm, modules_to_not_convert}. Per linear P: P.qweight int32 [K, N/8] and P.qzeros
int32 [G, N/8] packed along N in AWQ order, P.scales fp16 [G, N]. Repacked on load into the
internal layout (packed along K) by `awq_to_int4`, whose `repack_awq_qweight` is an
in-register-width int32 repack that keeps loading close to raw read speed (the generic packing
helpers go through int64 per value); `int4_to_awq` is its inverse, for the checkpoint writer.
`zero_point: false` (symmetric; GPTQModel writes it) stores every qzero as 8 (signed codes shifted
to unsigned), so the same dequantization holds; a checkpoint without qzeros uses zero 8. Zeros that
are all 8 run the kernel's symmetric branch.
"""
from __future__ import annotations

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_split, read_shard
from tritonq.quant.packing import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_int32, unpack_int32
from tritonq.quant.weights import Int4Weight

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128, 256)


class AWQLoader(WeightsLoader):
    marker = "qweight"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
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
        self.zero_point = bool(q.get("zero_point", True))
        super().__init__(weights, config, dtype, device, q.get("modules_to_not_convert"), rank=rank, world=world)

    def quantized_shape(self, prefix: str):
        name = f"{prefix}.qweight"
        stored = self.weights.get_shape(name)
        return (stored[1] * 8, stored[0]), name, stored

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Int4Weight:
        """Column shards cut N in whole packs of 8; row shards cut K in whole groups (per-channel
        scales, one group spanning K, stay whole: they belong to the output channels)."""
        K, n_packed = self.weights.get_shape(f"{prefix}.qweight")
        N = n_packed * 8
        group_size = K if self.group_size == -1 else self.group_size
        if K % group_size:
            raise ValueError(f"{prefix}.qweight: K={K} is not a multiple of group_size={group_size}")
        G = K // group_size
        if shard is not None and shard.parallel == "column":
            check_split(prefix, shard, N, 8, "AWQ packs 8 output columns per int32 along N")
        elif shard is not None and G > 1:
            check_split(prefix, shard, K, group_size, f"a quantization group of {group_size} input rows")
        elif shard is not None:
            check_split(prefix, shard, K, 8, "the int4 layout packs 8 input rows per int32")
            group_size = K // shard.count
        group_row = 0 if G > 1 else None  # a row shard cuts the groups; per-channel scales stay whole
        qweight = read_shard(self.weights, f"{prefix}.qweight", shard, column=1, row=0, dtype=torch.int32)
        scales = read_shard(self.weights, f"{prefix}.scales", shard, column=1, row=group_row, dtype=torch.float16, shape=(G, N))
        qzeros = None
        if self.zero_point or self.weights.has_tensor(f"{prefix}.qzeros"):
            qzeros = read_shard(self.weights, f"{prefix}.qzeros", shard, column=1, row=group_row, dtype=torch.int32,
                               shape=(G, n_packed)).to(self.device)
        return awq_to_int4(qweight.to(self.device), qzeros, scales.to(device=self.device, dtype=self.dtype),
                           group_size)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                group_size: int) -> Int4Weight:
    """AWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8] or None, scales [G, N]) -> Int4Weight.

    group_size -1 means one group over K. Zeros come back in the scales' dtype, or None (the
    kernels' symmetric branch) when there are no qzeros or every zero is 8.
    """
    zeros = None
    if qzeros is not None:
        zeros = unpack_awq_zeros(qzeros)
        # a dry run's meta zeros have no values: kept, as zeros that are not all 8 would be
        zeros = None if not zeros.is_meta and bool((zeros == 8).all()) else zeros.to(scales.dtype)
    return Int4Weight(repack_awq_qweight(qweight), scales, zeros, None,
                      qweight.shape[0] if group_size == -1 else group_size, 4)


def int4_to_awq(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Weight (bits 4, no g_idx) -> AWQ (qweight [K, N/8], qzeros [G, N/8], scales [G, N]); the
    checkpoint writer's inverse of `awq_to_int4`."""
    if w.bits != 4 or w.g_idx is not None:
        raise ValueError(f"AWQ stores 4-bit weights without act-order; got bits={w.bits}, g_idx={w.g_idx is not None}")
    q = unpack_int32(w.qweight, 4, dim=0)  # [K, N]
    zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 8)
    return (pack_int32(q, 4, dim=1, order=AWQ_ORDER),
            pack_int32(zeros.round().to(torch.int32), 4, dim=1, order=AWQ_ORDER), w.scales)


def repack_awq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [K, N/8] (packed along N, AWQ order) -> internal [K/8, N] (packed along K, sequential).

    Each 8 rows x 1 pack block is an 8x8 nibble matrix (row k, field f); the repack is its transpose,
    done in int32 with three rounds of masked swaps (4x4, 2x2, 1x1 nibble blocks), then the AWQ
    field order is undone by picking the output words in column order.
    """
    K, n_packed = qweight.shape
    if K % 8:
        raise ValueError(f"AWQ qweight has K={K} rows, expected a multiple of 8")
    words = qweight.reshape(K // 8, 2, 2, 2, n_packed).clone()  # row k = 4a + 2b + c within the block
    for dim, shift, mask in ((1, 16, 0x0000FFFF), (2, 8, 0x00FF00FF), (3, 4, 0x0F0F0F0F)):
        low, high = words.select(dim, 0), words.select(dim, 1)  # rows paired across a, then b, then c
        swap = low >> shift  # swap the high part of `low` with the low part of `high`; in place: no page faults
        swap ^= high
        swap &= mask
        high ^= swap
        swap <<= shift
        low ^= swap
    words = words.reshape(K // 8, 8, n_packed)
    return torch.stack([words[:, field] for field in AWQ_REVERSE_ORDER], dim=-1).reshape(K // 8, n_packed * 8)


def unpack_awq_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """AWQ qzeros [G, N/8] -> int32 [G, N]."""
    fields = [(qzeros >> (4 * field)) & 0xF for field in AWQ_REVERSE_ORDER]
    return torch.stack(fields, dim=-1).reshape(qzeros.shape[0], -1)
