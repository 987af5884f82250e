"""config.json -> the loader for its checkpoint format: the one place that dispatches on format."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tritonq.formats.awq import AWQLoader
from tritonq.formats.base import WeightsLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.compressed_tensors import CompressedTensorsLoader
from tritonq.formats.dense import DenseLoader
from tritonq.formats.fp8 import FP8Loader
from tritonq.formats.gptq import GPTQLoader
from tritonq.formats.mxfp4 import MXFP4Loader

# Older AutoGPTQ / AutoAWQ exports keep the quantizer settings in a side file instead of
# config.json's quantization_config; the file name says which quantizer wrote it.
SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}

LOADERS = {
    "awq": AWQLoader,
    "gptq": GPTQLoader,
    "fp8": FP8Loader,
    "fbgemm_fp8": FP8Loader,
    "compressed-tensors": CompressedTensorsLoader,
    "mxfp4": MXFP4Loader,
}


def get_loader(folder: str | Path, dtype: torch.dtype, device, quantize: str | None = None,
               group_size: int = 128, *, rank: int = 0, world: int = 1) -> WeightsLoader:
    """The loader for the checkpoint in `folder`, picked from its config.json alone.

    quantize ("fp8", "fp8-mlp", "int4"; group_size for int4) quantizes a dense checkpoint on load.
    rank / world: tensor parallelism, the loader reads only this rank's shards.
    """
    folder = Path(folder)
    path = folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a checkpoint folder needs the config.json written by transformers")
    config = json.loads(path.read_text())
    q = config.get("quantization_config") or _side_file_config(folder)
    if q is not None:
        config["quantization_config"] = q
    if q is None:
        return DenseLoader(Weights(folder), config, dtype, device, quantize, group_size, rank=rank, world=world)
    method = q.get("quant_method")
    if method not in LOADERS:
        raise ValueError(f"{path}: quant_method={method!r} is not supported (supported: {sorted(LOADERS)}, "
                         "or no quantization_config for a dense checkpoint)")
    if quantize is not None:
        raise ValueError(f"quantize={quantize!r} needs a dense checkpoint, but {path} is already {method}-quantized")
    return LOADERS[method](Weights(folder), config, dtype, device, rank=rank, world=world)


def _side_file_config(folder: Path) -> dict | None:
    """quantization_config from a legacy side file (quant_method filled in from the file name)."""
    for name, method in SIDE_FILES.items():
        side = folder / name
        if side.exists():
            try:
                q = json.loads(side.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{side}: not valid JSON ({e}); re-download it") from e
            return {"quant_method": method, **q}
    return None
