"""bitsandbytes checkpoints (transformers `BitsAndBytesConfig` + save_pretrained) -> Int4Weight.

config.json: quantization_config {quant_method: bitsandbytes, load_in_4bit | load_in_8bit,
bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype, bnb_4bit_quant_storage,
llm_int8_skip_modules}. Facts from bitsandbytes 0.50 (functional.QuantState, backends/default/ops.py)
and transformers 5.25 (integrations/bitsandbytes.py), checked by tests/formats/test_bitsandbytes.py
against checkpoints bitsandbytes writes at test time.

4-bit (nf4 / fp4), per linear P with W [N, K]:
  P.weight   uint8 [ceil(N*K/2), 1]: W flattened row-major, two codes a byte, the even element in the
             high nibble (bnb_4bit_quant_storage other than the default uint8 is refused);
  P.weight.quant_map  fp32 [16]: the code table (nf4's or fp4's values in [-1, 1]);
  P.weight.absmax     fp32 [ceil(N*K/blocksize)]: block b covers flat elements [b*bs, (b+1)*bs);
                      with double quant it is uint8 codes into P.weight.nested_quant_map fp32 [256]
                      times P.weight.nested_absmax fp32 [ceil(blocks/nested_blocksize)], plus
                      nested_offset: absmax = nested_quant_map[a] * nested_absmax[b // nested_blocksize] + offset;
  P.weight.quant_state.bitsandbytes__<nf4|fp4>  uint8: JSON {quant_type, blocksize, dtype, shape,
                      and nested_blocksize, nested_dtype, nested_offset with double quant}.
  W = quant_map[code] * absmax[block], in fp32, then cast. Blocksizes 32..4096 (powers of two).
  Repacked at load into Int4Weight's layout with `code` (the kernel's 16-entry table lookup): qweight
  [K/8, N] packed along K; scales = the absmax, dequantized once to fp32, per group of gcd(K, blocksize)
  input rows ([K/blocksize, N] when blocksize divides K; a block spanning rows repeats its absmax).
8-bit (LLM.int8()): P.weight int8 [N, K], P.SCB fp32 [N] row absmax, P.weight_format uint8 [] (0: "row",
  the only layout saved). W = weight * SCB / 127. Held as an 8-bit Int4Weight: q = weight + 128 (zero
  128, the symmetric branch), one group over K, scales = SCB / 127 in fp32. Runs weight-only:
  bitsandbytes' own forward also rounds the activations to int8 (outliers above llm_int8_threshold
  excepted), tritonq keeps them in the compute dtype.
Skipped modules (llm_int8_skip_modules, and modules_to_not_convert some exporters write) stay dense:
transformers keeps lm_head and tied embeddings dense by itself.
"""
from __future__ import annotations

import json
import math

import torch

from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, check_split, read_shard
from tritonq.quant.weights import Int4Weight

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' dequantize_4bit accepts these
INT8_ROW_FORMAT = 0  # bitsandbytes LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING["row"]
INV_127 = 7.874015718698502e-3  # the reciprocal bitsandbytes' int8_vectorwise_dequant multiplies by


