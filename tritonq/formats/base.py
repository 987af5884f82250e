"""Typed weights: what a format loader hands to the model, whatever the checkpoint format.

Shapes use the linear-layer notation y = x @ W^T with W [N, K] (N outputs, K inputs).
These are frozen dataclasses; `tritonq.layers.Linear` picks the kernel from the type.
The safetensors access class `Weights` and the `WeightsLoader` interface live here too.
"""
from __future__ import annotations

import contextlib
import json
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
    """
    weight: torch.Tensor
    weight_scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

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
    if len({p.block_size for p in parts}) != 1 or len({p.input_scale is None for p in parts}) != 1:
        raise ValueError("cannot fuse fp8 linears with different block sizes or static/dynamic activation scales")
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
    return FP8Weight(torch.cat([p.weight for p in parts]), scale, first.block_size, input_scale, bias)


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
    if len({p.block_size for p in parts}) != 1 or len({p.weight_scale.shape for p in parts}) != 1:
        raise ValueError("experts of one MoE layer must share the fp8 scale layout")
    return FP8Weight(stack("weight"), stack("weight_scale"), first.block_size, stack("input_scale"), stack("bias"))


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
        self._bar, self._counted = None, set()
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
                self._bar = None

    def _advance(self, name: str) -> None:
        if self._bar is not None and name not in self._counted:
            self._counted.add(name)
            self._bar.update(self._nbytes.get(name, 0))

    def names(self) -> list[str]:
        return list(self._file_of)

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
        start, stop = self._where[name]
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if len(view) != stop - start:
            raise ValueError(f"{self.folder / self._file_of[name]}: tensor {name!r} spans {stop - start} bytes, but "
                             f"{found_dtype} {list(found_shape)} needs {len(view)}; the file is corrupt, "
                             "re-download it")
        with open(self.folder / self._file_of[name], "rb", buffering=0) as f:
            f.seek(start)
            done = 0
            while done < len(view):  # a raw read may return fewer bytes than asked
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self.folder / self._file_of[name]}: file ends inside tensor {name!r}; "
                                     "re-download it")
                done += n
        self._advance(name)
        return tensor

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

    def get_linear(self, prefix: str, bias: bool = False, parallel: str | None = None,
                   parts: int | None = None) -> Weight:
        """The linear `prefix` (see the class docstring for parallel and `shard` for parts)."""
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
            name = f"{prefix}.weight"
            if shard is not None:
                N, K = self.weights.get_shape(name)
                self.check_split(prefix, shard, N if shard.parallel == "column" else K, 1, "whole rows or columns")
            w = DenseWeight(self._as_float(name, self.read(name, shard, column=0, row=1)))
        if bias:
            b = None
            if shard is None or shard.parallel == "column" or shard.index == 0:
                b = self._as_float(f"{prefix}.bias", self.read(f"{prefix}.bias", shard, column=0, row=None))
            w = replace(w, bias=b)
        return w

    def get_fused_linear(self, prefixes: list[str], bias: bool = False, parallel: str | None = None,
                         parts: list[int | None] | None = None) -> Weight:
        """Linears sharing their input, fused along N; each is sharded on its own (q, k, v: each rank
        gets its heads of each), parts per prefix."""
        parts = parts or [None] * len(prefixes)
        return concat_outputs([self.get_linear(p, bias, parallel, n) for p, n in zip(prefixes, parts)])

    def get_stacked(self, prefixes: list[str]) -> Weight:
        return stack_experts([self.get_linear(p) for p in prefixes])

    def get_tensor(self, name: str, dim: int | None = None) -> torch.Tensor:
        """A float tensor in the compute dtype on the device; with dim, this rank's 1/world slice along it
        (vocab-parallel embedding rows)."""
        shard = None if dim is None else self.shard("column")
        return self._as_float(name, self.read(name, shard, column=dim, row=None))

    def _as_float(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} in {self.weights.folder} has dtype {tensor.dtype}, expected a float "
                             "tensor (a quantized module listed as dense?)")
        return tensor.to(device=self.device, dtype=self.dtype)

    def has_tensor(self, name: str) -> bool:
        return self.weights.has_tensor(name)

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        raise NotImplementedError
