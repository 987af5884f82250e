"""The quantized-checkpoint writer (its quantizers are tritonq.quant.rtn's).

    python -m tritonq.quantize SRC DST --format awq|gptq|fp8|mxfp4|w8a8 [--group-size 128] [--sym|--asym]
        [--act-order] [--bits 4|8] [--checkpoint-format gptq|gptq_v2] [--fp8-scheme tensor|channel|block]
        [--w8a8-scheme channel|tensor] [--smooth 0.5 --calibration FILE] [--modules-to-not-convert lm_head ...]

SRC is a dense folder written by transformers' save_pretrained. DST gets the exact on-disk format
AutoAWQ / GPTQModel / vLLM read (each layout is spelled out in the docstring of its loader,
tritonq/formats/awq.py, gptq.py, fp8.py, mxfp4.py, compressed_tensors.py for w8a8): quantized linears, every
other tensor copied unchanged (embeddings, norms, lm_head, routers), config.json with quantization_config,
and all other files (tokenizer, generation config) copied. mxfp4 (gpt-oss) quantizes the fused MoE
experts only (`MXFP4_EXPERTS`), as OpenAI's checkpoints do; every linear stays dense.
w8a8 writes compressed-tensors `int-quantized` (what llm-compressor's W8A8 INT8 scheme saves, and vLLM
reads): int8 weights RTN-rounded per output channel (or per tensor) as compressed-tensors' min-max observer
does, activations dynamic per token. --smooth ALPHA first folds SmoothQuant scales (tritonq.quantize.calibrate) into
the norms before q|k|v and gate|up, from the activations of --calibration text.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tritonq.formats.awq import int4_to_awq
from tritonq.formats.base import always_dense
from tritonq.formats.checkpoint import Weights
from tritonq.quant.packing import pack_int32
from tritonq.quant.rtn import quantize_fp8, quantize_int4, quantize_mxfp4, quantize_w8a8
from tritonq.quant.weights import Int4Weight

# Linears the models fuse with the next one along N (q|k|v, gate|up): with block-fp8 their N must be
# whole blocks, or the fused scale rows would not line up (tritonq.quant.weights.concat_outputs).
FUSED_BEFORE_ANOTHER = ("q_proj", "k_proj", "gate_proj", ".w1")  # .w1: Mixtral's expert gate
# gpt-oss's fused expert tensors [E, K, N] that mxfp4 checkpoints store as `_blocks` / `_scales`.
MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# What OpenAI's gpt-oss checkpoints list as kept in bf16 (informative: only the experts are converted).
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantization_config(fmt: str, bits: int = 4, group_size: int = 128, sym: bool = False, act_order: bool = False,
                        checkpoint_format: str = "gptq", fp8_scheme: str = "tensor", w8a8_scheme: str = "channel",
                        modules_to_not_convert: list[str] | None = None) -> dict:
    """The config.json `quantization_config` that AutoAWQ / GPTQModel / vLLM expect for `fmt`."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": modules_to_not_convert}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
                "static_groups": False, "true_sequential": True, "lm_head": False,
                "checkpoint_format": checkpoint_format, "modules_to_not_convert": modules_to_not_convert,
                "meta": {"quantizer": ["tritonq:0.1.0"], "method": "rtn"}}
    if fmt == "fp8" and fp8_scheme == "channel":  # the per-channel fp8 format vLLM/transformers read
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": modules_to_not_convert or []}
    if fmt == "fp8":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "modules_to_not_convert": modules_to_not_convert}
        if fp8_scheme == "block":
            config["weight_block_size"] = [128, 128]
        return config
    if fmt == "mxfp4":  # transformers' Mxfp4Config
        return {"quant_method": "mxfp4", "modules_to_not_convert": modules_to_not_convert or MXFP4_NOT_CONVERTED}
    if fmt == "w8a8":  # compressed-tensors int-quantized, as llm-compressor's W8A8 preset saves it
        int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
        scheme = {"targets": ["Linear"], "format": "int-quantized", "output_activations": None,
                  "weights": int8 | {"strategy": w8a8_scheme, "dynamic": False},
                  "input_activations": int8 | {"strategy": "token", "dynamic": True}}
        # compressed-tensors' ignore holds module names or "re:" regexes; ours are name substrings
        ignore = ["lm_head"] + [f"re:.*{re.escape(m)}.*" for m in modules_to_not_convert or []]
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None,
                "global_compression_ratio": None}
    raise ValueError(f"unknown format {fmt!r} (supported: awq, gptq, fp8, mxfp4, w8a8)")


