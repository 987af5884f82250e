"""tritonq: quantized LLM inference with pure-Python Triton kernels.

    model = tritonq.load("path/or/org-name")
    model.generate("Hello", max_new_tokens=20)
"""
from __future__ import annotations

from pathlib import Path

import torch

from tritonq.generate import GenerationConfig, GenerationOutput, Model

__version__ = "0.1.0"
__all__ = ["load", "Model", "GenerationConfig", "GenerationOutput"]


def _eos_token_ids(folder: Path, config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (checkpoints disagree)."""
    from transformers import GenerationConfig as HFGenerationConfig
    found = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    if (folder / "generation_config.json").exists():
        found.append(HFGenerationConfig.from_pretrained(folder).eos_token_id)
    ids = set()
    for value in found:
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    return ids


def load(name_or_path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
         revision: str | None = None, quantize: str | None = None, max_batch: int = 8,
         max_seq_len: int | None = None, tensor_parallel: int | None = None) -> Model:
    """Load a checkpoint (local folder or Hugging Face name; dense, AWQ, GPTQ or FP8) for generation.

    device defaults to CUDA when available, else CPU. dtype defaults to float32 on CPU (CPU half
    matmuls are slow) and to the checkpoint's fp16/bf16 on CUDA. quantize ("int4", "fp8", ...)
    quantizes a dense checkpoint while loading. The KV cache for max_batch sequences of
    max_seq_len tokens (default: min(max_position_embeddings, 4096)) is allocated here, once.
    tensor_parallel=N splits the model over N processes started by `torchrun --nproc-per-node N`
    (each reads only its shard, on GPU LOCAL_RANK); None follows the launcher, 1 opts out.
    """
    from transformers import AutoConfig, AutoTokenizer

    from tritonq import distributed
    from tritonq.formats.registry import get_loader
    from tritonq.hub import resolve
    from tritonq.models import model_class

    folder = resolve(name_or_path, revision=revision)
    device = torch.device(device) if device is not None else distributed.default_device()
    rank, world = distributed.init_tensor_parallel(tensor_parallel, device)
    config = AutoConfig.from_pretrained(folder)
    cls = model_class(config.model_type)
    if world > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"model_type {config.model_type!r} does not support tensor parallelism yet; "
                         "load it with tensor_parallel=1")
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        stored_fp16 = str(stored).removeprefix("torch.") == "float16"  # a dtype or a string, by version
        dtype = torch.float32 if device.type == "cpu" else torch.float16 if stored_fp16 else torch.bfloat16
    loader = get_loader(folder, dtype, device, quantize, rank=rank, world=world)
    with loader.weights.progress(enabled=rank == 0):  # only rank 0 prints
        model = cls(config, loader, dtype, device)
    loader.finish()  # every stored tensor used by some module, or an error naming those that were not
    tokenizer = AutoTokenizer.from_pretrained(folder)
    max_seq_len = max_seq_len or min(config.max_position_embeddings, 4096)
    return Model(model, tokenizer, max_batch, max_seq_len, _eos_token_ids(folder, config, tokenizer), rank, world)
