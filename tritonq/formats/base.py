"""Typed weights: what a format loader hands to the model, whatever the checkpoint format.

Shapes use the linear-layer notation y = x @ W^T with W [N, K] (N outputs, K inputs).
These are frozen dataclasses; `tritonq.layers.Linear` picks the kernel from the type.
The safetensors access class `Weights` and the `WeightsLoader` interface live here too.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class DenseWeight:
    """weight [N, K] fp16/bf16/fp32; bias [N] or None."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight


@dataclass(frozen=True)
class Int4Weight:
    """Integer weights in tritonq's one internal layout (both AWQ and GPTQ are repacked into it).

    qweight [K * bits / 32, N] int32: packed along K, sequential order: row r, field i holds
            input row k = r * (32 // bits) + i, bits (4 or 8) wide, at bit offset i * bits.
    scales  [G, N] fp16/bf16, G = number of groups along K.
    zeros   [G, N] same dtype as scales, integer-valued (already unpacked, v1 offset removed),
            or None for symmetric weights (zero = 2^(bits-1)).
    g_idx   [K] int32 group of each input row (act-order), or None: group of row k = k // group_size.
    group_size: rows per group (K for per-channel quantization).
    Dequant: W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n].
    """
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int
    bits: int = 4
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[1], self.qweight.shape[0] * 32 // self.bits)

    def dequantize(self) -> torch.Tensor:
        from tritonq.kernels.int4_gemm import dequantize_int4
        return dequantize_int4(self)


@dataclass(frozen=True)
class FP8Weight:
    """weight [N, K] float8_e4m3fn.

    weight_scale: fp32, shape [] (per tensor), [N, 1] (per output channel) or, with block_size
    (bn, bk), [ceil(N/bn), ceil(K/bk)] (DeepSeek-V3 `weight_scale_inv`): W = weight * scale.
    input_scale: fp32 [] for static activation scaling, or None for dynamic per-token scaling.
    weight_only: the checkpoint quantizes weights only (e.g. compressed-tensors with
    `input_activations: null`): activations stay in the compute dtype, never rounded to fp8.
    """
    weight: torch.Tensor
    weight_scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    weight_only: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        from tritonq.kernels.fp8_gemm import dequantize_fp8
        return dequantize_fp8(self)


Weight = DenseWeight | Int4Weight | FP8Weight


def to_device(w: Weight, device) -> Weight:
    """The same typed weight with every tensor field moved to `device`."""
    return replace(w, **{f: v.to(device) for f, v in vars(w).items() if isinstance(v, torch.Tensor)})