def quantized_tensors(prefix: str, w: torch.Tensor, q: dict, bias: torch.Tensor | None,
                      calibrated: Int4Weight | None = None) -> dict[str, torch.Tensor]:
    """On-disk tensors of one quantized linear `prefix` (dense weight w [N, K]) for config q.

    calibrated: a GPTQ-calibrated Int4Weight of w to store instead of w's RTN quantization.
    """
    method = q["quant_method"]
    out = {} if bias is None else {f"{prefix}.bias": bias.to(torch.float16 if method in ("awq", "gptq") else bias.dtype)}
    if method == "awq":
        qweight, qzeros, scales = int4_to_awq(quantize_int4(w, q["group_size"], sym=False, bits=4))
        out |= {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
    elif method == "gptq":
        v1 = q["checkpoint_format"] == "gptq"
        iw = calibrated or quantize_int4(w, q["group_size"], q["sym"], q["bits"], q["desc_act"], min_zero=1 if v1 else 0)
        K = w.shape[1]
        zeros = torch.full_like(iw.scales, 2 ** (iw.bits - 1)) if iw.zeros is None else iw.zeros
        g_idx = iw.g_idx if iw.g_idx is not None else (torch.arange(K) // iw.group_size).to(torch.int32)
        out |= {f"{prefix}.qweight": iw.qweight, f"{prefix}.scales": iw.scales, f"{prefix}.g_idx": g_idx,
                f"{prefix}.qzeros": pack_int32(zeros.to(torch.int32) - int(v1), iw.bits, dim=1)}
    elif method == "compressed-tensors":  # w8a8
        strategy = q["config_groups"]["group_0"]["weights"]["strategy"]
        ww = quantize_w8a8(w, strategy)
        out |= {f"{prefix}.weight": ww.weight,
                f"{prefix}.weight_scale": ww.weight_scale.reshape(1) if strategy == "tensor" else ww.weight_scale}
    elif method in ("fp8", "fbgemm_fp8"):
        block = q.get("weight_block_size")
        scheme = "channel" if method == "fbgemm_fp8" else "block" if block else "tensor"
        fw = quantize_fp8(w, scheme, tuple(block or (128, 128)))
        out |= {f"{prefix}.weight": fw.weight, f"{prefix}.weight_scale_inv" if block else f"{prefix}.weight_scale": fw.weight_scale}
    return out


def converted_modules(weights: Weights, ignore: list[str]) -> set[str]:
    """Linear layers the writer quantizes: 2-D float `.weight`s not dense by rule or by the ignore list
    (shapes and dtypes from the file headers: no tensor data is read)."""
    prefixes = set()
    for name in weights.names():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and not always_dense(prefix) and not any(entry in prefix for entry in ignore):
            if len(weights.get_shape(name)) == 2 and weights.get_dtype(name).is_floating_point:
                prefixes.add(prefix)
    return prefixes


def write_quantized(src: str | Path, dst: str | Path, fmt: str, *, method: str = "rtn",
                    calibration: dict | None = None, overwrite: bool = False, **options) -> Path:
    """Quantize the dense checkpoint folder src into dst (options: see quantization_config).

    method "gptq" / "awq" calibrates first (tritonq.quantize.calibrate) on calibration = {"file", "samples",
    "seq_len"} and optional "damp", "block_size", "clip"; "rtn" rounds to nearest. A non-empty dst is
    refused unless overwrite; dst appears whole or not at all (see replace_folder).
    """
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json; SRC must be a dense checkpoint folder written by "
                                "transformers' save_pretrained")
    check_destination(src, dst, overwrite)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src}/config.json already has a quantization_config "
                         f"({config['quantization_config'].get('quant_method')}); the writer needs a dense checkpoint")
    q = quantization_config(fmt, **options)
    weights = Weights(src)
    mxfp4 = fmt == "mxfp4"
    converted = set() if mxfp4 else converted_modules(weights, options.get("modules_to_not_convert") or [])
    experts = {n for n in weights.names() if n.endswith(MXFP4_EXPERTS)} if mxfp4 else set()
    if mxfp4 and not experts:
        raise ValueError(f"{src}: --format mxfp4 quantizes gpt-oss's fused experts ({', '.join(MXFP4_EXPERTS)}); "
                         "this checkpoint has none")
    if q.get("weight_block_size"):
        bn = q["weight_block_size"][0]
        for prefix in sorted(converted):
            N = weights.get_shape(f"{prefix}.weight")[0]
            if prefix.endswith(FUSED_BEFORE_ANOTHER) and N % bn:
                raise ValueError(f"{src}: {prefix}.weight has N={N} outputs, not a multiple of the {bn}-row fp8 "
                                 "block; tritonq fuses it with the next projection along N (q|k|v, gate|up), which "
                                 "needs whole blocks. Use --fp8-scheme channel or tensor, or keep the whole group "
                                 f"dense (--modules-to-not-convert {prefix.rsplit('.', 2)[-2]}).")
    calibrated = calibrate_for_writer(src, fmt, method, q, converted, calibration)
    tensors = {}
    for name in weights.names():
        prefix, _, leaf = name.rpartition(".")
        tensor = lambda n: calibrated.replaced[n].to(weights.get_tensor(n).dtype) if n in calibrated.replaced \
            else weights.get_tensor(n)  # noqa: E731
        if name in experts:  # [E, K, N] as transformers stores them: MXFP4 runs along K per output row
            mw = quantize_mxfp4(tensor(name).transpose(-1, -2))
            tensors |= {f"{name}_blocks": mw.blocks, f"{name}_scales": mw.scales}
        elif prefix not in converted:
            tensors[name] = tensor(name)
        elif leaf == "weight":
            bias = tensor(f"{prefix}.bias") if weights.has_tensor(f"{prefix}.bias") else None
            try:
                tensors |= quantized_tensors(prefix, tensor(name), q, bias, calibrated.int4.get(prefix))
            except ValueError as e:
                raise ValueError(f"{src}: cannot quantize {name}: {e}") from e
    config["quantization_config"] = q

    def write(folder: Path) -> None:
        for f in src.iterdir():  # tokenizer, generation config, chat template, ...
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    replace_folder(dst, write)
    return dst


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, a dst that is a file, is src, or holds anything unless overwrite."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"DST {dst} is a file; give a folder for the quantized checkpoint")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"DST {dst} is SRC; write the quantized checkpoint to another folder")
    if dst.is_dir() and not overwrite and any(dst.iterdir()):
        found = sorted(f.name for f in dst.iterdir())
        raise FileExistsError(f"DST {dst} is not empty (it holds {', '.join(found[:4])}{', ...' if len(found) > 4 else ''}); "
                              "choose a new or empty folder, or pass --overwrite (overwrite=True) to replace it")


