"""GGUF checkpoints (llama.cpp's format): one `.gguf` file, or a folder of gguf-split shards.

Read with the `gguf` package's reader (metadata, tensor types, raw blocks; memory-mapped). The file carries
its own config (`read_config`: GGUF metadata -> a transformers config dict), tokenizer and chat template
(transformers converts the GGUF vocabulary: `tokenizer`). `GGUFWeights` presents the tensors under their
Hugging Face names (blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight; a stacked expert tensor as
one tensor per expert) with their logical [N, K] shapes, as float tensors: reading one dequantizes its blocks
(`dequantize`, bit for bit the gguf package's reference in fp32), with Llama's Q/K rows un-permuted (the
converter interleaves them for llama.cpp's rope). `GGUFLoader` repacks Q4_0 and Q8_0 (d * (q - 8), d * x per
32 weights: the symmetric form of the int layout) into Int4Weight and Q4_1 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K /
Q5_K / Q6_K / IQ4_NL / IQ4_XS into GGUFWeight (codes with exact fp32 scales and offsets or a 16-level table, `PLANAR`; MoE experts
too, stacked for the fused MoE); a fused group of mixed types (experts' gate / up too) into a PartsWeight of its
typed runs; the rest is dequantized once to the compute dtype at load (docs/gguf.md: which, and the memory cost).
Every tensor's type, size and place in its file is checked when the files are opened, before any weight is read.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tritonq.formats.base import WeightsLoader, always_dense
from tritonq.formats.checkpoint import Weights, block_sizes, nonfinite_count
from tritonq.formats.tensor_parallel import Shard, check_split
from tritonq.quant.packing import pack_int32
from tritonq.quant.weights import DenseWeight, GGUFWeight, Int4Weight, PartsWeight, Weight

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # GGUF -> model_type

# GGUF tensor name (after "blk.N.") -> Hugging Face module name inside model.layers.N
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "ffn_gate_inp": "mlp.gate"}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def gguf_files(path: str | Path) -> list[Path] | None:
    """The GGUF files of a checkpoint: [path] for a .gguf file, a folder's *.gguf (gguf-split shards, in order)
    when it has them and no config.json; None when `path` is no GGUF checkpoint."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return [path]
    if path.is_dir() and not (path / "config.json").exists():
        return sorted(path.glob("*.gguf")) or None
    return None


# --- block formats -------------------------------------------------------------------------------------------
# Each dequantizer takes blocks uint8 [B, type_size] and returns float32 [B, block_size] with the gguf package's
# arithmetic (fp16 scales widened to fp32, one product or product-and-add per value, in its order).

def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [B, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [B, n] -> 4-bit codes [B, 2n]: in every run of `run` bytes, first the low nibbles, then the high."""
    B = qs.shape[0]
    q = qs.reshape(B, -1, 1, run) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(B, -1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 32 fifth bits of each block (one little-endian uint32) as uint8 [B, 32]."""
    word = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((word >> torch.arange(count)) & 1).to(torch.uint8)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two uint8 [B, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:], 16).to(torch.int8) - 8).float()


def _planes_q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2)


def _planes_q5_0(b):
    return _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4), _f16(b, 0), None


def _planes_q5_1(b):
    return _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2)


def _planes_q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:], 32), _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _planes_q2_k(b):
    sc = b[:, :16]
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    return q.reshape(-1, 256), _f16(b, 80) * (sc & 0x0F).float(), -(_f16(b, 82) * (sc >> 4).float())


