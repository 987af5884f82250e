"""The checkpoint reader under every format's loader (formats/base.py's WeightsLoader): float tensors read
in the compute dtype onto the device (whole, streamed, or a tensor-parallel slice), checks of dtypes and shapes
from the headers before any data is read, the dry run (the model built from the headers alone) and the account of
stored tensors no module read (an error: a model that would silently differ), once the model is built.
"""
from __future__ import annotations

import contextlib
import math
import re
import warnings

import torch

from tritonq.formats.checkpoint import Weights
from tritonq.formats.tensor_parallel import Shard, read_shard, split_dim


class CheckpointReader:
    """The reads and checks of one checkpoint (`Weights`) for a loader, in `dtype` on `device`."""
    # Stored tensors a model may leave unread with only a warning: rotary tables some exporters saved,
    # and KV-cache / activation scales of schemes this runtime does not apply (it keeps the cache and,
    # for dynamic schemes, the activation scales in the compute dtype).
    harmless_unread = (r"(^|\.)rotary_emb\.inv_freq$", r"\.(k_scale|v_scale|q_scale|kv_scale|input_scale)$")

    def __init__(self, weights: Weights, dtype: torch.dtype, device):
        self.weights, self.dtype, self.device = weights, dtype, torch.device(device)
        self.left_unread: dict[str, list[str]] = {}  # reason -> stored names a model chose not to read

    def leave_unread(self, names: list[str], reason: str) -> None:
        """Stored tensors the model knowingly does not use (e.g. DeepSeek-V3's multi-token-prediction layer):
        they do not count as unused in `check_all_read`; `finish` warns once, naming them and the reason.
        Called again with the same reason (the model built twice: dry run, then load), it replaces the list."""
        self.left_unread[reason] = sorted(names)
        for name in names:
            self.weights.mark_read(name)

    def has_tensor(self, name: str) -> bool:
        return self.weights.has_tensor(name)

    def dense_shape(self, name: str) -> tuple[int, int]:
        """(N, K) of the dense linear weight `name`, from the header; refused unless 2-D."""
        stored = self.weights.get_shape(name)
        if len(stored) != 2:
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}, expected a 2-D "
                             "[N, K] linear weight")
        return stored

    def check_float(self, name: str) -> None:
        """Refuse tensor `name` unless stored as a 2+-byte float (from the header, before reading it)."""
        dtype = self.weights.get_dtype(name)
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise ValueError(f"tensor {name!r} in {self.weights.folder} has dtype {dtype}, expected a "
                             "float16/bfloat16/float32 tensor (a quantized module read as dense? check the "
                             "quantization_config's ignore / modules_to_not_convert lists)")

    def _check_tensor_shape(self, name: str, shape: tuple) -> None:
        stored = self.weights.get_shape(name)
        if stored != tuple(shape):
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}, but config.json "
                             f"implies {list(shape)}; the config does not match the weights: fix config.json or "
                             "load the checkpoint it belongs to")

    def _read_float(self, name: str, shard: Shard | None, column: int | None, row: int | None,
                    shape: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float tensor `name` (this rank's slice, as `read_shard` takes shard/column/row) in the compute dtype on the
        device, written into `out` when given (else a new contiguous tensor). Read whole, it streams into
        `out` through a small buffer (Weights.read_into), so the stored tensor and the result never coexist;
        a slice is read and then copied. shape: the full stored shape expected."""
        stored = self.weights.get_shape(name)  # a missing tensor: KeyError naming it and the checkpoint
        if shape is not None:
            self.weights.check_shape(name, shape)
        self.check_float(name)
        if split_dim(shard, column, row) is None:
            if out is None:
                out = torch.empty(stored, dtype=self.dtype, device=self.device)
            return self.weights.read_into(name, out)
        part = read_shard(self.weights, name, shard, column, row)
        return part.to(device=self.device, dtype=self.dtype) if out is None else out.copy_(part)

    def input_scale(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The static activation scale `name` (one value: [], [1]) as a float32 [] tensor on the device, refused
        unless finite and > 0: activations are divided by it, so 0 gives inf and a negative one flips every
        code (checked on the host as read; a meta tensor in a dry run has no value). dtype: the stored dtype
        the format requires (None: any)."""
        t = self.weights.get_tensor(name, dtype=dtype).float()
        if t.numel() != 1:
            raise ValueError(f"{self.weights.folder}: tensor '{name}' has shape {list(t.shape)}, expected [] or [1] "
                             "(one static per-tensor value)")
        if not t.is_meta and not (math.isfinite(t.item()) and t.item() > 0):
            raise ValueError(f"{self.weights.folder}: tensor '{name}' holds {t.item()}; a static input scale must be "
                             "finite and > 0 (activations are divided by it): the checkpoint's calibration is broken, "
                             "re-export it or use dynamic activation scales")
        return t.reshape(()).to(self.device)

    @contextlib.contextmanager
    def dry_run(self):
        """Build the model inside this block to check the checkpoint from its headers alone: every tensor the
        model asks for must exist with the dtype and shape it expects (Weights.dry_run), and nothing is
        read; the typed weights come back as meta tensors on the "meta" device."""
        device = self.device
        self.device = torch.device("meta")
        try:
            with self.weights.dry_run():
                yield
        finally:
            self.device = device

    def finish(self) -> None:
        """Called once the model is built: format-specific warnings, then non-finite values (Weights.check_finite)
        and `check_all_read`."""
        for reason, names in self.left_unread.items():
            warnings.warn(f"{self.weights.folder}: not reading {len(names)} stored tensor(s) of {reason}: "
                          f"{listing(names)}", stacklevel=3)
        self.weights.check_finite()
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
                          f"use: {listing(harmless)}", stacklevel=3)
        if unused:
            raise ValueError(f"{self.weights.folder}: {len(unused)} stored tensor(s) were not used by any module of "
                             f"the model: {listing(unused)}; the checkpoint holds modules this model/config does not "
                             "have (or quantizes a module in a way this loader does not read), so it would run a "
                             "different model. Check config.json (layer counts, tie_word_embeddings) and the "
                             "quantization_config")


def listing(names: list[str], limit: int = 8) -> str:
    """The first `limit` names, comma-separated, and how many more (for warnings and errors)."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