def k_major(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether dense linear weights W [N, K] on `device` in `dtype` are stored [K, N]-contiguous (W a
    transposed view): on CPU in fp32, MKL's decode GEMV (M = 1..8) streams W ~1.3x faster that way.
    fp16/bf16 and GPUs are faster as [N, K]. F.linear takes either layout unchanged."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def empty_linear(N: int, K: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized W [N, K] in the layout `k_major` picks (a loader reads the weight straight into it)."""
    if k_major(device, dtype):
        return torch.empty(K, N, dtype=dtype, device=device).t()
    return torch.empty(N, K, dtype=dtype, device=device)


def concat_outputs(parts: list[Weight]) -> Weight:
    """Fuse linears that share their input (q/k/v, gate/up) by concatenating along N."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse linears of different types {sorted(k.__name__ for k in kinds)}; "
                         "a fused group must be all dense or all quantized the same way")
    first = parts[0]
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    if isinstance(first, DenseWeight):
        return DenseWeight(torch.cat([p.weight for p in parts]), bias)
    if isinstance(first, Int4Weight):
        keys = {(p.bits, p.group_size, p.zeros is None) for p in parts}
        if len(keys) != 1 or any(not _same(p.g_idx, first.g_idx) for p in parts):
            raise ValueError("cannot fuse int4 linears with different bits / group_size / symmetry / g_idx: "
                             f"found (bits, group_size, symmetric) {sorted(keys)}")
        return Int4Weight(torch.cat([p.qweight for p in parts], dim=-1), torch.cat([p.scales for p in parts], dim=-1),
                          None if first.zeros is None else torch.cat([p.zeros for p in parts], dim=-1),
                          first.g_idx, first.group_size, first.bits, bias)
    if len({(p.block_size, p.input_scale is None, p.weight_only) for p in parts}) != 1:
        raise ValueError("cannot fuse fp8 linears with different block sizes, static/dynamic activation scales "
                         "or weight-only/activation-quantized schemes")
    if first.block_size is not None:
        if any(p.weight.shape[0] % first.block_size[0] for p in parts[:-1]):
            raise ValueError(f"cannot fuse block-fp8 linears whose N {[p.weight.shape[0] for p in parts]} "
                             f"are not multiples of the block {first.block_size[0]}")
        scale = torch.cat([p.weight_scale for p in parts])
    elif all(p.weight_scale.numel() == 1 for p in parts) and len({float(p.weight_scale) for p in parts}) == 1:
        scale = first.weight_scale
    else:  # different per-tensor scales become exact per-channel scales of the fused weight
        scale = torch.cat([p.weight_scale.reshape(-1, 1).expand(p.weight.shape[0], 1) for p in parts])
    # One static input scale for the fused input: the largest keeps every part in range (as vLLM does).
    input_scale = None if first.input_scale is None else torch.stack([p.input_scale.reshape(()) for p in parts]).max()
    return FP8Weight(torch.cat([p.weight for p in parts]), scale, first.block_size, input_scale, bias,
                     first.weight_only)


def stack_experts(parts: list[Weight]) -> Weight:
    """Stack per-expert weights of one type into the same type with a leading expert dim E."""
    if len({type(p) for p in parts}) != 1:
        raise ValueError("experts of one MoE layer must all have the same weight type")
    first = parts[0]
    stack = lambda field: None if getattr(first, field) is None else torch.stack([getattr(p, field) for p in parts])  # noqa: E731
    if isinstance(first, DenseWeight):
        return DenseWeight(stack("weight"), stack("bias"))
    if isinstance(first, Int4Weight):
        if len({(p.bits, p.group_size, p.zeros is None, p.g_idx is None) for p in parts}) != 1:
            raise ValueError("experts of one MoE layer must share bits, group_size, symmetry and act-order")
        return Int4Weight(stack("qweight"), stack("scales"), stack("zeros"), stack("g_idx"),
                          first.group_size, first.bits, stack("bias"))
    if len({(p.block_size, p.weight_scale.shape, p.weight_only) for p in parts}) != 1:
        raise ValueError("experts of one MoE layer must share the fp8 scale layout and activation scheme")
    return FP8Weight(stack("weight"), stack("weight_scale"), first.block_size, stack("input_scale"), stack("bias"),
                     first.weight_only)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# safetensors header dtype codes -> torch dtypes
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class Weights:
    """Memory-mapped tensors of one checkpoint folder: model.safetensors, or the index + its shards.

    get_tensor reads one tensor with a plain file read into a fresh tensor, not through the memory
    map: mapped pages would stay resident (and count in the process's memory) on top of the copy
    while the model loads. Sharded reads (get_sharded) slice through the map, reading only their part.
    Every error names the file and the tensor, and says what was expected. Inside `progress()`,
    a tqdm bar counts the stored bytes of the tensors read so far (a sharded read counts its tensor).
    Every name read (whole or a slice) is recorded, and so is every name a loader declares
    redundant (`mark_read`), so that `unread()` lists what no module used.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index (expected JSON with a 'weight_map'): {e}") from e
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.folder / f).exists()]
            if missing:
                raise FileNotFoundError(f"{index} names shard(s) {missing} that are not in {self.folder}; "
                                        "download the missing files or fix the index")
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors "
                                        f"in {self.folder}; tritonq reads safetensors checkpoints only")
            weight_map = None
        self._handles, self._nbytes, self._where = {}, {}, {}
        for f in files:
            self._handles[f], where = self._open(self.folder / f)
            self._where.update(where)
            self._nbytes.update({name: stop - start for name, (start, stop) in where.items()})
        self._bar, self._counted, self._read, self._read_buffer = None, set(), set(), None
        self._file_of = weight_map or {name: f for f, h in self._handles.items() for name in h.keys()}
        for name, f in self._file_of.items():
            if name not in self._handles[f].keys():
                raise ValueError(f"{index}: tensor {name!r} is mapped to {f}, which does not contain it")

    @staticmethod
    def _open(path: Path):
        size = path.stat().st_size
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError for bad headers
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({e}); re-download it") from e
        with open(path, "rb") as f:  # the header's data offsets must fit in the file
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
        end = 8 + header_len + max((stop for _, stop in offsets.values()), default=0)
        if end > size:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, its header needs {end}); re-download it")
        return handle, {k: (8 + header_len + start, 8 + header_len + stop) for k, (start, stop) in offsets.items()}

    @contextlib.contextmanager
    def progress(self, enabled: bool = True):
        """A tqdm bar over the checkpoint's bytes while the block runs (a model being built)."""
        from tqdm.auto import tqdm
        with tqdm(total=sum(self._nbytes.values()), unit="B", unit_scale=True, desc=f"Loading {self.folder.name}",
                  disable=not enabled, leave=False) as bar:
            self._bar, self._counted = bar, set()
            try:
                yield bar
            finally:
                self._bar, self._read_buffer = None, None

    def _advance(self, name: str) -> None:
        self._read.add(name)
        if self._bar is not None and name not in self._counted:
            self._counted.add(name)
            self._bar.update(self._nbytes.get(name, 0))

    def names(self) -> list[str]:
        return list(self._file_of)

    def mark_read(self, name: str) -> None:
        """Count `name` as used without reading it (a copy the model does not need, e.g. a tied head)."""
        self._read.add(name)

    def unread(self) -> list[str]:
        """Names stored in the checkpoint that nothing has read (or marked) so far, sorted."""
        return sorted(set(self._file_of) - self._read)

    def has_tensor(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.folder}")
        return self._handles[self._file_of[name]]

    def get_tensor(self, name: str, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
        """The tensor as stored; with dtype/shape given, a mismatch raises naming file and tensor."""
        found_shape, found_dtype = self.get_shape(name), self.get_dtype(name)
        self._check(name, found_dtype, found_shape, dtype, shape)
        tensor = torch.empty(found_shape, dtype=found_dtype)
        self._check_span(name, tensor.nbytes)
        with open(self.folder / self._file_of[name], "rb", buffering=0) as f:
            f.seek(self._where[name][0])
            self._read_exactly(f, tensor, name)
        self._advance(name)
        return tensor

    def read_into(self, name: str, out: torch.Tensor, chunk_bytes: int = 4 << 20) -> torch.Tensor:
        """Tensor `name` written into `out` (its stored shape; any float dtype, strides and device: converted
        while copying), a block of rows at a time through one buffer of at most ~chunk_bytes. The stored
        tensor never exists whole next to `out`: a weight is read straight into its slot of a fused matrix,
        into a [K, N] storage, or into a wider dtype, with nothing held twice."""
        shape, dtype = self.get_shape(name), self.get_dtype(name)
        if tuple(out.shape) != shape:
            raise ValueError(f"{self.folder / self._file_of[name]}: tensor {name!r} has shape {list(shape)}, "
                             f"expected {list(out.shape)}")
        if not shape:  # a scalar: nothing to stream
            return out.copy_(self.get_tensor(name))
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        self._check_span(name, shape[0] * row_bytes if math.prod(shape[1:]) else 0)
        step = max(1, chunk_bytes // row_bytes)
        buffer = self._buffer(min(step, shape[0]) * row_bytes).view(dtype).view(min(step, shape[0]), *shape[1:])
        with open(self.folder / self._file_of[name], "rb", buffering=0) as f:
            f.seek(self._where[name][0])
            for first in range(0, shape[0], step):
                rows = buffer[:min(step, shape[0] - first)]
                self._read_exactly(f, rows, name)
                out[first:first + rows.shape[0]].copy_(rows)
        self._advance(name)
        return out

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """nbytes of one read buffer kept by this object (grown, never shrunk, dropped when `progress` ends):
        a buffer allocated and freed per tensor, at a different size each time, fragments the C heap and
        raised the peak resident set of a load by up to 25%."""
        if self._read_buffer is None or self._read_buffer.numel() < nbytes:
            self._read_buffer = None
            self._read_buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._read_buffer[:nbytes]

    def _check_span(self, name: str, nbytes: int) -> None:
        start, stop = self._where[name]
        if nbytes != stop - start:
            raise ValueError(f"{self.folder / self._file_of[name]}: tensor {name!r} spans {stop - start} bytes, but "
                             f"{self.get_dtype(name)} {list(self.get_shape(name))} needs {nbytes}; the file is "
                             "corrupt, re-download it")

    def _read_exactly(self, f, tensor: torch.Tensor, name: str) -> None:
        """Fill contiguous `tensor` with its size in bytes from the current position of raw file f."""
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):  # a raw read may return fewer bytes than asked
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.folder / self._file_of[name]}: file ends inside tensor {name!r}; "
                                 "re-download it")
            done += n

    def get_shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header (no data)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_dtype(self, name: str) -> torch.dtype:
        """The stored dtype, read from the header (no data)."""
        code = self._handle(name).get_slice(name).get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self.folder / self._file_of[name]}: tensor {name!r} has dtype {code}, which tritonq "
                             f"does not read (known: {sorted(SAFETENSORS_DTYPES)})")
        return SAFETENSORS_DTYPES[code]

    def get_sharded(self, name: str, dim: int, rank: int, world: int, dtype: torch.dtype | None = None,
                    shape: tuple | None = None) -> torch.Tensor:
        """Slice `rank` of `world` equal parts along `dim`, reading only that slice from disk.

        dtype / shape (the full stored shape) are checked as in get_tensor.
        """
        view = self._handle(name).get_slice(name)
        full = tuple(view.get_shape())
        if shape is not None:
            self._check(name, None, full, None, shape)
        if full[dim] % world:
            raise ValueError(f"{self._file_of[name]}: tensor {name!r} has size {full[dim]} along dim {dim}, "
                             f"not divisible by world size {world}")
        part = full[dim] // world
        index = [slice(None)] * len(full)
        index[dim] = slice(rank * part, (rank + 1) * part)
        tensor = view[tuple(index)]
        self._check(name, tensor.dtype, None, dtype, None)
        self._advance(name)
        return tensor

    def _check(self, name, found_dtype, found_shape, dtype, shape):
        where = f"{self.folder / self._file_of[name]}: tensor {name!r}"
        if dtype is not None and found_dtype != dtype:
            raise ValueError(f"{where} has dtype {found_dtype}, expected {dtype}")
        if shape is not None and found_shape != tuple(shape):
            raise ValueError(f"{where} has shape {list(found_shape)}, expected {list(shape)}")


