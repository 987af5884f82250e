"""Reading one safetensors checkpoint folder: `Weights` (the tensors, whole or one slice along a dim).

No format knowledge here: the loaders (formats/base.py and one file per format) turn these
tensors into typed weights (tritonq/quant/weights.py); which slice a tensor-parallel rank reads is
decided in formats/tensor_parallel.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

# safetensors header dtype codes -> torch dtypes
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def block_sizes(size: int, segments: int | tuple[int, ...]) -> list[int] | None:
    """The sizes of the fused blocks of a dim of `size`: `segments` equal ones, or blocks in the proportions a tuple
    gives (reduced by their gcd); None when `size` does not hold whole blocks so."""
    weights = (1,) * segments if isinstance(segments, int) else segments
    common = math.gcd(*weights)
    weights = [w // common for w in weights]
    if size % sum(weights):
        return None
    return [size // sum(weights) * w for w in weights]


def nonfinite_count(t: torch.Tensor) -> torch.Tensor | None:
    """How many NaN / inf values float tensor t holds, as a 0-d int64 tensor on t's device; None for integer
    tensors (packed codes, g_idx), which cannot hold one.

    The common case (all finite) is decided by reductions that allocate nothing the size of t: masks as
    large as each read chunk fragmented the C heap and raised the peak RSS of a load by 25-40%. The exact
    count (masks) is taken only for a tensor that has a non-finite value. Weights reads into host memory,
    where the branch costs no device sync; on a device tensor the count is taken directly (no host read).
    The minimum and maximum are finite iff every value is (NaN propagates through both). float8 has
    no isfinite kernel, so its bytes are tested: e4m3fn has no inf and NaN is S.1111.111 (0x7F, 0xFF, the
    int8 and uint8 maxima); e5m2 is NaN or inf when its 5 exponent bits are all ones (0x7C.., 0xFC..)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        low = 0x7F if t.dtype == torch.float8_e4m3fn else 0x7C  # the smallest non-finite byte with sign 0
        codes = t.reshape(-1).view(torch.uint8)
        if t.device.type == "cpu" and t.numel() and int(codes.max()) < 0x80 + low and \
                int(codes.view(torch.int8).max()) < low:
            return torch.zeros((), dtype=torch.int64)
        return ((codes & low) == low).sum()
    if not t.is_floating_point():
        return None
    if t.device.type == "cpu" and t.numel() and all(math.isfinite(v) for v in torch.aminmax(t)):  # NaN propagates
        return torch.zeros((), dtype=torch.int64)
    return torch.isfinite(t).logical_not().sum()


