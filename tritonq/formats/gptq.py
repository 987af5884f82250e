"""GPTQ checkpoints (AutoGPTQ / GPTQModel) -> Int4Weight (bits 4 or 8).

config.json: quantization_config {quant_method: gptq, bits, group_size, desc_act, sym,
checkpoint_format: gptq (v1: zeros stored minus one) | gptq_v2}. A missing `sym` means
asymmetric (older tools wrote asymmetric weights without the key). Per linear P:
P.qweight int32 [K*b/32, N] packed along K (already the internal layout), P.qzeros int32
[G, N*b/32] packed along N, P.scales fp16 [G, N], P.g_idx int32 [K] (kept only for act-order).
GPTQModel `dynamic` overrides: a key "-:<regex>" leaves matching modules dense; "+:<regex>"
(or a bare regex) overrides bits / group_size / sym for matching modules (GPTQModel's quantized
`lm_head` is one: `lm_head.qweight/qzeros/scales` with its own bits and group size).

v1 zero points. A v1 field stores zero - 1, so a true zero of 0 has to wrap, and packers wrapped it
two ways. GPTQModel (meta.quantizer "gptqmodel:<version>") subtracts 0x11111111 (8-bit: 0x01010101)
from the whole packed int32 word and its reader adds the word back: a zero of 0 borrows one from the
field above it, and the word addition is the exact inverse. Older packers wrapped each field on its
own (no borrow) and their readers computed (field + 1) & (2^b - 1): an all-ones field is a zero of 0
(a zero of 2^b, what a plain +1 gives, can never be meant). The two readings differ only in words
where a field below the top one is all ones. Rule: GPTQModel checkpoints use the word rule; others
(AutoGPTQ, unknown, our writer, which never stores a zero of 0) use the field rule, and the layers
where the readings differ are named in one warning, so a mislabelled GPTQModel file is not silent.
Symmetric checkpoints still carry qzeros: they are read, and the symmetric kernel branch is used
only when every zero is 2^(b-1) (a checkpoint that claims sym but is not still loads exactly).
"""
from __future__ import annotations

import re
import warnings

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.reader import listing
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_split, read_shard, row_split_cuts_groups
from tritonq.quant.packing import pack_int32, unpack_int32
from tritonq.quant.weights import Int4Weight

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128, 256)
SUPPORTED_FORMATS = ("gptq", "gptq_v2")