def _planes_q3_k(b):
    B = b.shape[0]
    low = (b[:, 32:96].reshape(B, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    high = (b[:, :32].reshape(B, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    s = b[:, 96:108]
    sc = (torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=1)
          | (((s[:, 8:12].reshape(B, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 4, 1)) & 3)
             .reshape(B, 16) << 4))
    return (low.reshape(B, 256) | (high.reshape(B, 256) << 2)), _f16(b, 108) * (sc.to(torch.int32) - 32).float(), None


def _planes_q5_k(b):
    B = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(B, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 32).reshape(B, 8, 32) | ((qh & 1) << 4)
    return q.reshape(B, 256), _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _planes_q6_k(b):
    B = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(B, 8, 32)
    qh = (b[:, 128:192].reshape(B, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1))
    q = ql | ((qh & 3).reshape(B, 8, 32) << 4)
    return q.reshape(B, 256), _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float(), None


def _planes_iq4_nl(b):
    return _nibbles(b[:, 2:], 16), _f16(b, 0), None


def _planes_iq4_xs(b):
    low = (b[:, 4:8].reshape(-1, 4, 1) >> torch.tensor([0, 4], dtype=torch.uint8)).reshape(-1, 8) & 0x0F
    high = (b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) >> torch.arange(0, 16, 2)) & 3
    return _nibbles(b[:, 8:], 16), _f16(b, 0) * ((low.to(torch.int32) | (high << 4)) - 32).float(), None


# IQ4_NL / IQ4_XS's 16 non-uniform levels (llama.cpp's kvalues_iq4nl): a 4-bit code q means IQ4_LEVELS[q] * scale
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# The block formats kept as GGUFWeight (tritonq.quant.weights): type -> (code bits, zero, group, planes), where planes
# takes blocks [B, type_size] to (codes uint8 [B, block], scales fp32 [B, block / group], offsets fp32 or None)
# and a value is (q - zero) * scale (+ offset), or IQ4_LEVELS[q] * scale for the IQ4 types (zero None): each scale and
# product exact in fp32, as the gguf package forms them.
PLANAR = {"Q2_K": (4, 0, 16, _planes_q2_k), "Q3_K": (4, 4, 16, _planes_q3_k), "Q4_1": (4, 0, 32, _planes_q4_1),
          "Q5_0": (5, 16, 32, _planes_q5_0), "Q5_1": (5, 0, 32, _planes_q5_1),
          "Q4_K": (4, 0, 32, _planes_q4_k), "Q5_K": (5, 0, 32, _planes_q5_k), "Q6_K": (6, 32, 16, _planes_q6_k),
          "IQ4_NL": (4, None, 32, _planes_iq4_nl), "IQ4_XS": (4, None, 32, _planes_iq4_xs)}


def _planar(type_name: str):
    """The dequantizer of a PLANAR format: blocks -> float32 (q - zero) * scale (+ offset) (IQ4: level * scale)
    per group."""
    _, zero, group, planes = PLANAR[type_name]

    def dequantize_blocks(b):
        codes, scales, offsets = planes(b)
        B = b.shape[0]
        levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32)[codes.long()] if zero is None else (
            codes.to(torch.int32) - zero).float()
        w = levels.reshape(B, -1, group) * scales.reshape(B, -1, 1)
        if offsets is not None:
            w = w + offsets.reshape(B, -1, 1)
        return w.reshape(B, -1)
    return dequantize_blocks


def _f16_blocks(b):
    return b.contiguous().view(torch.float16).float()


def _bf16_blocks(b):
    return b.contiguous().view(torch.bfloat16).float()


def _f32_blocks(b):
    return b.contiguous().view(torch.float32)


# type name -> (values per block, bytes per block, dequantizer)
BLOCK_FORMATS = {"F32": (1, 4, _f32_blocks), "F16": (1, 2, _f16_blocks), "BF16": (1, 2, _bf16_blocks),
                 "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _planar("Q4_1")),
                 "Q5_0": (32, 22, _planar("Q5_0")), "Q5_1": (32, 24, _planar("Q5_1")),
                 "Q2_K": (256, 84, _planar("Q2_K")), "Q3_K": (256, 110, _planar("Q3_K")),
                 "Q4_K": (256, 144, _planar("Q4_K")), "Q5_K": (256, 176, _planar("Q5_K")),
                 "Q6_K": (256, 210, _planar("Q6_K")), "IQ4_NL": (32, 18, _planar("IQ4_NL")),
                 "IQ4_XS": (256, 136, _planar("IQ4_XS"))}


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The raw bytes of a GGUF tensor (uint8 [..., row bytes]) in block format `type_name` -> float32
    [..., row values], equal bit for bit to gguf.quants.dequantize."""
    block, size, fn = BLOCK_FORMATS[type_name]
    rows = raw.shape[:-1]
    blocks = raw.reshape(-1, size)
    return fn(blocks).reshape(*rows, raw.shape[-1] // size * block)


def planes_of(blocks: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks uint8 [N, K / block, type_size] of a PLANAR format -> (codes uint8 [N, K], scales fp32
    [N, K / group], offsets fp32 [N, K / group] or None)."""
    N, _, size = blocks.shape
    codes, scales, offsets = PLANAR[type_name][3](blocks.reshape(-1, size))
    scales = scales.reshape(N, -1)
    return codes.reshape(N, -1), scales, None if offsets is None else offsets.reshape(N, -1)


def gguf_weight(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, type_name: str,
                device) -> GGUFWeight:
    """`planes_of`'s [N, ...] planes (a rank's slice of them) as the GGUFWeight the kernels read, on device."""
    bits, zero, group, _ = PLANAR[type_name]
    codes = codes.t()  # [K, N]: the planes are packed along K, scale rows [K / group, N]
    return GGUFWeight(pack_int32(codes & 15, 4, dim=0).to(device),
                      pack_int32(codes >> 4, bits - 4, dim=0).to(device) if bits > 4 else None,
                      scales.t().to(device).contiguous(),
                      None if offsets is None else offsets.t().to(device).contiguous(),
                      group, bits, zero or 0, type_name,
                      code=None if zero is not None else torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=device))


