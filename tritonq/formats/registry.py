"""config.json -> the loader for its checkpoint format: the one place that dispatches on format."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tritonq.formats.awq import AWQLoader
from tritonq.formats.base import WeightsLoader
from tritonq.formats.bitsandbytes import BitsAndBytesLoader
from tritonq.formats.checkpoint import Weights
from tritonq.formats.compressed_tensors import CompressedTensorsLoader
from tritonq.formats.dense import DenseLoader
from tritonq.formats.fp8 import FP8Loader
from tritonq.formats.gguf import GGUFLoader, GGUFWeights, gguf_files, read_config
from tritonq.formats.gptq import GPTQLoader
from tritonq.formats.mxfp4 import MXFP4Loader

# Older AutoGPTQ / AutoAWQ exports keep the quantizer settings in a side file instead of
# config.json's quantization_config; the file name says which quantizer wrote it.
SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}

# Formats recognised and refused with the reason and what to load instead.
# EXL2 (ExLlamaV2, config quantization_config {quant_method: exl2, bits, head_bits} from `convert.py -cf`;
# per linear P.q_weight, q_invperm, q_scale, q_scale_max, q_groups): its rows mix 2-8 bit widths per group and
# are unpacked by ExLlamaV2's CUDA extension (make_q_matrix), which cannot run here to check a reimplementation
# against, so tritonq does not guess at it.
REFUSED = {
    "exl2": "EXL2 (ExLlamaV2's mixed-bit format) is not supported: its packed rows are decoded by ExLlamaV2's CUDA "
            "extension, with no independent reference to check a reimplementation against. Load a GPTQ, AWQ, "
            "bitsandbytes or FP8 upload of the same model, or quantize the original weights with "
            "`python -m tritonq.quantize`",
}
EXL2_MARKER = ".q_groups"  # a tensor every EXL2 linear stores (older uploads have no quantization_config)

LOADERS = {
    "awq": AWQLoader,
    "bitsandbytes": BitsAndBytesLoader,
    "gptq": GPTQLoader,
    "fp8": FP8Loader,
    "fbgemm_fp8": FP8Loader,
    "compressed-tensors": CompressedTensorsLoader,
    "mxfp4": MXFP4Loader,
}


def get_loader(folder: str | Path, dtype: torch.dtype, device, quantize: str | None = None,
               group_size: int = 128, *, rank: int = 0, world: int = 1, config: dict | None = None) -> WeightsLoader:
    """The loader for the checkpoint in `folder`, picked from its config.json alone (a GGUF file or folder of
    them: GGUFLoader).

    quantize ("fp8", "fp8-mlp", "int4"; group_size for int4) quantizes a dense checkpoint on load.
    rank / world: tensor parallelism, the loader reads only this rank's shards.
    config: the checkpoint's config (config.json's dict, or a GGUF file's metadata config) when the caller has
    parsed it already, as tritonq.load has (read once per load); else read here.
    """
    files = gguf_files(folder)
    if files is not None:  # a .gguf file or a folder of them: the config is in its metadata
        weights = GGUFWeights(files)
        config = read_config(weights) if config is None else config
        return GGUFLoader(weights, config, dtype, device, quantize, rank=rank, world=world)
    folder = Path(folder)
    path = folder / "config.json"
    if config is None:
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: a checkpoint folder needs the config.json written by "
                                    "transformers")
        config = json.loads(path.read_text())
    q = config.get("quantization_config") or _side_file_config(folder)
    if q is not None:
        config = {**config, "quantization_config": q}  # the caller's dict stays as parsed
    if q is None:
        weights = Weights(folder)
        if any(name.endswith(EXL2_MARKER) for name in weights.names()):
            raise ValueError(f"{folder}: tensors named '*{EXL2_MARKER}' are EXL2's. {REFUSED['exl2']}")
        return DenseLoader(weights, config, dtype, device, quantize, group_size, rank=rank, world=world)
    method = q.get("quant_method")
    if method in REFUSED:
        raise ValueError(f"{path}: quant_method={method!r}. {REFUSED[method]}")
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