class Weights:
    """Memory-mapped tensors of one checkpoint folder: model.safetensors, or the index + its shards.

    get_tensor reads one tensor with a plain file read into a fresh tensor, not through the memory
    map: mapped pages would stay resident (and count in the process's memory) on top of the copy
    while the model loads. Sharded reads (get_sharded) slice through the map, reading only their part.
    Every error names the file and the tensor, and says what was expected. Inside `progress()`,
    a tqdm bar counts the stored bytes of the tensors read so far (a sharded read counts its tensor).
    Every name read (whole or a slice) is recorded, and so is every name a loader declares
    redundant (`mark_read`), so that `unread()` lists what no module used. Every float tensor read has
    its NaN / inf values counted as stored (before any repacking), and `check_finite` refuses them once
    loading is done. Inside `dry_run()` every check runs from the headers and nothing is read.
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
            # The index decides which file holds each tensor; a leftover file (a merged copy, an old export)
            # is not opened, so it can never override a tensor the index names.
            stray = sorted(p.name for p in self.folder.glob("*.safetensors") if p.name not in files)
            if stray:
                warnings.warn(f"{self.folder}: ignoring {len(stray)} *.safetensors file(s) that "
                              f"{index.name} does not name: {stray}", stacklevel=3)
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
        self._dry = False  # inside dry_run(): checks only, nothing read
        self._nonfinite: dict[str, torch.Tensor] = {}  # name -> count of NaN/inf values read (a tensor, see check_finite)
        self._file_of = weight_map or self._unique_names()
        for name, f in self._file_of.items():
            if name not in self._handles[f].keys():
                raise ValueError(f"{index}: tensor {name!r} is mapped to {f}, which does not contain it")

    def _unique_names(self) -> dict[str, str]:
        """tensor name -> file, without an index: a name stored in two files is ambiguous (which one wins
        would depend on the file order), so it is an error naming both files."""
        file_of = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if name in file_of:
                    raise ValueError(f"{self.folder}: tensor {name!r} is stored in both {file_of[name]} and {f}; "
                                     "a checkpoint holds each tensor once: remove the stray file, or add a "
                                     "model.safetensors.index.json whose weight_map names the file to use")
                file_of[name] = f
        return file_of

    @staticmethod
    def _open(path: Path):
        try:  # a plain open first: an unreadable file is a permission problem, not a corrupt one
            open(path, "rb").close()
        except PermissionError as e:
            raise PermissionError(f"{path}: permission denied ({e.strerror}); make the file readable by this user "
                                  "(e.g. chmod a+r)") from e
        size = path.stat().st_size
        try:  # safetensors validates the header (its length claim included) before anything is allocated
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
        from tritonq.progress import progress_bar
        with progress_bar(total=sum(self._nbytes.values()), unit="B", unit_scale=True,
                          desc=f"Loading {self.folder.name}", enabled=enabled) as bar:
            self._bar, self._counted = bar, set()
            try:
                yield bar
                bar.update(bar.total - bar.n)  # tensors no module reads (refused or ignored later) count as done
            finally:
                self._bar, self._read_buffer = None, None

    @contextlib.contextmanager
    def dry_run(self):
        """Inside the block nothing is read: get_tensor / get_sharded return meta tensors of the stored shape
        and dtype (after every check a real read makes), read_into returns `out` untouched, and no name counts
        as read. Building the model in it checks every name, dtype and shape it asks for from the headers
        alone, so a missing or mismatched last tensor fails before the first byte of data is read."""
        self._dry = True
        try:
            yield
        finally:
            self._dry = False

    def _count_nonfinite(self, name: str, count: torch.Tensor | None) -> None:
        if count is not None:  # kept as a tensor: read once, in check_finite (no host sync per tensor)
            self._nonfinite[name] = count

    def check_finite(self) -> None:
        """After loading: refuse the checkpoint when any float tensor read held NaN or inf, naming each one,
        its file and how many of its values. The per-tensor counts are read here in one transfer."""
        if not self._nonfinite:
            return
        names = list(self._nonfinite)
        counts = torch.stack(list(self._nonfinite.values())).tolist()  # all on the device the reads land on
        bad = [(n, c) for n, c in zip(names, counts) if c]
        if bad:
            shown = ", ".join(f"{n!r} in {self._file_of[n]} ({c} of {math.prod(self.get_shape(n))} values)"
                              for n, c in bad[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise ValueError(f"{self.folder}: {len(bad)} tensor(s) hold non-finite values (NaN or inf), which "
                             f"would make every output NaN: {shown}{more}; the checkpoint is corrupt or was "
                             "quantized from broken weights: re-download it, or re-quantize it from a good model")

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
        self._check_span(name, math.prod(found_shape) * found_dtype.itemsize)
        if self._dry:
            return torch.empty(found_shape, dtype=found_dtype, device="meta")
        tensor = torch.empty(found_shape, dtype=found_dtype)
        with open(self.folder / self._file_of[name], "rb", buffering=0) as f:
            f.seek(self._where[name][0])
            self._read_exactly(f, tensor, name)
        self._count_nonfinite(name, nonfinite_count(tensor))
        self._advance(name)
        return tensor

    def get_metadata(self, name: str) -> torch.Tensor:
        """A small tensor that describes other tensors (bitsandbytes' JSON quant state), read even inside
        `dry_run`: the shapes a dry run checks come from it. Recorded as read."""
        tensor = self._handle(name).get_tensor(name)
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
            return out if self._dry else out.copy_(self.get_tensor(name))
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        self._check_span(name, shape[0] * row_bytes if math.prod(shape[1:]) else 0)
        if self._dry:  # checked from the header; nothing read
            return out
        step = max(1, chunk_bytes // row_bytes)
        buffer = self._buffer(min(step, shape[0]) * row_bytes).view(dtype).view(min(step, shape[0]), *shape[1:])
        bad = None
        with open(self.folder / self._file_of[name], "rb", buffering=0) as f:
            f.seek(self._where[name][0])
            for first in range(0, shape[0], step):
                rows = buffer[:min(step, shape[0] - first)]
                self._read_exactly(f, rows, name)
                count = nonfinite_count(rows)  # the stored values, while the chunk is in cache
                bad = count if bad is None else bad + count
                out[first:first + rows.shape[0]].copy_(rows)
        self._count_nonfinite(name, bad)
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
                    shape: tuple | None = None, segments: int | tuple[int, ...] = 1) -> torch.Tensor:
        """Slice `rank` of `world` equal parts along `dim`, reading only that slice from disk.

        segments: the dim holds that many equal blocks (a fused q | k | v), or blocks in a tuple's proportions
        (tensor_parallel.block_sizes); slice `rank` of each block is read and the slices are concatenated in block
        order. dtype / shape (the full stored shape) are checked as in get_tensor.
        """
        view = self._handle(name).get_slice(name)
        full = tuple(view.get_shape())
        if shape is not None:
            self._check(name, None, full, None, shape)
        blocks = block_sizes(full[dim], segments)
        if blocks is None or any(block % world for block in blocks):
            described = "" if segments == 1 else f" (blocks {segments})"
            raise ValueError(f"{self._file_of[name]}: tensor {name!r} has size {full[dim]} along dim {dim}{described}, "
                             f"not divisible by world size {world}")
        if self._dry:
            self._check(name, self.get_dtype(name), None, dtype, None)
            sliced = list(full)
            sliced[dim] = full[dim] // world
            return torch.empty(sliced, dtype=self.get_dtype(name), device="meta")
        pieces, start = [], 0
        for block in blocks:
            part = block // world
            index = [slice(None)] * len(full)
            index[dim] = slice(start + rank * part, start + (rank + 1) * part)
            pieces.append(view[tuple(index)])
            start += block
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        self._check(name, tensor.dtype, None, dtype, None)
        self._count_nonfinite(name, nonfinite_count(tensor))
        self._advance(name)
        return tensor

    def check_shape(self, name: str, shape: tuple) -> None:
        """Refuse tensor `name` unless its stored shape is `shape` (from the header, nothing read)."""
        self._check(name, None, self.get_shape(name), None, shape)

    def _check(self, name, found_dtype, found_shape, dtype, shape):
        where = f"{self.folder / self._file_of[name]}: tensor {name!r}"
        if dtype is not None and found_dtype != dtype:
            raise ValueError(f"{where} has dtype {found_dtype}, expected {dtype}")
        if shape is not None and found_shape != tuple(shape):
            raise ValueError(f"{where} has shape {list(found_shape)}, expected {list(shape)}")