class BitsAndBytesLoader(WeightsLoader):

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, *, rank: int = 0, world: int = 1):
        q = config["quantization_config"]
        four = bool(q.get("load_in_4bit", q.get("_load_in_4bit")))
        eight = bool(q.get("load_in_8bit", q.get("_load_in_8bit")))
        if four == eight:
            raise ValueError(f"bitsandbytes quantization_config has load_in_4bit={four}, load_in_8bit={eight}; "
                             "expected exactly one of them true (the config transformers' BitsAndBytesConfig saves)")
        if eight and q.get("llm_int8_has_fp16_weight"):
            raise ValueError("bitsandbytes llm_int8_has_fp16_weight=true keeps training weights in fp16, not int8; "
                             "save the model after quantizing (has_fp16_weight=false) or load the dense checkpoint")
        self.bits = 4 if four else 8
        ignore = (q.get("llm_int8_skip_modules") or []) + (q.get("modules_to_not_convert") or [])
        super().__init__(weights, config, dtype, device, ignore, rank=rank, world=world)
        self.marker = "weight.absmax" if four else "SCB"

    def quantized_shape(self, prefix: str):
        if self.bits == 8:
            return super().quantized_shape(prefix)
        state = self._quant_state(prefix)
        name = f"{prefix}.weight"
        return tuple(state["shape"]), name, self.weights.get_shape(name)

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Int4Weight:
        if self.bits == 8:
            return self._int8(prefix, shard)
        w = self._nf4(prefix)
        return w if shard is None else self._slice(prefix, w, shard)

    # ------------------------------------------------------------------ 4-bit

    def _quant_state(self, prefix: str) -> dict:
        """The JSON quant state of 4-bit linear `prefix`, checked."""
        names = [f"{prefix}.weight.quant_state.bitsandbytes__{t}" for t in QUANT_TYPES
                 if self.weights.has_tensor(f"{prefix}.weight.quant_state.bitsandbytes__{t}")]
        if len(names) != 1:
            raise ValueError(f"{self.weights.folder}: {prefix} has {len(names)} bitsandbytes quant_state tensors "
                             f"({names}), expected exactly one '{prefix}.weight.quant_state.bitsandbytes__nf4' or "
                             "'...__fp4'; the checkpoint was not saved by bitsandbytes >= 0.41.3 (re-save it)")
        raw = self.weights.get_metadata(names[0])
        try:
            state = json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.weights.folder}: tensor {names[0]!r} is not bitsandbytes' JSON quant state ({e}); "
                             "re-download the checkpoint") from e
        where = f"{self.weights.folder}: {names[0]}"
        if state.get("quant_type") not in QUANT_TYPES or names[0].rsplit("__", 1)[1] != state["quant_type"]:
            raise ValueError(f"{where}: quant_type={state.get('quant_type')!r}, expected the tensor name's one of "
                             f"{QUANT_TYPES}")
        if state.get("blocksize") not in BLOCKSIZES:
            raise ValueError(f"{where}: blocksize={state.get('blocksize')!r} is not one bitsandbytes writes "
                             f"(supported: {BLOCKSIZES})")
        shape = state.get("shape")
        if not isinstance(shape, list) or len(shape) != 2 or min(shape) <= 0:
            raise ValueError(f"{where}: shape={shape!r}, expected the [N, K] of a linear weight")
        if "nested_offset" in state and state.get("nested_dtype") != "float32":
            raise ValueError(f"{where}: nested_dtype={state.get('nested_dtype')!r}; bitsandbytes double-quantizes "
                             "the fp32 absmax, so float32 is the only one expected")
        return state

    def _absmax(self, prefix: str, state: dict, blocks: int) -> torch.Tensor:
        """fp32 [blocks] absmax of 4-bit linear `prefix`, its double quantization undone as bitsandbytes does."""
        name = f"{prefix}.weight.absmax"
        if "nested_offset" not in state:
            return self.weights.get_tensor(name, torch.float32, (blocks,))
        nested_blocksize = state.get("nested_blocksize")
        if not isinstance(nested_blocksize, int) or nested_blocksize <= 0:
            raise ValueError(f"{self.weights.folder}: {prefix} nested_blocksize={nested_blocksize!r}, expected a "
                             "positive int (bitsandbytes writes 256)")
        codes = self.weights.get_tensor(name, torch.uint8, (blocks,))
        nested_map = self.weights.get_tensor(f"{prefix}.weight.nested_quant_map", torch.float32, (256,))
        nested_absmax = self.weights.get_tensor(f"{prefix}.weight.nested_absmax", torch.float32,
                                                (-(-blocks // nested_blocksize),))
        if codes.is_meta:  # a dry run: shapes only
            return torch.empty(blocks, dtype=torch.float32, device="meta")
        scale = nested_absmax[torch.arange(blocks) // nested_blocksize]
        return nested_map[codes.long()] * scale + torch.tensor(float(state["nested_offset"]), dtype=torch.float32)

    def _nf4(self, prefix: str) -> Int4Weight:
        """4-bit linear `prefix` (whole) as an Int4Weight with its code table."""
        state = self._quant_state(prefix)
        (N, K), blocksize = state["shape"], state["blocksize"]
        where = f"{self.weights.folder}: {prefix}"
        if K % 8:
            raise ValueError(f"{where}: K={K} is not a multiple of 8, which the packed int4 layout needs")
        name = f"{prefix}.weight"
        if self.weights.get_dtype(name) != torch.uint8:
            raise ValueError(f"{where}.weight is stored as {self.weights.get_dtype(name)}, expected uint8: a "
                             "bnb_4bit_quant_storage other than uint8 (an FSDP training option) is not read; re-save "
                             "the model with the default quant_storage")
        packed = self.weights.get_tensor(name, torch.uint8, (-(-N * K // 2), 1))
        code = self.weights.get_tensor(f"{name}.quant_map", torch.float32, (16,))
        blocks = -(-N * K // blocksize)
        absmax = self._absmax(prefix, state, blocks)
        if packed.is_meta:
            qweight = torch.empty(K // 8, N, dtype=torch.int32, device="meta")
        else:
            qweight = pack_bnb_4bit(packed.reshape(-1), N, K)
        # Runs of gcd(K, blocksize) input rows of one output row lie in one block (block and row bounds are
        # both multiples of it): group g of row n starts at flat element n * K + g * group_size.
        group_size = math.gcd(K, blocksize)
        starts = (torch.arange(N, device=absmax.device) * K)[None, :] + (
            torch.arange(K // group_size, device=absmax.device) * group_size)[:, None]
        scales = absmax[starts // blocksize]  # [G, N]
        return Int4Weight(qweight.to(self.device), scales.contiguous().to(self.device), None, None, group_size, 4,
                          code=code.to(self.device))

    def _slice(self, prefix: str, w: Int4Weight, shard: Shard) -> Int4Weight:
        """This rank's part of a whole 4-bit weight: whole output columns, or whole blocks of input rows."""
        N, K = w.shape
        if shard.parallel == "column":
            check_split(prefix, shard, N, 1, "whole output rows")
            return Int4Weight(shard.take(w.qweight, 1), shard.take(w.scales, 1), None, None, w.group_size, 4,
                              code=w.code)
        if w.group_size == K:  # one scale per row: any cut into whole packs of 8 rows keeps it
            check_split(prefix, shard, K, 8, "the int4 layout packs 8 input rows per int32")
            return Int4Weight(shard.take(w.qweight, 0), w.scales, None, None, K // shard.count, 4, code=w.code)
        check_split(prefix, shard, K, w.group_size, f"a bitsandbytes block of {w.group_size} input rows")
        return Int4Weight(shard.take(w.qweight, 0), shard.take(w.scales, 0), None, None, w.group_size, 4, code=w.code)

    # ------------------------------------------------------------------ 8-bit

    def _int8(self, prefix: str, shard: Shard | None) -> Int4Weight:
        N, K = self.weights.get_shape(f"{prefix}.weight")
        if shard is not None:
            check_split(prefix, shard, N if shard.parallel == "column" else K,
                             1 if shard.parallel == "column" else 4, "whole rows; 4 input rows per int32")
        elif K % 4:
            raise ValueError(f"{self.weights.folder}: {prefix} has K={K}, not a multiple of 4 (the 8-bit layout packs "
                             "4 input rows per int32)")
        fmt = f"{prefix}.weight_format"
        if self.weights.has_tensor(fmt):
            value = self.weights.get_metadata(fmt)
            if value.numel() != 1 or int(value.reshape(-1)[0]) != INT8_ROW_FORMAT:
                raise ValueError(f"{self.weights.folder}: {fmt} is {value.tolist()}, expected {INT8_ROW_FORMAT} "
                                 "('row'): the turing/ampere tile layouts of old bitsandbytes are not read; re-save "
                                 "the model with bitsandbytes >= 0.45")
        weight = read_shard(self.weights, f"{prefix}.weight", shard, column=0, row=1, dtype=torch.int8)
        scb = read_shard(self.weights, f"{prefix}.SCB", shard, column=0, row=None, dtype=torch.float32, shape=(N,))
        local_K = weight.shape[1]
        if weight.is_meta:
            qweight = torch.empty(local_K // 4, weight.shape[0], dtype=torch.int32, device="meta")
        else:
            qweight = pack_int8_rows(weight)
        return Int4Weight(qweight.to(self.device), (scb * INV_127).reshape(1, -1).to(self.device), None, None,
                          local_K, 8)


def pack_bnb_4bit(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """bitsandbytes' packed bytes (flat W [N, K], element 2i in byte i's high nibble) -> Int4Weight
    qweight int32 [K/8, N] (packed along K, row k in field k % 8). Done in int32, 8 shifts, no int64."""
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(-1)[:N * K].to(torch.int32)
    fields = nibbles.reshape(N, K // 8, 8)
    words = fields[..., 0].clone()
    for i in range(1, 8):
        words |= fields[..., i] << (4 * i)  # field 7 sets the sign bit: int32 wraps, the bit pattern is kept
    return words.t().contiguous()


def pack_int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """int8 W [N, K] -> Int4Weight 8-bit qweight int32 [K/4, N]: q = w + 128 in [1, 255], 4 rows per word."""
    N, K = weight.shape
    fields = (weight.to(torch.int32) + 128).reshape(N, K // 4, 4)
    words = fields[..., 0].clone()
    for i in range(1, 4):
        words |= fields[..., i] << (8 * i)
    return words.t().contiguous()
