"""tritonq: quantized LLM inference with pure-Python Triton kernels.

    model = tritonq.load("path/or/org-name")
    model.generate("Hello", max_new_tokens=20)
"""
from __future__ import annotations

from pathlib import Path

import json
import logging

import torch

from tritonq.generate import GenerationConfig, GenerationOutput, Model, ScoreOutput

__version__ = "0.1.0"
__all__ = ["load", "Model", "GenerationConfig", "GenerationOutput", "ScoreOutput"]


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


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _compute_dtype(dtype) -> torch.dtype | None:
    """A torch dtype or its name ("float16", "torch.bfloat16", ...) -> one of DTYPES, else a ValueError."""
    if dtype is None or dtype in DTYPES.values():
        return dtype
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name in DTYPES:
        return DTYPES[name]
    raise ValueError(f"dtype={dtype!r} is not a compute dtype tritonq runs in; expected one of "
                     f"{list(DTYPES)} (a torch.dtype or its name), or None for the default.")


def _check_options(max_seq_len, quantize, group_size, max_num_seqs, max_num_batched_tokens, kv_cache_gb,
                   gpu_memory_utilization, block_size) -> None:
    """Argument checks that need no file: raised before anything is read."""
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"max_seq_len={max_seq_len!r}; expected a positive int (tokens of one request: prompt + "
                         "max_new_tokens), or None for min(max_position_embeddings, 4096).")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r}; expected a positive int (sequences run at once).")
    if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}; expected an int >= max_num_seqs="
                         f"{max_num_seqs} (tokens one step computes; a decode step has one per sequence).")
    if kv_cache_gb is not None and not (isinstance(kv_cache_gb, (int, float)) and kv_cache_gb > 0):
        raise ValueError(f"kv_cache_gb={kv_cache_gb!r}; expected a positive number of GiB, or None for the default.")
    if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r}; expected a fraction in (0, 1].")
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size!r}; expected a power of two >= 16 (16, 32, 64, ...).")
    if group_size is not None and quantize != "int4":
        raise ValueError(f"group_size={group_size} applies to quantize='int4' only; got quantize={quantize!r}.")
    if group_size is not None and (not isinstance(group_size, int) or not (group_size > 0 or group_size == -1)):
        raise ValueError(f"group_size={group_size!r}; expected a positive number of input rows per group "
                         "(e.g. 32, 64, 128) or -1 for one group per output channel.")


def _model_type(folder: Path) -> str:
    """config.json's model_type, read before transformers parses it (its errors for a missing file or an
    unknown type point at the wrong fix); a ValueError names the folder, the file and what is supported."""
    from tritonq.models import MODELS, model_class

    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; a checkpoint folder needs the config.json that "
                                "transformers' save_pretrained writes next to the weights.")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path} is not a JSON object ({e}); re-download it.") from e
    if model_type is None:
        raise ValueError(f"{path} has no model_type; expected one of {sorted(MODELS)}.")
    model_class(model_type)  # unknown -> ValueError listing the supported types
    return model_type