@dataclass(frozen=True)
class Shard:
    """The part of one linear this rank holds: part `index` of `count` equal slices of N (parallel
    "column": outputs) or of K ("row": inputs)."""
    parallel: str
    index: int
    count: int


class WeightsLoader:
    """Typed weights of one checkpoint format; the model asks for layers by HF prefix.

    A subclass implements `quantized_linear(prefix, shard)` (and `is_quantized(prefix)` if presence of
    its tensors is not enough). Modules named in the ignore list, or stored only as a dense
    `.weight` (e.g. lm_head of an AWQ model), come back as DenseWeight.

    Tensor parallelism: with world > 1 the model asks for parallel="column" (this rank's N/world
    outputs, bias sliced with them) or parallel="row" (its K/world inputs; the bias only on rank 0,
    so the all-reduce adds it once). A subclass reads just its slice from disk (`read`) and refuses
    a split through a pack or a group (`check_split`). world == 1 reads every layer whole.
    """
    marker = ""  # tensor suffix that marks a quantized module, e.g. "qweight"
    # Stored tensors a model may leave unread with only a warning: rotary tables some exporters saved,
    # and KV-cache / activation scales of schemes this runtime does not apply (it keeps the cache and,
    # for dynamic schemes, the activation scales in the compute dtype).
    harmless_unread = (r"(^|\.)rotary_emb\.inv_freq$", r"\.(k_scale|v_scale|q_scale|kv_scale|input_scale)$")

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, ignore: list[str] | None = None,
                 *, rank: int = 0, world: int = 1):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"tensor parallel rank={rank}, world={world}: expected world >= 1 and 0 <= rank < world")
        self.weights, self.config, self.dtype, self.device = weights, config, dtype, torch.device(device)
        self.ignore = list(ignore or [])
        self.rank, self.world = rank, world

    def is_ignored(self, prefix: str) -> bool:
        # vLLM / AutoAWQ semantics: an entry matches any module whose name contains it.
        return any(entry in prefix for entry in self.ignore)

    def is_quantized(self, prefix: str) -> bool:
        return not self.is_ignored(prefix) and self.weights.has_tensor(f"{prefix}.{self.marker}")

    def shard(self, parallel: str | None, parts: int | None = None) -> Shard | None:
        """This rank's Shard for parallel None / "column" / "row"; None when the layer is read whole.

        parts: how many equal slices the layer may be cut into (default world; e.g. the number of KV
        heads). With parts < world (fewer KV heads than ranks, world a multiple of parts) rank r holds
        slice r * parts // world, so each slice is replicated on world / parts ranks.
        """
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel={parallel!r}; expected None, 'column' or 'row'")
        if parallel is None or self.world == 1:
            return None
        parts = parts or self.world
        if parts >= self.world:
            return Shard(parallel, self.rank, self.world)
        if parallel == "row" or self.world % parts:
            raise ValueError(f"cannot replicate {parts} {parallel} slices over {self.world} ranks: "
                             "a column split with world a multiple of parts is needed")
        return Shard(parallel, self.rank * parts // self.world, parts)

    def check_split(self, prefix: str, shard: Shard, size: int, multiple: int, unit: str) -> None:
        """Refuse a split of `size` (N for column, K for row) into shard.count parts that are not whole `unit`s."""
        if size % (shard.count * multiple):
            what = "N (outputs)" if shard.parallel == "column" else "K (inputs)"
            raise ValueError(f"{prefix}: cannot split {what}={size} {shard.parallel}-parallel into {shard.count} parts "
                             f"of {size / shard.count:g}: each part must be a multiple of {multiple} ({unit}); "
                             "use a tensor_parallel size that keeps whole packs and groups on each rank")

    def read(self, name: str, shard: Shard | None, column: int | None, row: int | None,
             dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
        """Tensor `name` as stored (checked against dtype and the full shape); with a shard, only this
        rank's slice along dim `column` or `row` (by shard.parallel) is read; a None dim reads it whole."""
        dim = None if shard is None else column if shard.parallel == "column" else row
        if dim is None:
            return self.weights.get_tensor(name, dtype, shape)
        return self.weights.get_sharded(name, dim, shard.index, shard.count, dtype, shape)

    def stored_shape(self, prefix: str) -> tuple[tuple[int, int], str, tuple[int, ...]]:
        """((N, K), tensor name, its stored shape) of linear `prefix`, from the safetensors header only.

        Quantized loaders override `quantized_shape` for their packed layouts."""
        if self.is_quantized(prefix):
            return self.quantized_shape(prefix)
        name = f"{prefix}.weight"
        stored = self.weights.get_shape(name)
        if len(stored) != 2:
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}, expected a 2-D "
                             "[N, K] linear weight")
        return stored, name, stored

    def quantized_shape(self, prefix: str) -> tuple[tuple[int, int], str, tuple[int, ...]]:
        name = f"{prefix}.weight"
        return self.weights.get_shape(name), name, self.weights.get_shape(name)

    def check_shape(self, prefix: str, shape: tuple[int, int] | None) -> None:
        """Refuse linear `prefix` when its stored (N, K) is not `shape` (the model's, from config.json),
        before any data is read."""
        if shape is None:
            return
        (N, K), name, stored = self.stored_shape(prefix)
        if (N, K) != tuple(shape):
            implied = "" if (N, K) == stored else f" (a linear of [N={N}, K={K}])"
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}{implied}, but config.json "
                             f"implies [N={shape[0]}, K={shape[1]}] for {prefix}; the config does not match the "
                             "weights: fix config.json or load the checkpoint it belongs to")

    def get_linear(self, prefix: str, bias: bool = False, parallel: str | None = None,
                   parts: int | None = None, shape: tuple[int, int] | None = None) -> Weight:
        """The linear `prefix` (see the class docstring for parallel and `shard` for parts).

        shape: the full (N, K) the model expects, checked against the header before reading."""
        self.check_shape(prefix, shape)
        shard = self.shard(parallel, parts)
        if self.is_quantized(prefix):
            w = self.quantized_linear(prefix, shard)
            row = shard is not None and shard.parallel == "row"
            if row and isinstance(w, Int4Weight) and w.shape[1] % w.group_size:
                # act-order keeps every group's scales on each row shard, but the int4 kernels still need
                # whole groups of rows on each rank (K % group_size == 0).
                self.check_split(prefix, shard, w.shape[1] * shard.count, w.group_size,
                                 f"a quantization group of {w.group_size} input rows, act-order included")
        else:
            w = DenseWeight(self._dense_matrix([prefix], [shard])[0])
        if bias:
            w = replace(w, bias=self._bias(prefix, shard, w.shape[0]))
        return w

    def _bias(self, prefix: str, shard: Shard | None, local_N: int) -> torch.Tensor | None:
        """Bias [local_N] of linear `prefix` (this rank's outputs), or None on ranks > 0 of a row split."""
        N = local_N if shard is None or shard.parallel == "row" else local_N * shard.count
        if shard is None or shard.parallel == "column" or shard.index == 0:
            return self._read_float(f"{prefix}.bias", shard, column=0, row=None, shape=(N,))
        if self.has_tensor(f"{prefix}.bias"):
            self.weights.mark_read(f"{prefix}.bias")  # rank 0 adds it once after the all-reduce
        return None

    def _dense_matrix(self, prefixes: list[str], shards: list[Shard | None]) -> tuple[torch.Tensor, list[int]]:
        """(W [N, K], each part's N): dense linears `prefixes` (each this rank's slice by its shard) fused along
        N into one matrix in the compute dtype and `empty_linear`'s layout, each read straight into its rows:
        no per-part copy, no concatenation, no re-layout later (peak = the fused weight plus a read buffer)."""
        parts = []
        for prefix, shard in zip(prefixes, shards):
            name = f"{prefix}.weight"
            stored = self.weights.get_shape(name)
            if len(stored) != 2:
                raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}, expected a 2-D "
                                 "[N, K] linear weight")
            N, K = stored
            if shard is not None:
                self.check_split(prefix, shard, N if shard.parallel == "column" else K, 1, "whole rows or columns")
                N, K = (N // shard.count, K) if shard.parallel == "column" else (N, K // shard.count)
            self._check_float(name)
            parts.append((name, shard, N, K))
        if len({K for *_, K in parts}) != 1:
            raise ValueError(f"{self.weights.folder}: cannot fuse linears {prefixes} with different input sizes K "
                             f"{[K for *_, K in parts]}; the checkpoint's shapes do not fit this model")
        out = empty_linear(sum(N for _, _, N, _ in parts), parts[0][3], self.dtype, self.device)
        first = 0
        for name, shard, N, _ in parts:
            self._read_float(name, shard, column=0, row=1, out=out[first:first + N])
            first += N
        return out, [N for _, _, N, _ in parts]

    def get_fused_linear(self, prefixes: list[str], bias: bool = False, parallel: str | None = None,
                         parts: list[int | None] | None = None,
                         shapes: list[tuple[int, int] | None] | None = None) -> Weight:
        """Linears sharing their input, fused along N; each is sharded on its own (q, k, v: each rank
        gets its heads of each), parts and expected (N, K) shapes per prefix. Dense ones are read
        straight into the fused matrix (`_dense_matrix`); quantized ones are concatenated."""
        parts = parts or [None] * len(prefixes)
        shapes = shapes or [None] * len(prefixes)
        if any(self.is_quantized(p) for p in prefixes):
            return concat_outputs([self.get_linear(p, bias, parallel, n, s)
                                   for p, n, s in zip(prefixes, parts, shapes)])
        for prefix, shape in zip(prefixes, shapes):
            self.check_shape(prefix, shape)
        shards = [self.shard(parallel, n) for n in parts]
        weight, sizes = self._dense_matrix(prefixes, shards)
        biases = [self._bias(p, s, n) for p, s, n in zip(prefixes, shards, sizes)] if bias else [None]
        return DenseWeight(weight, None if biases[0] is None else torch.cat(biases))

    def get_stacked(self, prefixes: list[str], shape: tuple[int, int] | None = None) -> Weight:
        """Expert linears stacked along a leading E. Dense experts are read straight into one contiguous
        [E, N, K] tensor (the MoE kernels' layout); quantized ones are stacked."""
        if any(self.is_quantized(p) for p in prefixes):
            return stack_experts([self.get_linear(p, shape=shape) for p in prefixes])
        shapes = {p: self.stored_shape(p)[0] for p in prefixes}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{self.weights.folder}: experts of one MoE layer must have one shape; found {shapes}")
        for prefix in prefixes:
            self.check_shape(prefix, shape)
            self._check_float(f"{prefix}.weight")
        out = torch.empty(len(prefixes), *shapes[prefixes[0]], dtype=self.dtype, device=self.device)
        for e, prefix in enumerate(prefixes):
            self._read_float(f"{prefix}.weight", None, column=None, row=None, out=out[e])
        return DenseWeight(out)

    def get_tensor(self, name: str, dim: int | None = None, shape: tuple | None = None,
                   layout: str = "contiguous") -> torch.Tensor:
        """A float tensor in the compute dtype on the device; with dim, this rank's 1/world slice along it
        (vocab-parallel embedding rows). shape: the full stored shape expected (checked before reading).
        layout="linear": a 2-D tensor in `empty_linear`'s layout (a table a tied lm_head also multiplies)."""
        if shape is not None and self.has_tensor(name):
            self._check_tensor_shape(name, shape)
        shard = None if dim is None else self.shard("column")
        out = None
        if layout == "linear" and self.has_tensor(name) and len(self.weights.get_shape(name)) == 2:
            N, K = self.weights.get_shape(name)
            if shard is not None:  # vocab rows (dim 0) or columns (dim 1) of this rank
                N, K = (N // shard.count, K) if dim == 0 else (N, K // shard.count)
            out = empty_linear(N, K, self.dtype, self.device)
        return self._read_float(name, shard, column=dim, row=None, out=out)

    def _check_tensor_shape(self, name: str, shape: tuple) -> None:
        stored = self.weights.get_shape(name)
        if stored != tuple(shape):
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}, but config.json "
                             f"implies {list(shape)}; the config does not match the weights: fix config.json or "
                             "load the checkpoint it belongs to")

    def get_embedding(self, prefix: str, shape: tuple[int, int] | None = None, dim: int | None = None) -> torch.Tensor:
        """The embedding table [V, D] of module `prefix` in the compute dtype (with dim=0, this rank's
        V/world rows). A quantized table (GPTQ/AWQ/fp8/compressed-tensors can carry one) is read as the
        same typed weight a linear would be and dequantized exactly once here: a lookup needs the rows.
        A dense table that config.json ties to the output head is read in the head's layout (`empty_linear`),
        so the head's Linear uses it as it is, without a copy (the lookup reads either layout)."""
        if not self.is_quantized(prefix):
            tied = bool(self.config.get("tie_word_embeddings")) and not self.is_quantized("lm_head")
            return self.get_tensor(f"{prefix}.weight", dim=dim, shape=shape, layout="linear" if tied else "contiguous")
        self.check_shape(prefix, shape)
        if dim is not None and self.world > 1:
            raise ValueError(f"{prefix} is stored quantized; a quantized embedding cannot be split by vocabulary "
                             f"rows over tensor_parallel={self.world} yet: load with tensor_parallel=1")
        return self.quantized_linear(prefix).dequantize().to(device=self.device, dtype=self.dtype)

    def get_lm_head(self, tied: bool, shape: tuple[int, int] | None = None, parallel: str | None = None,
                    prefix: str = "lm_head") -> Weight | None:
        """The output head, or None when the model must reuse its embedding table (tied).

        A quantized head on disk is always used (GPTQModel `lm_head: true` / `dynamic`, or any format
        that stores it quantized), tied or not; a dense `lm_head.weight` is used when untied and, when
        tied, counted as a redundant copy (transformers ties it too). Untied with no head on disk is an
        error: reusing the embedding would be a different model."""
        if self.is_quantized(prefix) or (not tied and self.has_tensor(f"{prefix}.weight")):
            return self.get_linear(prefix, parallel=parallel, shape=shape)
        if tied:
            if self.has_tensor(f"{prefix}.weight"):
                self.weights.mark_read(f"{prefix}.weight")
            return None
        stored = sorted(n for n in self.weights.names() if n.startswith(prefix + "."))
        raise ValueError(f"{self.weights.folder}: config.json has tie_word_embeddings=false but the checkpoint has no "
                         f"{prefix}.weight" + (f" (found {stored}, which is no format this loader reads)" if stored
                                               else "") + "; add the output head to the checkpoint, or set "
                         "tie_word_embeddings=true if the model really reuses its embedding")

    def finish(self) -> None:
        """Called once the model is built: format-specific warnings, then `check_all_read`."""
        self.check_all_read()

    def check_all_read(self) -> None:
        """After the model is built: every stored tensor must have been used. Unread tensors mean a
        module the model does not run (a silent wrong answer), so they are an error naming them;
        `harmless_unread` patterns only warn."""
        unread = self.weights.unread()
        harmless = [n for n in unread if any(re.search(p, n) for p in self.harmless_unread)]
        unused = [n for n in unread if n not in harmless]
        if harmless:
            warnings.warn(f"{self.weights.folder}: ignoring {len(harmless)} stored tensor(s) this runtime does not "
                          f"use: {_listing(harmless)}", stacklevel=3)
        if unused:
            raise ValueError(f"{self.weights.folder}: {len(unused)} stored tensor(s) were not used by any module of "
                             f"the model: {_listing(unused)}; the checkpoint holds modules this model/config does not "
                             "have (or quantizes a module in a way this loader does not read), so it would run a "
                             "different model. Check config.json (layer counts, tie_word_embeddings) and the "
                             "quantization_config")

    def _check_float(self, name: str) -> None:
        """Refuse tensor `name` unless stored as a 2+-byte float (from the header, before reading it)."""
        dtype = self.weights.get_dtype(name)
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise ValueError(f"tensor {name!r} in {self.weights.folder} has dtype {dtype}, expected a "
                             "float16/bfloat16/float32 tensor (a quantized module read as dense? check the "
                             "quantization_config's ignore / modules_to_not_convert lists)")

    def _read_float(self, name: str, shard: Shard | None, column: int | None, row: int | None,
                    shape: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float tensor `name` (this rank's slice, as `read` takes shard/column/row) in the compute dtype on the
        device, written into `out` when given (else a new contiguous tensor). Read whole, it streams into
        `out` through a small buffer (Weights.read_into), so the stored tensor and the result never coexist;
        a slice is read and then copied. shape: the full stored shape expected."""
        stored = self.weights.get_shape(name)  # a missing tensor: KeyError naming it and the checkpoint
        if shape is not None:
            self.weights._check(name, None, stored, None, shape)
        self._check_float(name)
        dim = None if shard is None else column if shard.parallel == "column" else row
        if dim is None:
            if out is None:
                out = torch.empty(stored, dtype=self.dtype, device=self.device)
            return self.weights.read_into(name, out)
        part = self.read(name, shard, column, row)
        return part.to(device=self.device, dtype=self.dtype) if out is None else out.copy_(part)

    def has_tensor(self, name: str) -> bool:
        return self.weights.has_tensor(name)

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        raise NotImplementedError


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
