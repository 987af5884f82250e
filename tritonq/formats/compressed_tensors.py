"""compressed-tensors checkpoints (llm-compressor; quant_method "compressed-tensors") -> typed weights.

quantization_config: config_groups {name: {targets: ["Linear" | "re:<regex>" | module name],
weights: {num_bits, type: int|float, symmetric, strategy: tensor|channel|group|block, group_size,
block_structure}, input_activations: {dynamic, ...} | null, format?}}, format, ignore.
  pack-quantized (int 4/8): P.weight_packed int32 [N, K*b/32] packed along K, sequential fields
      holding q + 2^(b-1) (signed codes stored unsigned); P.weight_scale [N, G]; asymmetric adds
      P.weight_zero_point int32 [N*b/32, G] packed along N the same way; P.weight_shape [2];
      optional P.weight_g_idx [K] (actorder).
  float-quantized (fp8): P.weight float8_e4m3fn [N, K]; P.weight_scale fp32 [1] / [] (tensor),
      [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block); static activations add P.input_scale.
ignore: exact module names or "re:<regex>".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tritonq.formats.base import FP8Weight, Int4Weight, Shard, Weight, Weights, WeightsLoader
from tritonq.formats.packing import pack_int32, unpack_int32

SUPPORTED_FORMATS = ("pack-quantized", "float-quantized")


@dataclass(frozen=True)
class Scheme:
    targets: tuple[str, ...]
    format: str
    bits: int
    strategy: str
    symmetric: bool
    group_size: int | None
    block_size: tuple[int, int] | None
    static_input: bool


def _matches(pattern: str, prefix: str) -> bool:
    return re.match(pattern[3:], prefix) is not None if pattern.startswith("re:") else pattern == prefix


class CompressedTensorsLoader(WeightsLoader):
    marker = "weight_scale"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        if world > 1:
            raise ValueError("tensor parallelism is not supported for compressed-tensors checkpoints yet; "
                             "load this model on one device (tensor_parallel=1)")
        q = config["quantization_config"]
        self.schemes = [self._scheme(name, group, q.get("format")) for name, group in q.get("config_groups", {}).items()]
        super().__init__(weights, config, dtype, device, q.get("ignore"))

    @staticmethod
    def _scheme(name: str, group: dict, default_format: str | None) -> Scheme:
        fmt, w = group.get("format") or default_format, group.get("weights") or {}
        where = f"compressed-tensors config_groups[{name!r}]"
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {SUPPORTED_FORMATS})")
        kind = (fmt, w.get("type"), w.get("num_bits"))
        if kind not in (("pack-quantized", "int", 4), ("pack-quantized", "int", 8), ("float-quantized", "float", 8)):
            raise ValueError(f"{where}: (format, weights.type, weights.num_bits)={kind} is not supported (supported: "
                             "pack-quantized int 4/8, float-quantized float 8)")
        strategy = w.get("strategy")
        allowed = ("channel", "group") if fmt == "pack-quantized" else ("tensor", "channel", "block")
        if strategy not in allowed:
            raise ValueError(f"{where}: weights.strategy={strategy!r} is not supported for {fmt} (supported: {allowed})")
        inputs = group.get("input_activations")
        return Scheme(tuple(group.get("targets", ())), fmt, w["num_bits"], strategy, bool(w.get("symmetric", True)),
                      w.get("group_size"), tuple(w["block_structure"]) if strategy == "block" else None,
                      inputs is not None and not inputs.get("dynamic", False))

    def is_ignored(self, prefix: str) -> bool:
        return any(_matches(entry, prefix) for entry in self.ignore)

    def scheme(self, prefix: str) -> Scheme | None:
        # "Linear" targets every linear layer; the model only asks get_linear for linear layers.
        return next((s for s in self.schemes if any(t == "Linear" or _matches(t, prefix) for t in s.targets)), None)

    def is_quantized(self, prefix: str) -> bool:
        return super().is_quantized(prefix) and self.scheme(prefix) is not None

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        s = self.scheme(prefix)
        return self._int(prefix, s) if s.format == "pack-quantized" else self._fp8(prefix, s)

    def _int(self, prefix: str, s: Scheme) -> Int4Weight:
        get, per = self.weights.get_tensor, 32 // s.bits
        packed = get(f"{prefix}.weight_packed", dtype=torch.int32)
        N, K = (int(v) for v in get(f"{prefix}.weight_shape"))
        if K % per or N % per or tuple(packed.shape) != (N, K // per):
            raise ValueError(f"{prefix}.weight_packed: shape {list(packed.shape)} for weight_shape [{N}, {K}]; "
                             f"supported: N and K multiples of {per}, packed shape [N, K/{per}]")
        group_size = K if s.strategy == "channel" else s.group_size
        G = K // group_size
        scales = get(f"{prefix}.weight_scale", shape=(N, G)).T.to(device=self.device, dtype=self.dtype)
        codes = unpack_int32(packed.to(self.device), s.bits, dim=1)  # [N, K] unsigned = signed + 2^(b-1)
        zeros = None
        if not s.symmetric:
            zero_point = get(f"{prefix}.weight_zero_point", dtype=torch.int32, shape=(N // per, G))
            zeros = unpack_int32(zero_point.to(self.device), s.bits, dim=0).T.to(self.dtype)
        g_idx = None
        if self.weights.has_tensor(f"{prefix}.weight_g_idx"):
            g_idx = get(f"{prefix}.weight_g_idx", shape=(K,)).to(device=self.device, dtype=torch.int32)
            if torch.equal(g_idx.cpu().long(), torch.arange(K) // group_size):
                g_idx = None
        return Int4Weight(pack_int32(codes.T, s.bits, dim=0), scales.contiguous(),
                          None if zeros is None else zeros.contiguous(), g_idx, group_size, s.bits)

    def _fp8(self, prefix: str, s: Scheme) -> FP8Weight:
        weight = self.weights.get_tensor(f"{prefix}.weight", dtype=torch.float8_e4m3fn)
        N, K = weight.shape
        expected = {"tensor": (1,), "channel": (N, 1)}.get(s.strategy) or \
            (math.ceil(N / s.block_size[0]), math.ceil(K / s.block_size[1]))
        scale = self.weights.get_tensor(f"{prefix}.weight_scale")
        if scale.numel() == 1 and s.strategy == "tensor":
            scale = scale.reshape(())
        elif tuple(scale.shape) != expected:
            raise ValueError(f"{self.weights.folder}: tensor '{prefix}.weight_scale' has shape {list(scale.shape)}, "
                             f"expected {list(expected)} for strategy {s.strategy!r}")
        input_scale = None
        if s.static_input:
            input_scale = self.weights.get_tensor(f"{prefix}.input_scale").float().reshape(()).to(self.device)
        return FP8Weight(weight.to(self.device), scale.float().to(self.device), s.block_size, input_scale)