def _tokenizer(folder: Path):
    """The folder's tokenizer, loaded before any weight so a missing one fails fast."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{folder}: cannot load a tokenizer ({type(e).__name__}: {str(e).strip()[:300]}); a "
                         "checkpoint folder needs its tokenizer files (tokenizer.json, or tokenizer.model with "
                         "sentencepiece installed, plus tokenizer_config.json): copy them from the source model.") from e


def load(name_or_path: str | Path, *, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None, revision: str | None = None, quantize: str | None = None,
         group_size: int | None = None, max_seq_len: int | None = None, tensor_parallel: int | None = None,
         max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, kv_cache_gb: float | None = None,
         gpu_memory_utilization: float = 0.9, block_size: int = 16, enable_prefix_caching: bool = True,
         cuda_graphs: bool | None = None) -> Model:
    """Load a checkpoint (local folder or Hugging Face name; dense, AWQ, GPTQ or FP8) for generation.

    device defaults to CUDA when available, else CPU. dtype (torch.float16 / bfloat16 / float32, or
    its name as a string) defaults to float32 on CPU (CPU half matmuls are slow) and to the
    checkpoint's fp16/bf16 on CUDA. quantize ("int4", "fp8", "fp8-mlp") quantizes a dense
    checkpoint while loading; group_size (int4 only, default 128; -1: one group per output
    channel) sets the input rows per int4 group. max_seq_len (default: min(max_position_embeddings,
    4096); more than max_position_embeddings is refused unless the config scales rope) bounds
    prompt + max_new_tokens of one request.
    tensor_parallel=N splits the model over N processes started by `torchrun --nproc-per-node N`
    (each reads only its shard, on GPU LOCAL_RANK); None follows the launcher, 1 opts out.

    Engine options (see tritonq.engine): at most max_num_seqs sequences run at once and one step
    computes at most max_num_batched_tokens tokens (a longer prompt is prefilled in chunks). The
    paged KV cache (blocks of block_size tokens) is sized from memory, once, here: on CUDA
    gpu_memory_utilization of the GPU's memory less what the weights and a warm-up step take; on
    CPU kv_cache_gb GiB (default: 4, or what max_num_seqs sequences of max_seq_len need if less).
    kv_cache_gb, when given, is the budget on CUDA too. enable_prefix_caching reuses the KV of
    prompt prefixes (whole blocks) that earlier requests computed.
    cuda_graphs (default: True on CUDA): decode steps run at fixed batch buckets (1, 2, 4, 8, 16, 24,
    ... up to max_num_seqs) and each bucket's step is captured as a CUDA graph here, at load (the log
    says how many and how long it took), then replayed; False runs every step eagerly (debugging).
    Every argument, config.json and the tokenizer are checked before any weight is read.
    """
    from transformers import AutoConfig

    from tritonq import distributed
    from tritonq.engine.engine import Engine
    from tritonq.engine.runner import kv_cache_blocks
    from tritonq.formats.registry import get_loader
    from tritonq.hub import resolve
    from tritonq.models import model_class

    dtype = _compute_dtype(dtype)
    _check_options(max_seq_len, quantize, group_size, max_num_seqs, max_num_batched_tokens, kv_cache_gb,
                   gpu_memory_utilization, block_size)
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs={cuda_graphs!r}; expected True, False or None (True on CUDA).")
    folder = resolve(name_or_path, revision=revision)
    cls = model_class(_model_type(folder))
    config = AutoConfig.from_pretrained(folder)
    positions = getattr(config, "max_position_embeddings", None)
    if max_seq_len is not None and positions is not None and max_seq_len > positions:
        where = (f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={positions} "
                 f"({folder / 'config.json'})")
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            raise ValueError(f"{where}: positions past it were never trained and the config declares no rope "
                             f"scaling to extend them; pass max_seq_len <= {positions}.")
        logging.getLogger("tritonq").warning("%s; allowed because the config declares %r rope scaling, but quality "
                                             "past the trained length is not guaranteed.", where, rope_type)
    tokenizer = _tokenizer(folder)
    device = torch.device(device) if device is not None else distributed.default_device()
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; the device is {device}. Leave cuda_graphs unset "
                         "(or False): other devices run every step eagerly.")
    rank, world = distributed.init_tensor_parallel(tensor_parallel, device)
    if world > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"model_type {config.model_type!r} does not support tensor parallelism yet; "
                         "load it with tensor_parallel=1")
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        stored_fp16 = str(stored).removeprefix("torch.") == "float16"  # a dtype or a string, by version
        dtype = torch.float32 if device.type == "cpu" else torch.float16 if stored_fp16 else torch.bfloat16
    loader = get_loader(folder, dtype, device, quantize, 128 if group_size is None else group_size,
                        rank=rank, world=world)
    max_seq_len = max_seq_len or min(config.max_position_embeddings, 4096)
    with loader.weights.progress(enabled=rank == 0):  # only rank 0 prints
        model = cls(config, loader, dtype, device, max_seq_len=max_seq_len)  # rope tables sized once for it
    loader.finish()  # every stored tensor used by some module, or an error naming those that were not
    num_blocks = kv_cache_blocks(model, block_size=block_size, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, kv_cache_gb=kv_cache_gb,
                                 gpu_memory_utilization=gpu_memory_utilization, world=world)
    engine = Engine(model, tokenizer, _eos_token_ids(folder, config, tokenizer), num_blocks=num_blocks,
                    block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    enable_prefix_caching=enable_prefix_caching, max_seq_len=max_seq_len, world=world)
    if device.type == "cuda":  # fixed-shape decode buckets; graphs captured after the process group exists
        engine.runner.use_static_decode(max_num_seqs, cuda_graphs=cuda_graphs is not False)
    return Model(model, tokenizer, engine, max_seq_len, rank, world)
