"""compressed-tensors checkpoints (llm-compressor; quant_method "compressed-tensors") -> typed weights.

quantization_config: config_groups {name: {targets: ["Linear" | "Embedding" | "re:<regex>" | module name],
weights: {num_bits, type: int|float, symmetric, strategy: tensor|channel|group|block, group_size,
block_structure}, input_activations: {num_bits, type, strategy, dynamic, group_size} | null, format?}},
format, ignore.
  pack-quantized (int 4/8): P.weight_packed int32 [N, K*b/32] packed along K, sequential fields
      holding q + 2^(b-1) (signed codes stored unsigned); P.weight_scale [N, G]; asymmetric adds
      P.weight_zero_point int32 [N*b/32, G] packed along N the same way; P.weight_shape [2];
      optional P.weight_g_idx [K] (actorder).
  naive-quantized: P.weight in the narrowest torch dtype for the scheme, unpacked: float8_e4m3fn
      [N, K] for float 8 (then exactly float-quantized), int8 [N, K] signed codes for int 4/8 (with
      P.weight_zero_point int8 [N, G] when asymmetric); P.weight_scale as for the other formats.
  float-quantized (fp8): P.weight float8_e4m3fn [N, K]; P.weight_scale fp32 [1] / [] (tensor),
      [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block); static activations add P.input_scale.
  int-quantized (W8A8 int8, compressed-tensors' IntQuantizationCompressor: the naive layout with int8
      activations): P.weight int8 [N, K] signed codes, symmetric; P.weight_scale [1] (tensor) or [N, 1]
      (channel), any float dtype; static activations add P.input_scale [1], asymmetric ones
      P.input_zero_point [1] (int8, compressed-tensors' zp_dtype for int). -> W8A8Weight.
Activations: `input_activations: null` is weight-only (activations are never rounded, FP8Weight
.weight_only); fp8 dynamic per token (tensor/channel weights) or per 1 x bk group (block weights),
or static per tensor (P.input_scale), are what the fp8 kernel runs; int8 activations with int-quantized
weights: dynamic per token (symmetric), static per tensor (symmetric, or asymmetric with a zero point),
what the int8 kernel runs; anything else (per-tensor dynamic, a group that is not the weight block,
int8 activations with other formats) is refused naming the config field.
ignore: exact module names or "re:<regex>".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import (Shard, check_fp8_split, check_split, read_shard,
                                             row_split_cuts_groups)
from tritonq.quant.packing import pack_int32, unpack_int32
from tritonq.quant.weights import FP8Weight, Int4Weight, W8A8Weight, Weight

SUPPORTED_FORMATS = ("pack-quantized", "naive-quantized", "float-quantized", "int-quantized")
SUPPORTED_KINDS = {  # (format, weights.type, num_bits) -> weight strategies
    ("pack-quantized", "int", 4): ("channel", "group"), ("pack-quantized", "int", 8): ("channel", "group"),
    ("naive-quantized", "int", 4): ("channel", "group"), ("naive-quantized", "int", 8): ("channel", "group"),
    ("naive-quantized", "float", 8): ("tensor", "channel", "block"),
    ("float-quantized", "float", 8): ("tensor", "channel", "block"),
    ("int-quantized", "int", 8): ("tensor", "channel"),
}


@dataclass(frozen=True)
class Scheme:
    targets: tuple[str, ...]
    format: str
    type: str
    bits: int
    strategy: str
    symmetric: bool
    group_size: int | None
    block_size: tuple[int, int] | None
    static_input: bool
    weight_only: bool
    input_zero_point: bool = False  # static asymmetric int8 activations (P.input_zero_point)


def _matches(pattern: str, prefix: str) -> bool:
    return re.match(pattern[3:], prefix) is not None if pattern.startswith("re:") else pattern == prefix


def _matches_class(target: str, prefix: str) -> bool:
    """Module-class targets, by the HF names the models use (embeddings end in embed_tokens)."""
    embedding = prefix.endswith("embed_tokens")
    return (target == "Linear" and not embedding) or (target == "Embedding" and embedding)


def _check_int8_activations(where: str, a: dict) -> tuple[bool, bool]:
    """Refuse int8 input_activations the int8 kernel does not run; (static per-tensor scale, asymmetric)."""
    found = {k: a.get(k) for k in ("type", "num_bits", "strategy", "dynamic", "symmetric")}
    dynamic, strategy, symmetric = a.get("dynamic"), a.get("strategy"), a.get("symmetric", True)
    if dynamic is True and strategy == "token" and symmetric:
        return False, False
    if dynamic is False and strategy == "tensor":
        return True, not symmetric
    raise ValueError(f"{where}: input_activations {found} are not supported for int8 weights: supported are "
                     "dynamic per token (symmetric) and static per tensor (symmetric or asymmetric)")


def _check_activations(where: str, a: dict, weight_type: str, block: tuple[int, int] | None) -> bool:
    """Refuse input_activations the fp8 kernel does not run exactly; True for a static per-tensor scale."""
    found = {k: a.get(k) for k in ("type", "num_bits", "strategy", "dynamic", "group_size")}
    if weight_type != "float" or (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise ValueError(f"{where}: input_activations {found} are not supported: only fp8 activations with fp8 "
                         "weights, int8 activations with format int-quantized int8 weights (or input_activations "
                         "null: weight-only) run here")
    dynamic, strategy = a.get("dynamic"), a.get("strategy")
    if dynamic is False and strategy == "tensor":
        return True
    if dynamic is True and block is None and strategy == "token":
        return False
    if dynamic is True and block is not None and strategy == "group" and a.get("group_size") == block[1]:
        return False
    raise ValueError(f"{where}: input_activations {found} are not supported with weights.strategy "
                     f"{'block ' + str(list(block)) if block else 'tensor/channel'}: supported are static per tensor, "
                     "dynamic per token (tensor/channel weights) and dynamic per group of the weight block's "
                     "columns (block weights)")


class CompressedTensorsLoader(WeightsLoader):
    marker = "weight_scale"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        q = config["quantization_config"]
        self.schemes = [self._scheme(name, group, q.get("format")) for name, group in q.get("config_groups", {}).items()]
        super().__init__(weights, config, dtype, device, q.get("ignore"), rank=rank, world=world)

    @staticmethod
    def _scheme(name: str, group: dict, default_format: str | None) -> Scheme:
        fmt, w = group.get("format") or default_format, group.get("weights") or {}
        where = f"compressed-tensors config_groups[{name!r}]"
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {SUPPORTED_FORMATS})")
        kind = (fmt, w.get("type"), w.get("num_bits"))
        if kind not in SUPPORTED_KINDS:
            raise ValueError(f"{where}: (format, weights.type, weights.num_bits)={kind} is not supported (supported: "
                             "pack-quantized / naive-quantized int 4/8, float-quantized / naive-quantized float 8)")
        strategy, allowed = w.get("strategy"), SUPPORTED_KINDS[kind]
        if strategy not in allowed:
            raise ValueError(f"{where}: weights.strategy={strategy!r} is not supported for {fmt} {w.get('type')} "
                             f"(supported: {allowed})")
        if strategy == "group" and not w.get("group_size"):
            raise ValueError(f"{where}: weights.strategy 'group' needs weights.group_size, found {w.get('group_size')!r}")
        block = tuple(w.get("block_structure") or ()) if strategy == "block" else None
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"{where}: weights.block_structure={w.get('block_structure')!r}, expected [rows, cols]")
        if w.get("type") == "float" and not w.get("symmetric", True):
            raise ValueError(f"{where}: weights.symmetric=false is not supported for fp8 weights (no zero point)")
        inputs = group.get("input_activations")
        static = asymmetric_input = False
        if fmt == "int-quantized":  # W8A8 int8: int8 activations required, symmetric weights
            if inputs is None or (inputs.get("type"), inputs.get("num_bits")) != ("int", 8):
                raise ValueError(f"{where}: format int-quantized needs int8 input_activations (W8A8), found "
                                 f"{inputs!r}; weight-only int8 checkpoints use pack-quantized / naive-quantized")
            if not w.get("symmetric", True):
                raise ValueError(f"{where}: weights.symmetric=false is not supported for int-quantized (W8A8) "
                                 "weights; the int8 kernel takes symmetric weights (as vLLM)")
            static, asymmetric_input = _check_int8_activations(where, inputs)
        elif inputs is not None:
            static = _check_activations(where, inputs, w.get("type"), block)
        return Scheme(tuple(group.get("targets", ())), fmt, w["type"], w["num_bits"], strategy,
                      bool(w.get("symmetric", True)), w.get("group_size"), block, static, inputs is None,
                      asymmetric_input)

    def is_ignored(self, prefix: str) -> bool:
        return any(_matches(entry, prefix) for entry in self.ignore)

    def scheme(self, prefix: str) -> Scheme | None:
        """The scheme of module `prefix`: a name / regex target wins over a class target, as in compressed-tensors."""
        by_name = [s for s in self.schemes if any(_matches(t, prefix) for t in s.targets)]
        by_class = [s for s in self.schemes if any(_matches_class(t, prefix) for t in s.targets)]
        return (by_name + by_class or [None])[0]

    def quantized_shape(self, prefix: str):
        s = self.scheme(prefix)
        if s.format == "pack-quantized":
            name = f"{prefix}.weight_packed"
            stored = self.weights.get_shape(name)
            return (stored[0], stored[1] * 32 // s.bits), name, stored
        return super().quantized_shape(prefix)

    def is_quantized(self, prefix: str) -> bool:
        return super().is_quantized(prefix) and self.scheme(prefix) is not None

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        """Shards: column ones cut N (weight rows, scale and zero-point rows; packed zero points in whole
        packs), row ones cut K (weight columns in whole packs; scales and zero points by group, whole for
        per-channel scales or act-order, whose sliced g_idx still indexes them); fp8 block scales by block."""
        s = self.scheme(prefix)
        if s.format == "int-quantized":
            return self._w8a8(prefix, s)
        if s.type == "float":
            return self._fp8(prefix, s, shard)
        return self._int(prefix, s, shard) if s.format == "pack-quantized" else self._naive_int(prefix, s, shard)

    def _int_split(self, prefix: str, s: Scheme, shard: Shard | None, N: int, K: int, group_size: int,
                   ) -> tuple[int | None, int, torch.Tensor | None]:
        """How a shard cuts an int layer: (the dim of scales / zero points [N, G] a row shard cuts: 1 for
        contiguous groups, None to keep them whole; this rank's group_size; this rank's g_idx or None)."""
        per = 32 // s.bits
        G = K // group_size
        column, row = shard is not None and shard.parallel == "column", shard is not None and shard.parallel == "row"
        if column:  # packed zero points hold `per` output rows per int32 (pack-quantized, asymmetric)
            multiple = per if s.format == "pack-quantized" and not s.symmetric else 1
            check_split(prefix, shard, N, multiple, f"compressed-tensors weight_zero_point packs {per} output "
                             "rows per int32 along N" if multiple > 1 else "whole rows")
        if row:
            check_split(prefix, shard, K, per, f"{per} {s.bits}-bit input columns per int32 along K")
        g_idx = None
        if self.weights.has_tensor(f"{prefix}.weight_g_idx"):
            g_idx = read_shard(self.weights, f"{prefix}.weight_g_idx", shard, column=None, row=0, shape=(K,))
            g_idx = g_idx.to(device=self.device, dtype=torch.int32)
        if not row:
            return 1, group_size, self._act_order(g_idx, K, group_size)
        if G == 1:  # per channel: one scale row for any K
            return None, K // shard.count, None
        if row_split_cuts_groups(shard, K, group_size, g_idx):
            check_split(prefix, shard, K, group_size, f"a quantization group of {group_size} input rows")
            return 1, group_size, None
        return None, group_size, g_idx  # act-order: every group may hold rows of this rank

    @staticmethod
    def _act_order(g_idx: torch.Tensor | None, K: int, group_size: int) -> torch.Tensor | None:
        """g_idx, or None when it is the trivial k // group_size (meta in a dry run: kept, no values)."""
        if g_idx is None or g_idx.is_meta:
            return g_idx
        return None if torch.equal(g_idx.cpu().long(), torch.arange(K) // group_size) else g_idx

    def _naive_int(self, prefix: str, s: Scheme, shard: Shard | None) -> Int4Weight:
        """naive-quantized int: int8 [N, K] signed codes (and int8 [N, G] zero points) -> Int4Weight."""
        N, K = self.weights.get_shape(f"{prefix}.weight")
        offset = 2 ** (s.bits - 1)  # signed codes -> the unsigned codes Int4Weight holds
        group_size = K if s.strategy == "channel" else s.group_size
        if K % group_size or K % (32 // s.bits):
            raise ValueError(f"{prefix}.weight: K={K} is not a multiple of group_size={group_size} and of {32 // s.bits}")
        G = K // group_size
        group_dim, group_size, g_idx = self._int_split(prefix, s, shard, N, K, group_size)
        weight = read_shard(self.weights, f"{prefix}.weight", shard, column=0, row=1, dtype=torch.int8)
        scales = read_shard(self.weights, f"{prefix}.weight_scale", shard, column=0, row=group_dim, shape=(N, G)).T
        zeros = None
        if not s.symmetric:
            zp = read_shard(self.weights, f"{prefix}.weight_zero_point", shard, column=0, row=group_dim, dtype=torch.int8,
                           shape=(N, G))
            zeros = (zp.T.to(torch.int32) + offset).to(device=self.device, dtype=self.dtype).contiguous()
        codes = weight.to(self.device).to(torch.int32) + offset
        return Int4Weight(pack_int32(codes.T, s.bits, dim=0), scales.to(device=self.device, dtype=self.dtype).contiguous(),
                          zeros, g_idx, group_size, s.bits)

    def _int(self, prefix: str, s: Scheme, shard: Shard | None) -> Int4Weight:
        get, per = self.weights.get_tensor, 32 // s.bits
        packed_shape = self.weights.get_shape(f"{prefix}.weight_packed")
        stored = get(f"{prefix}.weight_shape")  # meta in a dry run: its values are known only once read
        N, K = (packed_shape[0], packed_shape[1] * per) if stored.is_meta else (int(v) for v in stored)
        if K % per or N % per or tuple(packed_shape) != (N, K // per):
            raise ValueError(f"{prefix}.weight_packed: shape {list(packed_shape)} for weight_shape [{N}, {K}]; "
                             f"supported: N and K multiples of {per}, packed shape [N, K/{per}]")
        group_size = K if s.strategy == "channel" else s.group_size
        G = K // group_size
        group_dim, group_size, g_idx = self._int_split(prefix, s, shard, N, K, group_size)
        packed = read_shard(self.weights, f"{prefix}.weight_packed", shard, column=0, row=1, dtype=torch.int32)
        scales = read_shard(self.weights, f"{prefix}.weight_scale", shard, column=0, row=group_dim, shape=(N, G))
        scales = scales.T.to(device=self.device, dtype=self.dtype)
        codes = unpack_int32(packed.to(self.device), s.bits, dim=1)  # [N', K'] unsigned = signed + 2^(b-1)
        zeros = None
        if not s.symmetric:
            zero_point = read_shard(self.weights, f"{prefix}.weight_zero_point", shard, column=0, row=group_dim, dtype=torch.int32,
                                   shape=(N // per, G))
            zeros = unpack_int32(zero_point.to(self.device), s.bits, dim=0).T.to(self.dtype)
        return Int4Weight(pack_int32(codes.T, s.bits, dim=0), scales.contiguous(),
                          None if zeros is None else zeros.contiguous(), g_idx, group_size, s.bits)

    def _fp8(self, prefix: str, s: Scheme, shard: Shard | None) -> FP8Weight:
        N, K = self.weights.get_shape(f"{prefix}.weight")
        check_fp8_split(prefix, shard, N, K, s.block_size, "weight_scale")
        weight = read_shard(self.weights, f"{prefix}.weight", shard, column=0, row=1, dtype=torch.float8_e4m3fn)
        expected = {"tensor": (1,), "channel": (N, 1)}.get(s.strategy) or \
            (math.ceil(N / s.block_size[0]), math.ceil(K / s.block_size[1]))
        stored = self.weights.get_shape(f"{prefix}.weight_scale")
        if math.prod(stored) == 1 and s.strategy == "tensor":
            scale = self.weights.get_tensor(f"{prefix}.weight_scale").reshape(())
        elif tuple(stored) != expected:
            raise ValueError(f"{self.weights.folder}: tensor '{prefix}.weight_scale' has shape {list(stored)}, "
                             f"expected {list(expected)} for strategy {s.strategy!r}")
        else:  # per channel: rows with N (whole for a row shard); block: by block
            scale = read_shard(self.weights, f"{prefix}.weight_scale", shard, column=0, row=1 if s.strategy == "block" else None)
        input_scale = None
        if s.static_input:
            input_scale = self.input_scale(f"{prefix}.input_scale")
        return FP8Weight(weight.to(self.device), scale.float().to(self.device), s.block_size, input_scale,
                         weight_only=s.weight_only)

    def _w8a8(self, prefix: str, s: Scheme) -> W8A8Weight:
        """int-quantized: int8 [N, K] codes, weight_scale [1] / [N, 1], input_scale / input_zero_point [1]."""
        weight = self.weights.get_tensor(f"{prefix}.weight", dtype=torch.int8)
        N, K = weight.shape
        scale = self.weights.get_tensor(f"{prefix}.weight_scale")
        if s.strategy == "tensor" and scale.numel() == 1:
            scale = scale.reshape(())
        elif s.strategy != "channel" or tuple(scale.shape) != (N, 1):
            raise ValueError(f"{self.weights.folder}: tensor '{prefix}.weight_scale' has shape {list(scale.shape)}, "
                             f"expected {[1] if s.strategy == 'tensor' else [N, 1]} for strategy {s.strategy!r}")
        input_scale = zero_point = None
        if s.static_input:
            input_scale = self.input_scale(f"{prefix}.input_scale")
        if s.input_zero_point:
            zero_point = self._one_value(f"{prefix}.input_zero_point")
            if zero_point.is_floating_point() and not zero_point.is_meta and zero_point != zero_point.round():
                raise ValueError(f"{self.weights.folder}: tensor '{prefix}.input_zero_point' holds "
                                 f"{float(zero_point)}; expected an integer zero point")
            zero_point = zero_point.reshape(()).to(device=self.device, dtype=torch.int32)
        return W8A8Weight(weight.to(self.device), scale.float().to(self.device), input_scale, zero_point)

    def _one_value(self, name: str) -> torch.Tensor:
        """Tensor `name` holding one value ([1] as compressed-tensors writes it, or []), as a [] tensor."""
        t = self.weights.get_tensor(name)
        if t.numel() != 1:
            raise ValueError(f"{self.weights.folder}: tensor '{name}' has shape {list(t.shape)}, expected [1] "
                             "(one static per-tensor value)")
        return t.reshape(())