def replace_folder(dst: Path, write) -> None:
    """Run write(folder) on a fresh folder beside dst, then rename it into dst's place (an existing dst is
    renamed aside first and removed last), so an interrupted or failed write never leaves half a checkpoint."""
    dst = dst.resolve()  # "." and "out/" have a name and a parent to stage beside
    dst.parent.mkdir(parents=True, exist_ok=True)
    staged = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    staged.mkdir()
    aside = dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write(staged)
        if dst.is_dir() and any(dst.iterdir()):  # overwrite (checked before any work)
            os.rename(dst, aside)
        os.replace(staged, dst)  # an absent or empty dst is replaced in one step
    except BaseException:
        if aside.exists() and not dst.exists():
            os.rename(aside, dst)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if aside.exists():
        shutil.rmtree(aside)


def calibrate_for_writer(src: Path, fmt: str, method: str, q: dict, converted: set[str], calibration: dict | None):
    """Run the calibration `method` for format `fmt` (nothing for rtn); sets q's meta.method for GPTQ."""
    from tritonq.quantize.calibrate import Calibrated, calibrate, calibration_ids

    if fmt == "w8a8":
        if method != "rtn":
            raise ValueError(f"--method {method} does not apply to --format w8a8 (RTN; add --smooth ALPHA for "
                             "SmoothQuant scales)")
        alpha = (calibration or {}).get("smooth")
        if alpha is None:
            return Calibrated()
        if not 0 <= alpha <= 1:
            raise ValueError(f"--smooth {alpha}: the SmoothQuant migration strength must be in [0, 1] (usually 0.5)")
        if not calibration.get("file"):
            raise ValueError("--smooth needs calibration text (the activations it balances): pass --calibration FILE")
        ids = calibration_ids(src, calibration["file"], calibration.get("samples", 128), calibration.get("seq_len", 512))
        return calibrate(src, "smoothquant", ids, alpha=alpha, is_converted=converted.__contains__)
    if method == "rtn":
        return Calibrated()
    if (fmt, method) not in (("gptq", "gptq"), ("awq", "awq")):
        raise ValueError(f"--method {method} does not apply to --format {fmt} (use --format gptq --method gptq, "
                         "--format awq --method awq, or --method rtn)")
    if not calibration or not calibration.get("file"):
        raise ValueError(f"--method {method} needs calibration text: pass --calibration FILE")
    ids = calibration_ids(src, calibration["file"], calibration.get("samples", 128), calibration.get("seq_len", 512))
    if method == "gptq":
        q["meta"]["method"] = "gptq"
        q["meta"]["damp_percent"] = calibration.get("damp", 0.01)
        return calibrate(src, "gptq", ids, bits=q["bits"], group_size=q["group_size"], sym=q["sym"],
                         act_order=q["desc_act"], damp=calibration.get("damp", 0.01),
                         block_size=calibration.get("block_size", 128),
                         min_zero=1 if q["checkpoint_format"] == "gptq" else 0, is_converted=converted.__contains__)
    return calibrate(src, "awq", ids, group_size=q["group_size"], clip=calibration.get("clip", False),
                     is_converted=converted.__contains__)

