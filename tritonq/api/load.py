"""`load()`: a checkpoint folder or hub name in, a ready `Model` out, every argument and file checked
before any weight is read (tritonq.load re-exports it).
"""
from __future__ import annotations

import copy
import dataclasses
import errno
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tritonq.config import EngineConfig
    from tritonq.api.model import Model

def _read_json(path: Path) -> dict:
    """A JSON object file of the checkpoint; a ValueError says what is wrong with it (not JSON, not an object)."""
    try:
        value = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file ({e}); re-download it or fix it.") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object (found a {type(value).__name__}); re-download it or fix it.")
    return value


# The files a checkpoint folder holds that tritonq reads (hub.SMALL_FILES and the weights).
CHECKPOINT_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.safetensors")


def _check_files(folder: Path) -> None:
    """Every checkpoint file in folder can be opened, before any is parsed: a symlink loop, a dangling
    link or an unreadable file is named as such (later, they look like a missing config.json, a missing
    sentencepiece or a corrupt download)."""
    for pattern in CHECKPOINT_FILES:
        for path in sorted(folder.glob(pattern)):
            try:
                path.stat()
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError(f"{path} is a symlink loop (following its links leads back to it, never to a "
                                     "file); point the link at the real file.") from e
                if e.errno == errno.ENOENT:
                    raise FileNotFoundError(f"{path} is a symlink to {os.readlink(path)!r}, which does not exist; "
                                            "download the file it points at or remove the link.") from e
                raise
            if path.is_file():
                try:
                    open(path, "rb").close()
                except PermissionError as e:
                    raise PermissionError(f"{path}: permission denied ({e.strerror}); make the file readable by this "
                                          "user (e.g. chmod a+r).") from e