class GPTQLoader(WeightsLoader):
    marker = "qweight"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        q = config["quantization_config"]
        self.format = q.get("checkpoint_format", "gptq")
        if self.format not in SUPPORTED_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format={self.format!r} is not supported (supported: {SUPPORTED_FORMATS})")
        self.defaults = {"bits": q.get("bits"), "group_size": q.get("group_size"), "sym": bool(q.get("sym", False))}
        self.dynamic = q.get("dynamic") or {}
        quantizers = (q.get("meta") or {}).get("quantizer") or []
        quantizers = [quantizers] if isinstance(quantizers, str) else quantizers
        self.v1_borrow = any(str(name).lower().startswith("gptqmodel") for name in quantizers)
        self.v1_ambiguous: list[str] = []  # layers whose v1 zeros read differently under the two rules
        self._params(self.defaults, "quantization_config")
        for key, override in self.dynamic.items():
            if not key.startswith("-:"):
                self._params({**self.defaults, **override}, f"dynamic[{key!r}]")
        super().__init__(weights, config, dtype, device, q.get("modules_to_not_convert"), rank=rank, world=world)

    @staticmethod
    def _params(p: dict, where: str) -> dict:
        if p["bits"] not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ {where}: bits={p['bits']} is not supported (supported: {SUPPORTED_BITS})")
        if p["group_size"] not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"GPTQ {where}: group_size={p['group_size']} is not supported "
                             f"(supported: {SUPPORTED_GROUP_SIZES})")
        return p

    def _module_params(self, prefix: str) -> dict | None:
        """Quantization args for one module, or None if a `dynamic` rule leaves it dense."""
        for key, override in self.dynamic.items():
            negative = key.startswith("-:")
            pattern = key[2:] if key[:2] in ("-:", "+:") else key
            if re.match(pattern, prefix):
                return None if negative else {**self.defaults, **override}
        return self.defaults

    def is_quantized(self, prefix: str) -> bool:
        return super().is_quantized(prefix) and self._module_params(prefix) is not None

    def quantized_shape(self, prefix: str):
        name = f"{prefix}.qweight"
        stored = self.weights.get_shape(name)
        per = 32 // self._module_params(prefix)["bits"]
        return (stored[1], stored[0] * per), name, stored

    def finish(self) -> None:
        if self.v1_ambiguous:
            warnings.warn(
                f"{self.weights.folder}: GPTQ v1 zero points with an all-ones field below the top of their int32 "
                f"word in {listing(self.v1_ambiguous)}: read as a zero of 0 without a borrow from the next field "
                "(AutoGPTQ's rule). If GPTQModel wrote this checkpoint (it borrows), add \"meta\": {\"quantizer\": "
                "[\"gptqmodel:<version>\"]} to its quantization_config", stacklevel=3)
        super().finish()

    def v1_zeros(self, prefix: str, qzeros: torch.Tensor, bits: int) -> torch.Tensor:
        """v1 qzeros (zero - 1 per field) -> v2 qzeros (the zeros themselves), by the rule in the module docstring."""
        mask, per = (1 << bits) - 1, 32 // bits
        if self.v1_borrow:
            ones = sum(1 << (bits * i) for i in range(per))  # 0x11111111 / 0x01010101
            word = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF
            return (word - (word >= 2**31).to(torch.int64) * 2**32).to(torch.int32)
        fields = unpack_int32(qzeros, bits, dim=1)
        if bool((fields.unflatten(1, (-1, per))[..., :-1] == mask).any()):
            self.v1_ambiguous.append(prefix)
        return pack_int32((fields + 1) & mask, bits, dim=1)

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Int4Weight:
        """Column shards cut N in whole qzeros packs; row shards cut K in whole qweight packs and
        g_idx with its rows. Row shards of contiguous groups cut the groups (scales/zeros rows) too;
        with act-order any row may belong to any group, so scales/zeros stay whole and the sliced
        g_idx still indexes them; per-channel scales (one group) stay whole."""
        p = self._module_params(prefix)
        bits, per = p["bits"], 32 // p["bits"]
        K_packed, N = self.weights.get_shape(f"{prefix}.qweight")
        K = K_packed * per
        group_size = K if p["group_size"] == -1 else p["group_size"]
        if K % group_size or N % per:
            raise ValueError(f"{prefix}.qweight: K={K}, N={N} do not fit group_size={group_size}, bits={bits}")
        G = K // group_size
        column, row = shard is not None and shard.parallel == "column", shard is not None and shard.parallel == "row"
        if column:
            check_split(prefix, shard, N, per, f"GPTQ qzeros pack {per} output columns per int32 along N")
        if row:
            check_split(prefix, shard, K, per, f"GPTQ qweight packs {per} input rows per int32 along K")
        g_idx = None
        if self.weights.has_tensor(f"{prefix}.g_idx"):
            g_idx = read_shard(self.weights, f"{prefix}.g_idx", shard, column=None, row=0, dtype=torch.int32, shape=(K,))
            if not g_idx.is_meta and (g_idx.min() < 0 or g_idx.max() >= G):  # meta: a dry run, no values
                raise ValueError(f"{prefix}.g_idx: groups must lie in [0, {G}), found [{g_idx.min()}, {g_idx.max()}]")
        group_row = None  # the dim of scales/qzeros a row shard cuts: groups, only when they are contiguous
        if row and G == 1:
            group_size, g_idx = K // shard.count, None
        elif row:
            if row_split_cuts_groups(shard, K, group_size, g_idx):  # no act-order: this rank's groups in order
                check_split(prefix, shard, K, group_size, f"a quantization group of {group_size} input rows")
                group_row, g_idx = 0, None
        scales = read_shard(self.weights, f"{prefix}.scales", shard, column=1, row=group_row, dtype=torch.float16, shape=(G, N))
        qzeros, sym = None, p["sym"]
        if self.weights.has_tensor(f"{prefix}.qzeros") or not sym:
            qzeros = read_shard(self.weights, f"{prefix}.qzeros", shard, column=1, row=group_row, dtype=torch.int32,
                               shape=(G, N // per))
            if self.format == "gptq" and not qzeros.is_meta:  # meta: a dry run, no values to decode
                qzeros = self.v1_zeros(prefix, qzeros, bits)
            # The zeros as stored are what the packer's dequantization uses, whatever `sym` claims.
            sym = not qzeros.is_meta and bool((unpack_int32(qzeros, bits, dim=1) == 2 ** (bits - 1)).all())
        qweight = read_shard(self.weights, f"{prefix}.qweight", shard, column=1, row=0, dtype=torch.int32)
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        w = gptq_to_int4(to(qweight), None if sym else to(qzeros), to(scales), to(g_idx), bits, group_size, sym,
                         zero_offset=0)
        return Int4Weight(w.qweight, w.scales.to(self.dtype), None if w.zeros is None else w.zeros.to(self.dtype),
                          w.g_idx, w.group_size, bits)


def _trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    return torch.equal(g_idx.long().cpu(), torch.arange(g_idx.numel()) // group_size)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group_size: int, sym: bool, zero_offset: int,
                 bias: torch.Tensor | None = None) -> Int4Weight:
    """GPTQ layout (qweight [K*b/32, N] sequential along K, qzeros [G, N*b/32]) -> Int4Weight.

    zero_offset: added to every unpacked zero field as is (no wrap, no borrow); GPTQLoader decodes v1
    words itself (see formats/gptq.py) and passes 0.
    sym: zeros are 2^(bits-1) everywhere and are not kept (the kernel's symmetric branch).
    A g_idx equal to k // group_size over scales of K / group_size rows carries no information and is
    dropped (a row shard of an act-order layer keeps all scales rows, and its g_idx, whatever it holds).
    """
    K = qweight.shape[0] * 32 // bits
    group_size = K if group_size == -1 else group_size
    zeros = None
    if not sym:
        zeros = (unpack_int32(qzeros, bits, dim=1) + zero_offset).to(scales.dtype)
    if g_idx is not None and g_idx.is_meta:  # a dry run: only the shape can be checked
        if tuple(g_idx.shape) != (K,):
            raise ValueError(f"gptq_to_int4: g_idx of shape {tuple(g_idx.shape)}, expected [{K}]")
    elif g_idx is not None and scales.shape[0] == K // group_size and _trivial_g_idx(g_idx, group_size):
        g_idx = None
    if g_idx is not None and not g_idx.is_meta and (tuple(g_idx.shape) != (K,)
                                                    or int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"gptq_to_int4: g_idx of shape {tuple(g_idx.shape)} with values in [{int(g_idx.min())}, "
                         f"{int(g_idx.max())}], expected [{K}] in [0, {scales.shape[0]}) (one group per scales row); "
                         "the checkpoint's g_idx does not match its scales")
    return Int4Weight(qweight=qweight.contiguous(), scales=scales, zeros=zeros,
                      g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
                      group_size=group_size, bits=bits, bias=bias)