# --- reading ---------------------------------------------------------------------------------------------------

def _reader(path: Path):
    """GGUFReader over `path` that checks every tensor's type and size as it indexes them (before any data is
    read): an unknown or unsupported type, rows that are no whole number of blocks, or data past the end of the
    file is refused naming the tensor and the fix."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            spans = []
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                start = start_offs + int(offset[0])
                spans.append((start, _check_tensor(path, name, int(raw_type[0]), [int(d) for d in dims], start,
                                                   len(self.data)), name))
            spans.sort()
            for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
                if end > start:
                    raise ValueError(f"{path}: tensor {name!r} needs bytes up to {end} for its type and shape, but "
                                     f"tensor {following!r} starts at {start}: its size disagrees with its type; the "
                                     "file is corrupt: re-download or re-convert it")
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable GGUF file ({e}); re-download it") from e
    except (IndexError, TypeError, KeyError, OverflowError) as e:  # numpy reads past the end of a cut header
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e}); re-download it") from e


def _check_tensor(path: Path, name: str, raw_type: int, dims: list[int], start: int, file_size: int) -> int:
    """Where tensor `name`'s data ends, from its type and shape, once that is a supported type, whole blocks, and
    inside the file."""
    from gguf import GGMLQuantizationType
    try:
        type_name = GGMLQuantizationType(raw_type).name
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has tensor type {raw_type}, which is no GGML type this gguf "
                         "package knows (a newer llama.cpp format?); upgrade the gguf package, or re-quantize the "
                         "model with llama-quantize to one of " + ", ".join(BLOCK_FORMATS)) from None
    if type_name not in BLOCK_FORMATS:
        raise ValueError(f"{path}: tensor {name!r} is {type_name}, a GGUF block type tritonq does not read yet "
                         f"(supported: {', '.join(BLOCK_FORMATS)}); re-quantize the model with llama-quantize to "
                         "one of them (e.g. Q4_K_M, Q6_K or Q8_0)")
    block, type_size = BLOCK_FORMATS[type_name][:2]
    if not dims or dims[0] % block:
        raise ValueError(f"{path}: tensor {name!r} is {type_name} with row length {dims[0] if dims else None}, not a "
                         f"multiple of its {block}-value blocks; the file is corrupt: re-download or re-convert it")
    end = start + math.prod(dims) // block * type_size
    if end > file_size:
        raise ValueError(f"{path}: tensor {name!r} ({type_name} {list(reversed(dims))}) needs bytes up to {end}, but "
                         f"the file has {file_size}: it is truncated; re-download it")
    return end


def _field(reader, key: str):
    """Metadata value `key` (a str, number, or list), or None when absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