def _eos_token_ids(folder: Path, config: dict, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (checkpoints disagree); read before
    the weights, so a broken generation_config.json fails fast."""
    found = {folder / "config.json": config.get("eos_token_id"), f"the tokenizer of {folder}": tokenizer.eos_token_id}
    path = folder / "generation_config.json"
    if path.exists():
        found[path] = _read_json(path).get("eos_token_id")
    ids = set()
    for where, value in found.items():
        for i in value if isinstance(value, (list, tuple)) else [] if value is None else [value]:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"{where}: eos_token_id={value!r} is not a token id; expected a non-negative int "
                                 "or a list of them.")
            ids.add(i)
    return ids


def _check_tokenizer(folder: Path, config: dict, tokenizer, eos_ids: set[int]) -> None:
    """Warnings for a tokenizer that does not fit the model (not errors: such checkpoints exist and run)."""
    log = logging.getLogger("tritonq")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:  # smaller is normal: embeddings padded for speed
        log.warning("%s: the tokenizer has %d tokens but config.json has vocab_size=%d: the model has no embedding "
                    "for ids %d..%d, so a prompt that encodes to any of them is refused.", folder, len(tokenizer),
                    vocab, vocab, len(tokenizer) - 1)
    if not eos_ids:
        log.warning("%s: no EOS token id in config.json, generation_config.json or the tokenizer: generation "
                    "runs until max_new_tokens or a stop string.", folder)


# compile=None on CPU: whether the decode step is compiled by default (measured, see load's docstring).
CPU_COMPILE = False
DTYPES = ("float16", "bfloat16", "float32")  # the compute dtypes, by torch name


def _compute_dtype(dtype) -> torch.dtype | None:
    """A torch dtype or its name ("float16", "torch.bfloat16", ...) -> one of DTYPES, else a ValueError."""
    import torch

    if dtype is None or dtype in [getattr(torch, name) for name in DTYPES]:
        return dtype
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name in DTYPES:
        return getattr(torch, name)
    raise ValueError(f"dtype={dtype!r} is not a compute dtype tritonq runs in; expected one of "
                     f"{list(DTYPES)} (a torch.dtype or its name), or None for the default.")


def _capture_graphs(cuda_graphs: bool | None, world: int) -> bool:
    """Whether a CUDA model captures its decode steps: cuda_graphs when given; by default yes on one GPU and
    not under tensor parallelism, whose decode step would capture NCCL collectives (all-reduce, all-gather)
    inside the graphs, which no multi-GPU run has checked yet (the log says so)."""
    if cuda_graphs is not None:
        return cuda_graphs
    if world > 1:
        logging.getLogger("tritonq").info(
            "CUDA graphs off by default under tensor parallelism (world %d): capturing NCCL collectives is not "
            "checked on a multi-GPU machine yet; decode steps run eagerly at fixed batch buckets. Pass "
            "cuda_graphs=True to capture anyway.", world)
        return False
    return True


def _check_device_dtype(dtype: torch.dtype | None, device: torch.device) -> None:
    """On CUDA, a ValueError unless dtype (None: the default) is one the GPU kernels run in there
    (`kernels.common.gpu_compute_dtypes`): fp32 never, bf16 from sm_80 on."""
    import torch

    from tritonq.kernels.common import compute_capability, gpu_compute_dtypes

    if device.type != "cuda" or dtype is None:
        return
    cc = compute_capability(device)
    assert cc is not None  # a CUDA device has one
    accepted = gpu_compute_dtypes(cc)
    if dtype in accepted:
        return
    names = " or ".join(f"dtype=torch.{str(d).removeprefix('torch.')}" for d in accepted)
    if dtype == torch.float32:
        why = ("the GPU kernels run fp16/bf16 only: fp32 tiles need more shared memory than a GPU block has "
               "and fp32 GEMMs run without tensor cores")
        fix = f"load with {names}, or on device='cpu' for fp32"
    else:  # bf16 below sm_80
        why = f"sm_{cc} (pre-Ampere: T4, V100) has no bf16 arithmetic (torch would emulate it, slowly)"
        fix = f"load with {names} (a bf16 checkpoint is cast on load)"
    raise ValueError(f"dtype={dtype} on {device} (sm_{cc}) is not supported: {why}; {fix}.")


def _default_dtype(stored, device: torch.device) -> torch.dtype:
    """The compute dtype when load() is given none, said in the log: on CPU bf16 where the CPU has native
    bf16 (as vLLM's CPU build), else fp32; on CUDA the checkpoint's (`stored`: config.json's dtype, a
    torch.dtype or its name) fp16, else bf16; but fp16 before sm_80, which has no bf16 arithmetic."""
    import torch

    from tritonq.kernels.common import compute_capability, gpu_compute_dtypes

    if device.type == "cpu":
        native = cpu_has_native_bf16()
        logging.getLogger("tritonq").info(
            "CPU compute dtype: %s (%s); pass dtype= to choose", "bfloat16" if native else "float32",
            "this CPU has AVX512-BF16 / AMX: native bf16 GEMMs" if native else
            "no AVX512-BF16 or AMX on this CPU: bf16 would be emulated, slower than fp32")
        return torch.bfloat16 if native else torch.float32
    stored_fp16 = str(stored).removeprefix("torch.") == "float16"  # a dtype or a string, by version
    dtype = torch.float16 if stored_fp16 else torch.bfloat16
    cc = compute_capability(device)  # None off CUDA
    if cc is not None and dtype not in gpu_compute_dtypes(cc):
        dtype = torch.float16
        logging.getLogger("tritonq").warning(
            "%s is sm_%d (no bf16 arithmetic before sm_80): computing in float16, not the checkpoint's %s; "
            "activations past fp16's range (65504) would overflow.", device, cc, stored)
    return dtype


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 dot products or AMX-BF16 tiles), as torch's
    oneDNN GEMMs use them: there bf16 runs ~2x+ faster than fp32 (half the bytes, native products);
    without them torch emulates bf16 through fp32 conversions and it is slower than fp32."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _kv_cache_layout(layout, kv_cache_dtype: str, weights, raw_config: dict, folder: Path):
    """The model's KVLayout stored as kv_cache_dtype; fp8 takes its per-layer scales from the checkpoint's
    model.layers.N.self_attn.k_scale / v_scale (one value each) where it has them, else 1.0, as vLLM does."""
    import dataclasses

    log = logging.getLogger("tritonq")
    scheme = (raw_config.get("quantization_config") or {}).get("kv_cache_scheme")
    if kv_cache_dtype == "auto":
        if scheme:
            log.info("the checkpoint has a kv_cache_scheme; kv_cache_dtype='auto' keeps the KV cache in the model "
                     "dtype (pass kv_cache_dtype='fp8' to use its scales)")
        return layout
    if kv_cache_dtype == "int8":
        log.info("KV cache: int8, one scale per token and kv head (absmax / 127, computed as K/V are written)")
        return dataclasses.replace(layout, cache_dtype="int8")
    if scheme and (scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8
                   or scheme.get("strategy", "tensor") != "tensor"):
        raise ValueError(f"{folder / 'config.json'}: kv_cache_scheme {scheme} is not fp8 per tensor; "
                         "kv_cache_dtype='fp8' takes float 8-bit scales per tensor only. Use kv_cache_dtype='int8' "
                         "(scales computed per token and head) or 'auto'.")
    scales, found = [], 0
    for layer in range(layout.num_layers):
        pair = []
        for which in ("k_scale", "v_scale"):
            name = f"model.layers.{layer}.self_attn.{which}"
            value = 1.0
            if weights.has_tensor(name):
                tensor = weights.get_tensor(name).float()
                if tensor.numel() != 1 or not (math.isfinite(tensor.item()) and tensor.item() > 0):
                    raise ValueError(f"{folder}: {name} is {tuple(tensor.shape)} {tensor.flatten()[:4].tolist()}; "
                                     "kv_cache_dtype='fp8' expects one positive finite scale per tensor.")
                value, found = tensor.item(), found + 1
            pair.append(value)
        scales.append(tuple(pair))
    if found:
        log.info("KV cache: fp8 e4m3 with the checkpoint's per-tensor scales (self_attn.k_scale / v_scale, %d of "
                 "%d)%s", found, 2 * layout.num_layers, "; MLA's latent takes k_scale" if layout.v_in_k else "")
    else:
        log.info("KV cache: fp8 e4m3, scale 1.0 (the checkpoint has no self_attn.k_scale / v_scale; vLLM's default): "
                 "K/V values beyond +-448 saturate")
    return dataclasses.replace(layout, cache_dtype="fp8", fp8_scales=tuple(scales))


def _read_config(folder: Path) -> dict:
    """config.json as a dict, read before transformers parses it (its errors for a missing file, an unknown
    type or a zero head count point at the wrong fix): model_type must be supported and the sizes and
    constants the model is built from must be possible (`_check_config`); errors name the key and the file."""
    from tritonq.models import MODELS, model_class

    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; a checkpoint folder needs the config.json that "
                                "transformers' save_pretrained writes next to the weights (a GGUF checkpoint: pass "
                                "the .gguf file, or gguf_file= naming it in the folder or hub repo).")
    config = _read_json(path)
    if config.get("model_type") is None:
        raise ValueError(f"{path} has no model_type; expected one of {sorted(MODELS)}.")
    model_class(config["model_type"])  # unknown -> ValueError listing the supported types
    _check_config(config, path)
    return config


# Keys of config.json that count something the model has at least one of.
POSITIVE_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "max_position_embeddings", "intermediate_size")


def _check_config(config: dict, path: Path) -> None:
    """Refuse config values no model can have (a ValueError naming the key, the value and the file). Keys that
    are absent take transformers' defaults, which are valid."""
    def refuse(key, value, expected):
        raise ValueError(f"{path}: {key}={value!r}; expected {expected}. The config is broken: fix it or "
                         "re-download it.")

    for key in POSITIVE_INT_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            refuse(key, value, "a positive int")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads} (each KV head serves "
               "a whole group of query heads)")
    for key, value in config.items():  # rms_norm_eps, layer_norm_epsilon, ...: a norm divides by sqrt(var + eps)
        if key.endswith(("_eps", "_epsilon")) and value is not None and not _positive(value):
            refuse(key, value, "a positive finite number (e.g. 1e-5 or 1e-6)")
    thetas = {"rope_theta": config.get("rope_theta")}
    for key in ("rope_parameters", "rope_scaling"):  # where newer / other exporters keep it
        if isinstance(config.get(key), dict):
            thetas[f"{key}.rope_theta"] = config[key].get("rope_theta")
            _check_rope(config[key], key, refuse)
    for key, theta in thetas.items():
        if theta is not None and not _positive(theta):
            refuse(key, theta, "a positive finite number (the rope base, e.g. 10000.0 or 500000.0)")
    attn = config.get("attn_config")  # MPT's
    if not isinstance(attn, dict):
        attn = {}
    constants = {"routed_scaling_factor": config.get("routed_scaling_factor"),  # DeepSeek: routed experts' weight
                 "swiglu_alpha": config.get("swiglu_alpha"), "swiglu_limit": config.get("swiglu_limit"),  # gpt-oss
                 "attn_config.softmax_scale": attn.get("softmax_scale")}
    for key, value in constants.items():
        if value is not None and not _positive(value):
            refuse(key, value, "a positive finite number")
    for key, value in {"clip_qkv": config.get("clip_qkv"), "attn_config.clip_qkv": attn.get("clip_qkv")}.items():
        if value is not None and not (_is_number(value) and math.isfinite(value) and value >= 0):
            refuse(key, value, "a positive finite bound on |q|, |k|, |v| (0 or null: no clipping)")
    _check_routing(config, refuse)


def _check_rope(rope: dict, where: str, refuse) -> None:
    """The rope scaling constants a table is computed from (kernels.norm_rope): a factor <= 0 divides by zero
    or flips frequencies; llama3's smoothing divides by high_freq_factor - low_freq_factor."""
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow"):
        if rope.get(key) is not None and not _positive(rope[key]):
            refuse(f"{where}.{key}", rope[key], "a positive finite number")
    for key in ("mscale", "mscale_all_dim"):  # yarn's 0.1 * mscale * ln(factor) + 1: 0 means no scaling
        if rope.get(key) is not None and not (_is_number(rope[key]) and math.isfinite(rope[key]) and rope[key] >= 0):
            refuse(f"{where}.{key}", rope[key], "a finite number >= 0")
    original = rope.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        refuse(f"{where}.original_max_position_embeddings", original, "a positive int")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    if low is not None and high is not None and not high > low:
        refuse(f"{where}.high_freq_factor", high, f"a number > low_freq_factor={low} (llama3 rope divides by "
               "their difference)")


# config.json's count of routed experts, by the name each architecture uses (Qwen-MoE, Mixtral / gpt-oss, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_routing(config: dict, refuse) -> None:
    """MoE routing constants against the expert count E: 1 <= num_experts_per_tok <= E; with grouped routing
    (DeepSeek; not topk_method "greedy", which ignores groups) n_group divides E, 1 <= topk_group <= n_group
    and top-k fits in the kept groups: what kernels.moe.routing would refuse on every request. A key left out
    takes transformers' default for the architecture and is not checked against the others."""
    key = next((k for k in EXPERT_COUNT_KEYS if config.get(k) is not None), None)
    E = config.get(key) if key else None
    if key and (isinstance(E, bool) or not isinstance(E, int) or E < 0):
        refuse(key, E, "a non-negative int (the number of routed experts)")
    top_k = config.get("num_experts_per_tok")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or (E and top_k > E)):
        refuse("num_experts_per_tok", top_k, f"an int in 1..{key}={E}" if E else "a positive int")
    n_group, topk_group = config.get("n_group"), config.get("topk_group")
    if not E or config.get("topk_method") == "greedy":
        return
    if n_group is not None and (isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or E % n_group):
        refuse("n_group", n_group, f"a positive divisor of {key}={E} (experts split into equal groups)")
    if topk_group is not None and (isinstance(topk_group, bool) or not isinstance(topk_group, int) or topk_group < 1
                                   or (n_group is not None and topk_group > n_group)):
        refuse("topk_group", topk_group, "a positive int" + (f" <= n_group={n_group}" if n_group is not None else "")
               + " (the groups kept per token)")
    if None not in (n_group, topk_group, top_k) and top_k > topk_group * (E // n_group):
        refuse("num_experts_per_tok", top_k, f"at most topk_group * {key} / n_group = {topk_group * (E // n_group)} "
               "(the experts in the kept groups)")


def _positive(value) -> bool:
    """A finite number > 0 (not a bool, a string or NaN)."""
    return _is_number(value) and math.isfinite(value) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tokenizer(folder: Path, config):
    """The folder's tokenizer, loaded before any weight so a missing one fails fast (config: the transformers config
    made from config.json, which AutoTokenizer would otherwise read again)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, config=config)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{folder}: cannot load a tokenizer ({type(e).__name__}: {str(e).strip()[:300]}); a "
                         "checkpoint folder needs its tokenizer files (tokenizer.json, or tokenizer.model with "
                         "sentencepiece installed, plus tokenizer_config.json): copy them from the source model.") from e


def _load_draft(name_or_path, tokenizer, vocab_size: int, *, dtype, device, max_seq_len: int, block_size: int,
                batch_invariant: bool):
    """The draft model (nn.Module) of draft speculation, loaded like the target (same dtype and device, no graphs,
    one sequence's throwaway cache, the target's batch_invariant); ValueError unless its tokenizer has the target's
    vocabulary."""
    draft = load(name_or_path, dtype=dtype, device=device, max_seq_len=max_seq_len, max_num_seqs=1,
                 max_num_batched_tokens=block_size, block_size=block_size, tensor_parallel=1, cuda_graphs=False,
                 compile=False, batch_invariant=batch_invariant)
    if draft.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the draft model {name_or_path} has a different tokenizer vocabulary ({len(draft.tokenizer)} "
                         f"tokens) from the target's ({len(tokenizer)}); a draft must share the target's tokenizer.")
    if draft.model.config.vocab_size < vocab_size:
        raise ValueError(f"the draft model {name_or_path} has vocab_size={draft.model.config.vocab_size} < the target's "
                         f"{vocab_size}; a draft must cover the target's vocabulary.")
    return draft.model  # its Engine (and that cache) is dropped: the proposer gives it its own


def load(name_or_path: str | Path, *, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None, revision: str | None = None, threads: int | None = None,
         warm_up: bool | None = None, gguf_file: str | None = None, config: EngineConfig | None = None,
         **engine_options) -> Model:
    """Load a checkpoint (local folder or Hugging Face name; dense, AWQ, GPTQ or FP8; or GGUF: a .gguf file, a
    folder of gguf-split shards, or a hub id with gguf_file= naming the file in it, docs/gguf.md) for generation.

    device defaults to CUDA when available, else CPU. dtype (torch.float16 / bfloat16 / float32, or
    its name as a string) defaults on CPU to bfloat16 where the CPU has AVX512-BF16 or AMX (native
    bf16 GEMMs) and float32 elsewhere (emulated bf16 is slower; the log says which), and to the
    checkpoint's fp16/bf16 on CUDA, fp16 before sm_80 (T4: no bf16; logged). On CUDA float32 is
    refused, and bfloat16 before sm_80 (`kernels.common.gpu_compute_dtypes`). quantize ("int4", "fp8", "fp8-mlp") quantizes a dense
    checkpoint while loading; group_size (int4 only, default 128; -1: one group per output
    channel) sets the input rows per int4 group. max_seq_len (default: min(max_position_embeddings,
    4096); more than max_position_embeddings is refused unless the config scales rope) bounds
    prompt + max_new_tokens of one request.
    tensor_parallel=N splits the model over N processes started by `torchrun --nproc-per-node N`
    (each reads only its shard, on GPU LOCAL_RANK); None follows the launcher, 1 opts out. Across machines, start
    torchrun on each with --nnodes and a shared --rdzv-endpoint (docs/tensor_parallel.md). expert_parallel=True
    (MoE models under tensor parallelism): each rank holds E/N whole routed experts instead of every expert's 1/N slice.

    Engine options (see tritonq.engine) are tritonq.config.EngineConfig's fields, given as keyword arguments or
    whole as config= (keywords replace its fields); each default is EngineConfig's. At most max_num_seqs
    sequences run at once and one step computes at most max_num_batched_tokens tokens (a longer prompt is
    prefilled in chunks). The
    paged KV cache (blocks of block_size tokens) is sized from memory, once, here: on CUDA
    gpu_memory_utilization of the GPU's memory less what the weights, the largest prefill and decode steps
    (measured by a warm-up) and the CUDA graphs take; on CPU kv_cache_gb GiB (default: 4); on both at
    most what max_num_seqs sequences of max_seq_len need.
    kv_cache_gb, when given, is the budget on CUDA too. enable_prefix_caching reuses the KV of
    prompt prefixes (whole blocks) that earlier requests computed.
    kv_cache_dtype: "auto" stores K/V in the compute dtype; "fp8" as float8_e4m3fn with one scale per layer for
    k and for v (the checkpoint's self_attn.k_scale / v_scale, e.g. llm-compressor's kv_cache_scheme; 1.0 where
    it has none, as vLLM does: values then saturate at +-448); "int8" with one scale per token and kv head
    (absmax / 127, written with the values). 8-bit caches hold ~2x (fp16/bf16) or ~4x (fp32) the tokens in the
    same memory; the load log says how many sequences fit. Outputs change by the rounding (docs/benchmarks.md:
    quantization quality).
    cuda_graphs (default: True on one CUDA GPU, False under tensor parallelism until a multi-GPU run has
    checked NCCL collectives inside captured graphs): decode steps run at fixed batch buckets (1, 2, 4, 8, 16, 24,
    ... up to max_num_seqs) and each bucket's step is captured as a CUDA graph here, at load (the log
    says how many and how long it took), then replayed; False runs every step eagerly (debugging).
    compile (CPU, Llama family; default CPU_COMPILE, off: a compile per bucket for a small gain, see docs/engine.md):
    decode steps run at the same buckets, each torch.compile'd on its first use (tritonq.engine.compiled;
    the log says how long); False runs them eagerly.
    speculative: speculative decoding (tritonq.engine.speculative; greedy outputs unchanged, sampled ones keep
    the target's distribution), a dict or JSON string: {"method": "ngram", "num_tokens": k, "min_n": 1,
    "max_n": 4} proposes the continuation of the latest earlier match of the last n tokens (prompt lookup);
    {"method": "draft", "model": PATH_OR_ID, "num_tokens": k} runs a smaller model with the same tokenizer k
    tokens ahead (loaded here with the same dtype and device, with its own paged cache of as many blocks, paid
    from the same KV budget). Steps that verify
    proposals run eagerly (on CUDA, outside the decode graphs). Requests with a repetition, presence or frequency
    penalty decode without it. Counters: Model.engine.speculation, GenerationOutput.acceptance_rate / mean_accepted_length.
    warm_up (CPU, 4-bit weights): inductor's int4 GEMM template, which prefills above 8 rows run, is compiled
    per weight (seconds each on a busy machine): True compiles every weight's now, so no request waits for it (a
    server, a chat); False never compiles it (a one-shot command: its prefill runs the eager kernel); None
    compiles each weight's on its first prefill above 8 rows.
    threads: CPU threads of this process (torch.set_num_threads; the C kernels run on the same OpenMP team);
    None keeps torch's (the physical cores). On cores other jobs share, fewer run faster (docs/cli_behaviour.md).
    batch_invariant: every kernel sums each row in one fixed order whatever else is in the batch (docs/
    batch_invariance.md), so greedy and seeded outputs are the same alone, batched with any other requests, chunked
    or preempted, in bf16 / fp16 too (without it only fp32 comes close: 16-bit results can change with the batch,
    within their rounding). CPU: every linear on tritonq's C loop (needs a C compiler), 4-bit weights on torch's
    eager int4 kernel; CUDA: dense linears on one Triton GEMM instead of cuBLAS, the quantized GEMMs at one launch
    config for every batch (no split-K), decode attention's splits fixed. Slower: the docs page has the cost. Not
    with compile=True.
    Every argument, the checkpoint's files (readable, no symlink loops), config.json, generation_config.json
    and the tokenizer are checked before any weight is read, and so is every tensor the model asks for
    (presence, dtype, shape: the model is first built against the safetensors headers alone, on the meta
    device). NaN / inf in any float tensor read is refused once the weights are read, naming the tensors.
    """
    from tritonq.config import EngineConfig, check_int

    if threads is not None:
        check_int("threads", threads, 1)
    if warm_up not in (None, True, False):
        raise TypeError(f"warm_up={warm_up!r}; expected True, False or None.")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_options) - names)
    if unknown:
        raise TypeError(f"load() got unknown options {unknown}; the engine options are EngineConfig's fields: "
                        f"{', '.join(sorted(names))}.")
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"config is a {type(config).__name__}; expected a tritonq.config.EngineConfig (or pass its "
                        "fields as keyword arguments).")
    options = dataclasses.replace(config or EngineConfig(), **engine_options)  # checks them all
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    model = _load(name_or_path, options, dtype=dtype, device=device, revision=revision, gguf_file=gguf_file)
    if warm_up is not None:
        from tritonq.kernels.cpu import lowbit as cpu_lowbit
        # layers.Linear's CPU forms: in Prepared (GGUF's 4-bit types) or in the Int4Gemm it holds (Int4Weight)
        prepared = [m.prepared for m in model.model.modules() if hasattr(m, "prepared")]
        cpu_forms = [p.cpu for p in prepared] + [getattr(p.gemm, "cpu", None) for p in prepared]
        cpu_lowbit.settle_templates([p for p in cpu_forms if isinstance(p, cpu_lowbit.CPUInt4Weight)],
                                    compile=warm_up)
    return model


def _batch_invariant_forward(forward):
    """forward run in the batch-invariant mode (kernels.batch_invariant_mode), wherever it is called from: engine
    steps, CUDA graph capture, scoring."""
    from tritonq.kernels import batch_invariant_mode

    @functools.wraps(forward)
    def invariant(*args, **kwargs):
        with batch_invariant_mode():
            return forward(*args, **kwargs)
    return invariant


def _checkpoint(name_or_path: str | Path, revision: str | None, gguf_file: str | None):
    """(folder or GGUF file, config.json's dict, transformers config, tokenizer) of a checkpoint, each checked
    before any weight is read. A GGUF checkpoint carries all three in its metadata (formats/gguf.py)."""
    from transformers import AutoConfig

    from tritonq.formats import gguf
    from tritonq.api.hub import resolve, resolve_gguf

    path = resolve_gguf(name_or_path, gguf_file, revision) if gguf_file is not None else name_or_path
    files = gguf.gguf_files(path)
    if files is None:
        folder = resolve(name_or_path, revision=revision)
        _check_files(folder)
        raw_config = _read_config(folder)
        # transformers' config made from the dict read once (not from the file again); an image-text model's
        # config: its language model's (get_text_config() is the config itself otherwise)
        config = AutoConfig.for_model(**copy.deepcopy(raw_config))
        return folder, raw_config, config.get_text_config(), _tokenizer(folder, config)
    weights = gguf.GGUFWeights(files)
    raw_config = gguf.read_config(weights)
    _check_config(raw_config, weights.folder)
    config = AutoConfig.for_model(**copy.deepcopy(raw_config))
    return weights.folder, raw_config, config, gguf.tokenizer(weights)


def _load(name_or_path: str | Path, options: EngineConfig, *, dtype, device, revision, gguf_file=None) -> Model:
    """load() with its engine options checked (EngineConfig); the dtype, device, files and model checks here."""
    import torch

    from tritonq import distributed
    from tritonq.engine.engine import Engine
    from tritonq.engine.kv_sizing import kv_cache_blocks
    from tritonq.engine.speculative import make_proposer
    from tritonq.formats.registry import get_loader
    from tritonq.api.model import Model
    from tritonq.kernels import batch_invariant_mode
    from tritonq.kernels.cpu import native as cpu_native
    from tritonq.models import model_class
    from tritonq.models.common import rope_parameters

    o = options
    max_seq_len, block_size, max_num_seqs, max_num_batched_tokens = (o.max_seq_len, o.block_size, o.max_num_seqs,
                                                                     o.max_num_batched_tokens)
    cuda_graphs, compile, expert_parallel, speculative = o.cuda_graphs, o.compile, o.expert_parallel, o.speculative
    dtype = _compute_dtype(dtype)
    device = distributed.resolve_device(device)
    _check_device_dtype(dtype, device)
    folder, raw_config, config, tokenizer = _checkpoint(name_or_path, revision, gguf_file)
    cls = model_class(raw_config["model_type"])
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None)  # MPT's name
    if max_seq_len is not None and positions is not None and max_seq_len > positions:
        where = (f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={positions} "
                 f"({folder if folder.is_file() else folder / 'config.json'})")  # a GGUF file holds its config
        rope = rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            raise ValueError(f"{where}: positions past it were never trained and the config declares no rope "
                             f"scaling to extend them; pass max_seq_len <= {positions}.")
        logging.getLogger("tritonq").warning("%s; allowed because the config declares %r rope scaling, but quality "
                                             "past the trained length is not guaranteed.", where, rope_type)
    eos_ids = _eos_token_ids(folder, raw_config, tokenizer)
    _check_tokenizer(folder, raw_config, tokenizer, eos_ids)
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; the device is {device}. Leave cuda_graphs unset "
                         "(or False): other devices run every step eagerly.")
    if compile and device.type != "cpu":
        raise ValueError(f"compile=True compiles the CPU decode step; the device is {device}. On CUDA decode steps "
                         "run as CUDA graphs (cuda_graphs); leave compile unset.")
    if compile and not getattr(cls, "supports_compile", False):
        raise ValueError(f"model_type {raw_config['model_type']!r} cannot be compiled yet (its step reads device "
                         "values on the host, e.g. MoE routing); load it with compile=False.")
    rank, world = distributed.init_tensor_parallel(o.tensor_parallel, device)
    if compile and world > 1:
        raise ValueError(f"compile=True with tensor_parallel={world}: the compiled step has no collectives yet; "
                         "load it with compile=False.")
    if speculative is not None and world > 1:
        raise ValueError(f"speculative decoding with tensor_parallel={world} is not supported yet; load it with "
                         "tensor_parallel=1 or without speculative.")
    if world > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"model_type {config.model_type!r} does not support tensor parallelism yet; "
                         "load it with tensor_parallel=1")
    if expert_parallel and not getattr(cls, "supports_expert_parallel", False):
        raise ValueError(f"expert_parallel=True needs a mixture-of-experts model; model_type {config.model_type!r} "
                         "has no routed experts: leave expert_parallel off")
    build = {"expert_parallel": True} if expert_parallel else {}  # models without experts take no such argument
    if dtype is None:
        dtype = _default_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None), device)
    loader = get_loader(folder, dtype, device, o.quantize, 128 if o.group_size is None else o.group_size,
                        rank=rank, world=world, config=raw_config)
    if max_seq_len is None:
        assert positions is not None, "every model config has max_position_embeddings (transformers' default)"
        max_seq_len = min(positions, 4096)
    if o.batch_invariant and device.type == "cpu" and cpu_native.library() is None:
        raise ValueError("batch_invariant=True on CPU runs the linears and attention on tritonq's C kernels "
                         "(tritonq/kernels/cpu/csrc/), which could not be built (the log says why): install a C "
                         "compiler (gcc or clang, or set $CC), or load without batch_invariant.")
    with loader.dry_run():  # every tensor the model asks for, checked from the headers before any is read
        cls(config, loader, dtype, torch.device("meta"), max_seq_len=max_seq_len, **build)
    # the CPU linears keep the forms their mode runs (kernels/cpu/dense.py), made while the model is built
    with loader.weights.progress(enabled=rank == 0), batch_invariant_mode(o.batch_invariant):  # only rank 0 prints
        model = cls(config, loader, dtype, device, max_seq_len=max_seq_len, **build)  # rope tables sized once
    if o.batch_invariant:
        model.forward = _batch_invariant_forward(model.forward)
    # before finish(): fp8 reads the checkpoint's k_scale / v_scale, which then count as used
    model.kv_layout = _kv_cache_layout(model.kv_layout, o.kv_cache_dtype, loader.weights, raw_config, folder)
    loader.finish()  # no NaN/inf read, every stored tensor used by some module; else an error naming them
    draft = None
    if speculative is not None and speculative.method == "draft":  # before the KV sizing: its weights count as used
        draft = _load_draft(speculative.model, tokenizer, config.vocab_size, dtype=dtype, device=device,
                            max_seq_len=max_seq_len, block_size=block_size, batch_invariant=o.batch_invariant)
    capture = device.type == "cuda" and _capture_graphs(cuda_graphs, world)
    engine_config = dataclasses.replace(o, max_seq_len=max_seq_len)  # resolved: the engine sizes by it
    # the draft's cache has as many blocks (it holds the running sequences + k each)
    draft_bytes = 0 if draft is None else draft.kv_layout.bytes_per_token(draft.dtype)
    num_blocks = kv_cache_blocks(model, engine_config, world=world, cuda_graphs=capture,
                                 extra_bytes_per_token=draft_bytes)
    engine = Engine(model, tokenizer, engine_config, eos_token_ids=eos_ids, num_blocks=num_blocks, world=world)
    if speculative is not None:
        proposer = make_proposer(speculative, draft, num_blocks=num_blocks,
                                 block_size=block_size, max_seq_len=max_seq_len, vocab_size=config.vocab_size,
                                 max_num_batched_tokens=max_num_batched_tokens)
        engine.use_speculation(proposer, speculative.num_tokens)
        logging.getLogger("tritonq").info("speculative decoding: %s, up to %d proposed tokens per sequence and step%s",
                                          speculative.method, speculative.num_tokens,
                                          f" (draft {speculative.model})" if draft is not None else
                                          f" (n = {speculative.max_n} .. {speculative.min_n})")
    if device.type == "cuda":  # fixed-shape decode buckets; graphs captured after the process group exists
        # with speculation, the verification steps (k + 1 queries a sequence) get buckets and graphs too; mixed
        # steps (prompt chunks beside decodes) token buckets, where the model runs them at fixed shapes
        static_prefill = getattr(cls, "static_prefill", False)
        verify = speculative.num_tokens + 1 if speculative is not None and static_prefill else None
        mixed = max_num_batched_tokens if static_prefill and engine.runner.states is None else None
        engine.runner.use_static_decode(max_num_seqs, cuda_graphs=capture, verify_tokens=verify, mixed_tokens=mixed)
    elif compile or (compile is None and CPU_COMPILE and world == 1 and not o.batch_invariant
                     and getattr(cls, "supports_compile", False)):
        engine.runner.use_static_decode(max_num_seqs, compile=True)
    return Model(model, tokenizer, engine, max_seq_len, rank, world)