class GGUFWeights(Weights):
    """The tensors of GGUF file(s) under Hugging Face names and [N, K] shapes, read as float tensors
    (dequantized; Llama's Q/K rows un-permuted). Everything else (read bookkeeping, progress, dry runs, the NaN
    check) is `Weights`'. `raw(name)` gives a tensor's blocks, for the loader's repacks."""

    def __init__(self, files: list[Path]):
        self.folder = files[0] if len(files) == 1 else files[0].parent
        self.readers = [_reader(f) for f in files]
        self.meta_file, self.meta = self._metadata_reader(files)
        count = _field(self.meta, "split.count")
        if count is not None and count != len(files):
            raise ValueError(f"{self.meta_file}: split.count={count}: the model is {count} gguf-split shards, but "
                             f"{len(files)} .gguf file(s) are there ({', '.join(f.name for f in files)}); put exactly "
                             "that model's shards in one folder (download the missing ones, remove stray files)")
        self.arch = _field(self.meta, "general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.meta_file}: general.architecture={self.arch!r} is not supported; tritonq reads "
                             f"GGUF files of {sorted(ARCHITECTURES)}. Load that model's safetensors checkpoint instead")
        self.heads = _field(self.meta, f"{self.arch}.attention.head_count")
        self.kv_heads = _field(self.meta, f"{self.arch}.attention.head_count_kv") or self.heads
        self._tensors = {}  # HF name -> (file index, ReaderTensor, expert index or None)
        for i, reader in enumerate(self.readers):
            for t in reader.tensors:
                for hf, expert in self._hf_names(t.name, t.shape):
                    if hf in self._tensors:
                        raise ValueError(f"{self.folder}: tensor {t.name!r} is stored in two shards; remove the stray "
                                         "file")
                    self._tensors[hf] = (i, t, expert)
        self._file_of = {name: files[i].name for name, (i, _, _) in self._tensors.items()}
        self._nbytes = {name: t.n_bytes // (1 if e is None else int(t.shape[2])) for name, (_, t, e) in
                        self._tensors.items()}
        self._bar, self._counted, self._read, self._read_buffer = None, set(), set(), None
        self._dry, self._nonfinite = False, {}

    def _metadata_reader(self, files: list[Path]):
        """(file, reader) of the shard holding the metadata (gguf-split: split.no 0; one file: that file)."""
        for path, reader in zip(files, self.readers):
            if (_field(reader, "split.no") or 0) == 0 and _field(reader, "general.architecture") is not None:
                return path, reader
        raise ValueError(f"{self.folder}: no GGUF file with general.architecture; the metadata shard (the first of a "
                         "gguf-split set) is missing: download it")

    def _hf_names(self, name: str, dims) -> list[tuple[str, int | None]]:
        if name in GLOBAL_NAMES:
            return [(GLOBAL_NAMES[name], None)]
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
            layer, module, kind = int(parts[1]), parts[2], parts[3]
            if module in LAYER_NAMES:
                return [(f"model.layers.{layer}.{LAYER_NAMES[module]}.{kind}", None)]
            if module in EXPERT_NAMES:
                return [(f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[module]}.{kind}", e)
                        for e in range(int(dims[2]))]
        raise ValueError(f"{self.folder}: tensor {name!r} is not one a {self.arch} model has; tritonq reads the "
                         f"tensors of {sorted(ARCHITECTURES)} GGUF files as llama.cpp's converter names them")

    def type_name(self, name: str) -> str:
        return self._info(name)[1].tensor_type.name

    def _info(self, name: str):
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} not found in GGUF checkpoint {self.folder}")
        return self._tensors[name]

    def get_shape(self, name: str) -> tuple[int, ...]:
        _, t, expert = self._info(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return shape if expert is None else shape[1:]

    def get_dtype(self, name: str) -> torch.dtype:
        type_name = self.type_name(name)
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(type_name, torch.float32)

    def _mapped(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (one expert's of a stacked one), memory-mapped: uint8 [rows, row bytes]
        (a 1-D tensor: one row)."""
        _, t, expert = self._info(name)
        data = t.data if expert is None else t.data[expert]
        return data.view(np.uint8).reshape(-1, data.view(np.uint8).shape[-1])

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor `name` as uint8 [rows..., row bytes] (a copy: mapped pages would stay
        resident); counted as read."""
        raw = torch.from_numpy(np.array(self._mapped(name)))
        self._advance(name)
        return raw.reshape(*self.get_shape(name)[:-1], -1)

    def _permuted(self, name: str) -> int | None:
        """Head count whose rope interleave llama.cpp's converter applied to Llama's q_proj / k_proj rows."""
        if self.arch != "llama":
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return self.heads
        if name.endswith("self_attn.k_proj.weight"):
            return self.kv_heads
        return None

    def unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows of tensor `name` (dim 0) back in Hugging Face order (inverse of the converter's permute)."""
        heads = self._permuted(name)
        if heads is None:
            return rows
        N = rows.shape[0]
        return rows.reshape(heads, N // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    def get_tensor(self, name: str, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
        """Tensor `name` dequantized to float32 (F16 / BF16 kept as stored), in Hugging Face layout."""
        self._check(name, None, self.get_shape(name), None, shape)
        if self._dry:
            return torch.empty(self.get_shape(name), dtype=self.get_dtype(name), device="meta")
        type_name = self.type_name(name)
        values = dequantize(self.raw(name), type_name)
        if type_name in ("F16", "BF16"):
            values = values.to(self.get_dtype(name))
        values = self.unpermute(name, values).contiguous()
        self._count_nonfinite(name, nonfinite_count(values))
        return values

    def read_into(self, name: str, out: torch.Tensor, chunk_bytes: int = 4 << 20) -> torch.Tensor:
        """Tensor `name` dequantized into `out` a block of rows at a time (~chunk_bytes of stored bytes each), so
        no float32 copy of a whole tensor (an embedding table) exists next to `out`. Llama's q / k rows, which
        un-permute across heads, are read whole."""
        shape = self.get_shape(name)
        if tuple(out.shape) != shape:
            raise ValueError(f"{self.folder}: tensor {name!r} has shape {list(shape)}, expected {list(out.shape)}")
        if self._dry:
            return out
        if self._permuted(name) is not None or len(shape) != 2:
            return out.copy_(self.get_tensor(name))
        mapped, type_name, bad = self._mapped(name), self.type_name(name), None
        step = max(1, chunk_bytes // mapped.shape[1])
        for first in range(0, shape[0], step):
            values = dequantize(torch.from_numpy(np.array(mapped[first:first + step])), type_name)
            count = nonfinite_count(values)
            bad = count if bad is None else bad + count
            out[first:first + values.shape[0]].copy_(values)
        self._count_nonfinite(name, bad)
        self._advance(name)
        return out

    def get_sharded(self, name: str, dim: int, rank: int, world: int, dtype: torch.dtype | None = None,
                    shape: tuple | None = None, segments: int | tuple[int, ...] = 1) -> torch.Tensor:
        """Slice `rank` of `world` along `dim` (block formats are dequantized whole, then sliced)."""
        full = self.get_shape(name)
        blocks = block_sizes(full[dim], segments)
        if blocks is None or any(block % world for block in blocks):
            raise ValueError(f"{self.folder}: tensor {name!r} has size {full[dim]} along dim {dim}, not divisible by "
                             f"world size {world}")
        return Shard("column", rank, world, segments).take(self.get_tensor(name, dtype, shape), dim)


def read_config(weights: GGUFWeights) -> dict:
    """The transformers config dict of a GGUF checkpoint, from its metadata (llama.cpp's key names); a missing
    key or an unsupported architecture is refused naming the key and the file."""
    m, arch, where = weights.meta, weights.arch, weights.meta_file

    def need(key):
        value = _field(m, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{where}: GGUF metadata {arch}.{key} is missing; the file was not written by "
                             "llama.cpp's converter (or is cut): re-convert it with convert_hf_to_gguf.py")
        return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    embed_shape = weights.get_shape("model.embed_tokens.weight") if weights.has_tensor(
        "model.embed_tokens.weight") else None
    tokens = _field(m, "tokenizer.ggml.tokens")
    vocab = _field(m, f"{arch}.vocab_size") or (embed_shape[0] if embed_shape else len(tokens or []))
    config = {
        "model_type": ARCHITECTURES[arch], "architectures": None,
        "hidden_size": hidden, "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": _field(m, f"{arch}.attention.head_count_kv") or heads,
        "max_position_embeddings": need("context_length"), "vocab_size": vocab,
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(m, f"{arch}.rope.freq_base") or 10000.0,
        "head_dim": _field(m, f"{arch}.attention.key_length") or hidden // heads,
        "tie_word_embeddings": not weights.has_tensor("lm_head.weight"),
        "bos_token_id": _field(m, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(m, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if arch == "qwen3moe":
        config.update(num_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
                      moe_intermediate_size=need("expert_feed_forward_length"), norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[],
                      intermediate_size=_field(m, f"{arch}.feed_forward_length") or need("expert_feed_forward_length"))
    else:
        config["intermediate_size"] = need("feed_forward_length")
    if arch == "llama":
        config["attention_bias"] = weights.has_tensor("model.layers.0.self_attn.q_proj.bias")
    scaling = _field(m, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = _field(m, f"{arch}.rope.scaling.factor")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling == "yarn":
            config["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
                                      need("rope.scaling.original_context_length")}
        else:
            raise ValueError(f"{where}: {arch}.rope.scaling.type={scaling!r} is not supported (supported: none, "
                             "linear, yarn); load the model's safetensors checkpoint instead")
    if weights.has_tensor("rope_freqs.weight"):
        raise ValueError(f"{where}: the file stores rope_freqs (Llama 3.1 rope scaling factors), which tritonq does "
                         "not read from GGUF yet; load the model's safetensors checkpoint instead")
    return {k: v for k, v in config.items() if v is not None}


def tokenizer(weights: GGUFWeights):
    """The tokenizer built by transformers from the GGUF vocabulary (chat template: tokenizer.chat_template)."""
    from transformers import AutoTokenizer
    meta_file = weights.meta_file
    if _field(weights.meta, "tokenizer.ggml.tokens") is None:
        raise ValueError(f"{meta_file}: GGUF metadata tokenizer.ggml.tokens is missing: the file has no vocabulary; "
                         "re-convert it with llama.cpp's convert_hf_to_gguf.py (it writes the tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(meta_file.parent, gguf_file=meta_file.name)
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError) as e:
        raise ValueError(f"{meta_file}: transformers cannot build a tokenizer from this GGUF's vocabulary "
                         f"({type(e).__name__}: {str(e).strip()[:300]})") from e


class GGUFLoader(WeightsLoader):
    """Typed weights of a GGUF checkpoint: Q4_0 and Q8_0 linears and experts repacked to Int4Weight (4 / 8 bits,
    group 32, scale d, symmetric zero 8 / 128: the same values); the PLANAR types' to GGUFWeight (their codes and
    exact fp32 scales / offsets, run by kernels/gguf_gemm.py); fused groups (q/k/v, gate/up) whose parts differ in
    type as a PartsWeight (get_fused_linear; experts' gate / up too); every other tensor dequantized to the compute dtype
    (`GGUFWeights`)."""
    marker = "weight"
    REPACKED = {"Q4_0": 4, "Q8_0": 8}  # block type -> Int4Weight bits

    def __init__(self, weights: GGUFWeights, config: dict, dtype: torch.dtype, device, quantize: str | None = None,
                 *, rank: int = 0, world: int = 1):
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} needs a dense checkpoint, but {weights.folder} is a GGUF file "
                             "(already quantized); load it without quantize")
        super().__init__(weights, config, dtype, device, rank=rank, world=world)

    def is_quantized(self, prefix: str) -> bool:
        name = f"{prefix}.weight"
        if always_dense(prefix) or not self.weights.has_tensor(name) or len(
                self.weights.get_shape(name)) != 2:
            return False
        type_name = self.weights.type_name(name)
        return type_name in self.REPACKED or type_name in PLANAR

    def get_fused_linear(self, prefixes: list[str], bias: bool = False, parallel: str | None = None,
                         parts: list | None = None, shapes: list | None = None, segments: list | None = None) -> Weight:
        """As WeightsLoader's where the parts share a block type. Parts of different types (Q4_K_M's Q4_K q / k
        with a Q6_K v; an expert's gate and up) cannot share one kernel: each run of equal types is fused, and the
        runs kept side by side in a PartsWeight (one GEMM each, every part in its own format; experts: stacked, one
        expert GEMM each, kernels/moe)."""
        kinds = [self.weights.type_name(f"{p}.weight") if self.is_quantized(p) else None for p in prefixes]
        if len(set(kinds)) == 1:
            return super().get_fused_linear(prefixes, bias, parallel, parts, shapes, segments)
        n = len(prefixes)
        parts, shapes, segments = parts or [None] * n, shapes or [None] * n, segments or [1] * n
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or kinds[i] != kinds[start]:
                runs.append(super().get_fused_linear(prefixes[start:i], bias, parallel, parts[start:i],
                                                     shapes[start:i], segments[start:i]))
                start = i
        return PartsWeight(tuple(runs))

    def check_float(self, name: str) -> None:
        pass  # every GGUF tensor reads as float (GGUFWeights dequantizes)

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        """Q4_0 / Q8_0 [N, K] -> Int4Weight: codes (Q4_0's nibbles q; Q8_0's int8 x as x + 128) packed along K,
        scales [K/32, N] = the blocks' fp16 d in the compute dtype (exact in fp16 / fp32; bf16 rounds d to 8
        mantissa bits), zeros None (symmetric: 8 / 128, the formats' own offsets). The PLANAR types ->
        GGUFWeight: the same codes split into 4-bit and high-bit planes, fp32 scales and offsets (exact); read
        dense where a row-parallel rank's share of K is no whole number of blocks (a tiny model's 128 / 256)."""
        name = f"{prefix}.weight"
        type_name = self.weights.type_name(name)
        block, size, _ = BLOCK_FORMATS[type_name]
        N, K = self.weights.get_shape(name)
        column = shard is not None and shard.parallel == "column"
        if type_name in PLANAR and shard is not None and not column and (K // shard.count) % block:
            return DenseWeight(self._dense_matrix([prefix], [shard])[0])  # a rank's rows would cut a super-block
        if shard is not None:
            check_split(prefix, shard, N if column else K, 1 if column else block,
                        "whole rows" if column else f"a {type_name} block of {block} input rows")
        n, k = (N, K) if shard is None else shard.local_shape(N, K)
        if type_name in self.REPACKED:
            return self._int_weight(name, type_name, shard, N, K, n, k)
        bits, zero, group, _ = PLANAR[type_name]
        if self.weights._dry:
            meta = torch.device("meta")
            scales = torch.empty(k // group, n, device=meta)
            return GGUFWeight(torch.empty(k // 8, n, dtype=torch.int32, device=meta),
                              torch.empty(k * (bits - 4) // 32, n, dtype=torch.int32, device=meta) if bits > 4
                              else None,
                              scales, scales if type_name in ("Q2_K", "Q4_1", "Q5_1", "Q4_K", "Q5_K") else None, group, bits,
                              zero or 0, type_name, code=None if zero is not None else torch.empty(16, device=meta))
        blocks = self.weights.unpermute(name, self.weights.raw(name).reshape(N, K // block, size))
        codes, scales, offsets = planes_of(blocks, type_name)
        bad = nonfinite_count(scales)
        self.weights._count_nonfinite(name, bad if offsets is None else bad + nonfinite_count(offsets))
        if shard is not None:
            codes, scales = shard.take(codes, 0 if column else 1), shard.take(scales, 0 if column else 1)
            offsets = None if offsets is None else shard.take(offsets, 0 if column else 1)
        return gguf_weight(codes, scales, offsets, type_name, self.device)

    def _int_weight(self, name: str, type_name: str, shard: Shard | None, N: int, K: int, n: int, k: int
                    ) -> Int4Weight:
        """Q4_0 / Q8_0 as Int4Weight (quantized_linear)."""
        bits, size = self.REPACKED[type_name], BLOCK_FORMATS[type_name][1]
        if self.weights._dry:
            meta = torch.device("meta")
            return Int4Weight(torch.empty(k * bits // 32, n, dtype=torch.int32, device=meta),
                              torch.empty(k // 32, n, dtype=self.dtype, device=meta), None, None, 32, bits)
        blocks = self.weights.unpermute(name, self.weights.raw(name).reshape(N, K // 32, size))
        if type_name == "Q4_0":
            codes = _nibbles(blocks[..., 2:].reshape(-1, 16), 16).reshape(N, K).to(torch.int32)
        else:
            codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(N, K).to(torch.int32) + 128
        scales = blocks[..., :2].contiguous().view(torch.float16).reshape(N, K // 32)
        self.weights._count_nonfinite(name, nonfinite_count(scales))  # refused in finish(), as a dequantized NaN is
        if shard is not None:
            codes = shard.take(codes, 0 if shard.parallel == "column" else 1)
            scales = shard.take(scales, 0 if shard.parallel == "column" else 1)
        return Int4Weight(pack_int32(codes.t().contiguous(), bits, dim=0).to(self.device),
                          scales.t().to(device=self.device, dtype=self.dtype).contiguous(), None, None, 32, bits)
