"""Checkpoints written by the packers people use, loaded by tritonq and compared with transformers
running the packer's own dequantization (issue #14): greedy tokens equal and logits within float32
tolerance, or, for fp8 schemes that round activations, layer by layer.

Packers: compressed-tensors (what llm-compressor saves with) builds and compresses the checkpoints
itself and transformers decompresses them with it; AutoAWQ packs with `WQLinear_GEMM.from_linear`
and the reference uses its `dequantize_gemm`. GPTQModel cannot be installed here (see GPTQMODEL_SKIP),
so its cases are built from its published format facts (whole-word v1 zero offset, `dynamic`
quantized lm_head, symmetric AWQ with every qzero 8) with an independent dequantizer below.
Shapes are odd on purpose: hidden 96, intermediate 160, vocab 258, GQA with 3 KV heads of 16.
"""
from __future__ import annotations

import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from formats.helpers import dense_llama, save
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import tritonq
from tritonq.formats.registry import get_loader
from tritonq.formats.layers import Linear
from tritonq.quant.weights import FP8Weight, Int4Weight, W8A8Weight

ATOL = 1e-4  # float32 on both sides with the same dequantized weights: rounding over two layers
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def greedy(forward, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation recomputing the full prefill each step (no cache on either side)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(forward(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def assert_same_model(folder, reference: torch.nn.Module, steps: int = 24) -> tritonq.Model:
    """tritonq.load(folder) against `reference` (a transformers model): logits and greedy tokens."""
    ours = tritonq.load(folder, max_num_seqs=1, max_seq_len=64)
    ours_forward = lambda ids: ours.engine.prompt_logits(ids[0].tolist())[None]  # noqa: E731
    with torch.no_grad():
        ref_forward = lambda ids: reference(ids).logits  # noqa: E731
        ids = torch.randint(0, 258, (1, 13))
        torch.testing.assert_close(ours_forward(ids), ref_forward(ids), atol=ATOL, rtol=0)
        prompt = ids[0].tolist()
        assert greedy(ours_forward, prompt, steps) == greedy(ref_forward, prompt, steps)
    return ours


# ---------------------------------------------------------------- compressed-tensors (the real packer)

def ct_checkpoint(folder, weights: dict, fmt: str, inputs: dict | None = None, ignore=("lm_head",),
                  targets=("Linear",), input_range: tuple[float, float] | None = None, **model_options) -> None:
    """Quantize a tiny Llama with compressed-tensors: scales from its own `calculate_qparams` on each
    weight's min/max (what llm-compressor's default min-max observer feeds it), then its
    ModelCompressor compresses and writes the config, as llm-compressor's save does. Static activation
    scales (and zero points) come from `calculate_qparams` on input_range (what a calibration observed)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    assert ct  # the import is the point
    model = dense_llama(**model_options)
    scheme = QuantizationScheme(targets=list(targets), weights=QuantizationArgs(**weights),
                                input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    ct_min_max_qparams(model, input_range)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    save(model, folder)
    compressor.update_config(folder)


def ct_min_max_qparams(model: torch.nn.Module, input_range: tuple[float, float] | None = None) -> None:
    """Set every quantized module's weight_scale / weight_zero_point from compressed-tensors' own
    `calculate_qparams` on the weight's min/max (llm-compressor's default min-max observer), and static
    input_scale / input_zero_point from input_range when given."""
    from compressed_tensors.quantization.utils import calculate_qparams
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w, args = module.weight.float(), module.quantization_scheme.weights
            if args.strategy == "tensor":
                low, high = w.amin(), w.amax()
            elif args.strategy == "channel":
                low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                low, high = w.unflatten(-1, (-1, args.group_size)).amin(-1), w.unflatten(-1, (-1, args.group_size)).amax(-1)
            else:  # block: pad to whole blocks with zeros (min/max include 0 anyway)
                bn, bk = args.block_structure
                N, K = w.shape
                blocks = torch.nn.functional.pad(w, (0, -K % bk, 0, -N % bn)).reshape(-(-N // bn), bn, -(-K // bk), bk)
                low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
            scale, zero = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if input_range is not None and hasattr(module, "input_scale"):
                scale, zero = calculate_qparams(torch.tensor(input_range[0]), torch.tensor(input_range[1]),
                                                module.quantization_scheme.input_activations)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
                if hasattr(module, "input_zero_point"):
                    module.input_zero_point.copy_(zero.reshape(module.input_zero_point.shape))


def ct_reference(folder) -> torch.nn.Module:
    """transformers with compressed-tensors' own decompression (and its activation fake-quantization)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))  # the decompression hook runs on the first forward
    return model


def ct_decompressed_reference(folder, **model_options) -> torch.nn.Module:
    """transformers' LlamaForCausalLM holding compressed-tensors' own decompression of every stored
    module (its compressor's `decompress`): for checkpoints transformers 5 cannot load itself (it
    allocates asymmetric pack-quantized zero points unpacked, [N, G], and refuses the packed [N/8, G])."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = q["config_groups"].values()
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    stored = load_file(folder / "model.safetensors")
    prefixes = {k.rpartition(".")[0] for k in stored if k.endswith(".weight_scale")}
    dense = {k: v for k, v in stored.items() if k.rpartition(".")[0] not in prefixes}
    for prefix in prefixes:
        local = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == prefix}
        dense[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    model = dense_llama(**model_options)
    model.load_state_dict(dense, strict=True)
    return model


FP8 = dict(num_bits=8, type="float", symmetric=True)
CT_WEIGHT_ONLY = {  # name: (weights, format, model options); all with input_activations null
    "naive-fp8-channel": (dict(FP8, strategy="channel"), "naive-quantized", {}),
    # 128x128 blocks: q/k/v and gate/up fuse along N only in whole blocks, so N = 128 per part
    "naive-fp8-block": (dict(FP8, strategy="block", block_structure=[128, 128]), "naive-quantized",
                        dict(hidden=128, inter=256, heads=4, kv_heads=4)),
    "float-quantized-fp8-channel": (dict(FP8, strategy="channel"), "float-quantized", {}),
    "float-quantized-fp8-tensor": (dict(FP8, strategy="tensor"), "float-quantized", {}),
    "pack-int4-group-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                             "pack-quantized", {}),  # reference: ct_decompressed_reference
    "pack-int4-group-sym": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                            "pack-quantized", {}),
    "naive-int8-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "naive-quantized", {}),
    "naive-int4-group-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                              "naive-quantized", {}),
}


@pytest.mark.parametrize("case", list(CT_WEIGHT_ONLY))
def test_compressed_tensors_weight_only_matches_transformers(tmp_path, case):
    weights, fmt, options = CT_WEIGHT_ONLY[case]
    ct_checkpoint(tmp_path, weights, fmt, **options)
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert q["format"] == fmt and q["config_groups"]["group_0"]["input_activations"] is None
    asym_packed = fmt == "pack-quantized" and not weights["symmetric"]
    reference = ct_decompressed_reference(tmp_path, **options) if asym_packed else ct_reference(tmp_path)
    ours = assert_same_model(tmp_path, reference)
    down = ours.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, FP8Weight if weights["type"] == "float" else Int4Weight)
    if isinstance(down, FP8Weight):
        assert down.weight_only  # input_activations null: activations are never rounded to fp8


def test_compressed_tensors_quantized_lm_head_and_embedding(tmp_path):
    """lm_head and embed_tokens quantized too (nothing ignored, Linear and Embedding targeted): both run
    through the typed weights; the head is no dense or tied fallback."""
    ct_checkpoint(tmp_path, dict(FP8, strategy="channel"), "naive-quantized", ignore=(), targets=("Linear", "Embedding"))
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["lm_head.weight"].dtype == stored["model.embed_tokens.weight"].dtype == torch.float8_e4m3fn
    ours = assert_same_model(tmp_path, ct_reference(tmp_path))
    assert isinstance(ours.model.lm_head.weight, FP8Weight)


CT_ACTIVATIONS = {  # fp8 schemes that also quantize activations: compared layer by layer
    "fp8-dynamic-per-token": (dict(FP8, strategy="channel"), dict(FP8, strategy="token", dynamic=True), {}),
    "fp8-block-per-group": (dict(FP8, strategy="block", block_structure=[128, 128]),
                            dict(FP8, strategy="group", group_size=128, dynamic=True),
                            dict(hidden=128, inter=256, heads=4, kv_heads=4)),
}


@pytest.mark.parametrize("case", list(CT_ACTIVATIONS))
def test_compressed_tensors_fp8_activations_match_per_layer(tmp_path, case):
    """One fp8 rounding flip of one activation moves a tiny model's logits by ~7e-2, so these schemes are
    compared per linear: our fp8 GEMM against compressed-tensors' own forward of that module (which
    rounds its input to fp8 the same way) on the same input."""
    weights, inputs, options = CT_ACTIVATIONS[case]
    ct_checkpoint(tmp_path, weights, "float-quantized", inputs, **options)
    reference = ct_reference(tmp_path)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    for i in range(2):
        for name in LINEAR_NAMES:
            prefix = f"model.layers.{i}.{name}"
            w = loader.get_linear(prefix)
            assert isinstance(w, FP8Weight) and not w.weight_only
            module = reference.get_submodule(prefix)
            x = torch.randn(2, 5, w.shape[1]) * 3  # [B, S, K]: compressed-tensors' per-token scales need both dims
            with torch.no_grad():
                expected = module(x)
            torch.testing.assert_close(Linear(w)(x), expected, atol=1e-4, rtol=1e-5)


INT8 = dict(num_bits=8, type="int")
CT_W8A8 = {  # int-quantized (W8A8 INT8) schemes: (weights, input_activations, static input range)
    "channel-dynamic-per-token": (dict(INT8, symmetric=True, strategy="channel"),
                                  dict(INT8, symmetric=True, strategy="token", dynamic=True), None),
    "tensor-static-per-tensor": (dict(INT8, symmetric=True, strategy="tensor"),
                                 dict(INT8, symmetric=True, strategy="tensor", dynamic=False), (-4.0, 4.0)),
    "channel-static-asymmetric": (dict(INT8, symmetric=True, strategy="channel"),
                                  dict(INT8, symmetric=False, strategy="tensor", dynamic=False), (-3.0, 5.0)),
}


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", list(CT_W8A8))
def test_compressed_tensors_w8a8_int8_matches_per_layer(tmp_path, monkeypatch, case, backend):
    """W8A8 INT8 written by compressed-tensors' own IntQuantizationCompressor, compared per linear with its own
    forward (the weight decompressed, the input fake-quantized to int8 by its own code): the int8 codes are the
    same, so what is left is fp32 summation order. backend torch: the reference; auto: torch._int_mm on CPU."""
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    weights, inputs, input_range = CT_W8A8[case]
    ct_checkpoint(tmp_path, weights, "int-quantized", inputs, input_range=input_range)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    reference = ct_reference(tmp_path)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    for i in range(2):
        for name in LINEAR_NAMES:
            prefix = f"model.layers.{i}.{name}"
            w = loader.get_linear(prefix)
            assert isinstance(w, W8A8Weight)
            assert (w.input_scale is None) == (input_range is None)
            assert (w.input_zero_point is not None) == (not inputs["symmetric"])
            module = reference.get_submodule(prefix)
            x = torch.randn(2, 5, w.shape[1]) * 2  # [B, S, K]: compressed-tensors' per-token scales need both dims
            x[0, 0] *= 4  # past the static range: clamped to the int8 grid on both sides
            with torch.no_grad():
                expected = module(x)
            torch.testing.assert_close(Linear(w)(x), expected, atol=1e-4, rtol=1e-5)


def test_compressed_tensors_w8a8_model_follows_its_int8_rounding(tmp_path, monkeypatch):
    """The whole W8A8 tiny Llama (dynamic per-token activations, fused q|k|v and gate|up, torch._int_mm on CPU)
    against transformers with compressed-tensors' own fake quantization. Where the two sides' fp32 hidden states
    differ in the last bits next to a rounding tie, a code flips by one step (1/127.5 of the token's absmax) and
    moves the logits; over 8 prompts that was 0 (no flip) to 0.15 of the quantization effect itself (the distance
    to the dense model). The bound 0.35 still tells a runtime that models the int8 rounding from one that does
    not (ratio 1)."""
    weights, inputs, _ = CT_W8A8["channel-dynamic-per-token"]
    ct_checkpoint(tmp_path, weights, "int-quantized", inputs)
    reference, dense = ct_reference(tmp_path), dense_llama()
    monkeypatch.setenv("TRITONQ_BACKEND", "auto")
    ours = tritonq.load(tmp_path, dtype=torch.float32, max_num_seqs=1, max_seq_len=64)
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj.weight, W8A8Weight)
    ids = torch.randint(0, 258, (1, 13), generator=torch.Generator().manual_seed(1))
    got = ours.engine.prompt_logits(ids[0].tolist())
    with torch.no_grad():
        expected, unquantized = reference(ids).logits[0], dense(ids).logits[0]
    assert (got - expected).norm() <= 0.35 * (unquantized - expected).norm()


def test_compressed_tensors_int8_activation_schemes_refused(tmp_path):
    """int8 activations the int8 kernel does not run (dynamic per tensor), and int8 activations with a weight
    format other than int-quantized, are refused naming the config field."""
    ct_checkpoint(tmp_path, dict(INT8, symmetric=True, strategy="channel"), "int-quantized",
                  dict(INT8, symmetric=True, strategy="tensor", dynamic=True))
    with pytest.raises(ValueError, match=r"group_0'\]: input_activations .*not supported for int8 weights"):
        get_loader(tmp_path, torch.float32, "cpu")


def test_compressed_tensors_unsupported_activation_scheme_is_refused(tmp_path):
    ct_checkpoint(tmp_path, dict(FP8, strategy="channel"), "float-quantized", dict(FP8, strategy="tensor", dynamic=True))
    with pytest.raises(ValueError, match=r"config_groups\['group_0'\]: input_activations .*'strategy': 'tensor'"):
        get_loader(tmp_path, torch.float32, "cpu")


# ---------------------------------------------------------------- AutoAWQ (the real packer)

def awq_imports():
    with warnings.catch_warnings():  # AutoAWQ announces its deprecation on import
        warnings.simplefilter("ignore")
        gemm = pytest.importorskip("awq.modules.linear.gemm", reason="autoawq is not installed (pip install autoawq)")
        from awq.quantize.quantizer import AwqQuantizer
        from awq.utils.packing_utils import dequantize_gemm
    return gemm.WQLinear_GEMM, AwqQuantizer, dequantize_gemm


def awq_checkpoint(folder, group_size: int, zero_point: bool = True) -> LlamaForCausalLM:
    """Pack every decoder linear with AutoAWQ (its pseudo-quantizer's scales/zeros, its GEMM packer);
    return the transformers reference holding AutoAWQ's own dequantization of each packed layer.
    zero_point=False: GPTQModel's symmetric AWQ, stored with every qzero 8 (signed codes + 8)."""
    WQLinear_GEMM, AwqQuantizer, dequantize_gemm = awq_imports()
    model = dense_llama(kv_heads=2)  # AutoAWQ's packer sizes qweight as N // 32 * 4 words: every N a multiple of 32
    save(model, folder)
    tensors = load_file(folder / "model.safetensors")
    quantizer = SimpleNamespace(w_bit=4, group_size=group_size, zero_point=zero_point)
    for i in range(2):
        for name in LINEAR_NAMES:
            prefix = f"model.layers.{i}.{name}"
            linear = model.get_submodule(prefix)
            # as AutoAWQ's _apply_quant: the layer takes the pseudo-quantized weight, then is packed
            linear.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantizer, linear.weight.data)
            if zeros is None:  # symmetric: GPTQModel's packer shifts the signed codes by 8
                zeros = torch.full_like(scales, 8)
            packed = WQLinear_GEMM.from_linear(linear, 4, group_size, False, scales.t().contiguous(),
                                               zeros.t().contiguous())
            del tensors[f"{prefix}.weight"]
            tensors |= {f"{prefix}.qweight": packed.qweight, f"{prefix}.qzeros": packed.qzeros,
                        f"{prefix}.scales": packed.scales}
            # AutoAWQ's dequantizer, fed the fp16 scales as float32 (exact) so that it does not round W to fp16
            dequantized = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size)  # [K, N]
            linear.weight.data = dequantized.t().float().contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                     "zero_point": zero_point, "version": "gemm", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(config))
    return model


def test_autoawq_gemm_matches_transformers(tmp_path):
    reference = awq_checkpoint(tmp_path, 32)  # K = 96 and 160: 32 is the largest group dividing both
    assert_same_model(tmp_path, reference)


def test_symmetric_awq_zero_point_false(tmp_path):
    """GPTQModel writes AWQ `zero_point: false` with every qzero 8; it loads (the symmetric kernel branch)."""
    reference = awq_checkpoint(tmp_path, 32, zero_point=False)
    ours = assert_same_model(tmp_path, reference)
    assert ours.model.layers[0].mlp.down_proj.weight.zeros is None


# ---------------------------------------------------------------- GPTQModel (from its published format facts)

def _gptqmodel_skip_reason() -> str | None:
    try:
        import gptqmodel  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason to skip
        return (f"gptqmodel cannot be imported ({type(e).__name__}: {e}): its PyPI release (7.7.0, an sdist that "
                "compiles CUDA extensions) requires torch>=2.14.1, and CI pins torch 2.13.0 CPU; the tests below "
                "build its format from the published facts instead")
    return None


GPTQMODEL_SKIP = _gptqmodel_skip_reason()


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int values [R, C] in [0, 2^bits) -> int32 [R, C*bits/32]: field j of each word holds column
    (word * per + j) at bit offset j * bits (GPTQ's sequential order), as uint32 bit patterns."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return (words - (words >= 2**31) * 2**32).to(torch.int32)


def gptq_layer(w: torch.Tensor, bits: int, group_size: int, force_zero_groups: int = 0, seed: int = 0):
    """RTN GPTQ of w [N, K] as GPTQModel's quantizer computes it (asymmetric min/max per group, zero in
    [0, 2^b - 1]); `force_zero_groups` groups of random columns get zero 0 (all their weights >= 0), the
    case v1 cannot store without wrapping. Returns (q [K, N], zeros [G, N], scales [G, N] fp16)."""
    N, K = w.shape
    g = K if group_size == -1 else group_size
    maxq = 2**bits - 1
    gen = torch.Generator().manual_seed(seed)
    w = w.clone().float()
    for _ in range(force_zero_groups):
        n, grp = int(torch.randint(N, (1,), generator=gen)), int(torch.randint(K // g, (1,), generator=gen))
        w[n, grp * g:(grp + 1) * g] = w[n, grp * g:(grp + 1) * g].abs()
    groups = w.reshape(N, K // g, g)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((high - low) / maxq).clamp(min=1e-6).half()
    zeros = (-low / scales.float()).round().clamp(0, maxq)
    q = ((groups / scales.float()[..., None]).round() + zeros[..., None]).clamp(0, maxq).reshape(N, K)
    return q.T.to(torch.int32), zeros.T.to(torch.int32).contiguous(), scales.T.contiguous()


def dequantize_gptq(q, zeros, scales, group_size):
    """W [N, K] = (q - z) * s, group of row k = k // group_size (the formula, written out independently)."""
    K = q.shape[0]
    g = torch.arange(K) // (K if group_size == -1 else group_size)
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).T


def gptq_checkpoint(folder, *, v1_rule: str | None, meta: dict | None, lm_head_bits: int | None = None,
                    bits: int = 4, group_size: int = 32, force_zero_groups: int = 0) -> LlamaForCausalLM:
    """A GPTQ checkpoint laid out as GPTQModel writes it, and the transformers reference on its dequantization.

    v1_rule: "word" (GPTQModel: qzeros word minus 0x11111111 / 0x01010101, borrowing), "field" (older
    packers: each field zero - 1 wrapped to the field width), None: checkpoint_format gptq_v2.
    lm_head_bits: also quantize lm_head (GPTQModel `lm_head: true` with a `dynamic` override); the vocab is
    then padded to 264, a multiple of the 8-column qzeros packs, as real vocabularies are."""
    model = dense_llama(vocab=264 if lm_head_bits else None)
    save(model, folder)
    tensors = load_file(folder / "model.safetensors")
    prefixes = [f"model.layers.{i}.{n}" for i in range(2) for n in LINEAR_NAMES]
    head_group = 32
    if lm_head_bits:
        prefixes.append("lm_head")
    for prefix in prefixes:
        layer_bits, layer_group = (lm_head_bits, head_group) if prefix == "lm_head" else (bits, group_size)
        linear = model.get_submodule(prefix)
        q, zeros, scales = gptq_layer(linear.weight.data, layer_bits, layer_group, force_zero_groups,
                                      seed=len(tensors))
        K = q.shape[0]
        if v1_rule == "word":
            ones = sum(1 << (layer_bits * j) for j in range(32 // layer_bits))
            words = pack_fields(zeros, layer_bits).to(torch.int64) & 0xFFFFFFFF
            words = (words - ones) & 0xFFFFFFFF
            qzeros = (words - (words >= 2**31) * 2**32).to(torch.int32)
        elif v1_rule == "field":
            qzeros = pack_fields((zeros - 1) & (2**layer_bits - 1), layer_bits)
        else:
            qzeros = pack_fields(zeros, layer_bits)
        del tensors[f"{prefix}.weight"]
        tensors |= {f"{prefix}.qweight": pack_fields(q.T, layer_bits).T.contiguous(), f"{prefix}.qzeros": qzeros,
                    f"{prefix}.scales": scales,
                    f"{prefix}.g_idx": (torch.arange(K) // (K if layer_group == -1 else layer_group)).to(torch.int32)}
        linear.weight.data = dequantize_gptq(q, zeros, scales, layer_group).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq" if v1_rule else "gptq_v2", "lm_head": bool(lm_head_bits),
        **({"meta": meta} if meta else {}),
        **({"dynamic": {"lm_head": {"bits": lm_head_bits, "group_size": head_group}}} if lm_head_bits else {})}
    (folder / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.skipif(GPTQMODEL_SKIP is not None, reason=str(GPTQMODEL_SKIP))
def test_gptqmodel_is_importable_for_the_real_packer_tests():
    """Where GPTQModel installs, its reader must agree with the facts used below (v1 word offset)."""
    from gptqmodel.utils import model as gm
    assert hasattr(gm, "convert_gptq_v1_to_v2_format_module")


def test_gptq_v1_zero_of_zero_written_by_gptqmodel_borrows(tmp_path):
    """GPTQModel's v1 qzeros are the true-zero word minus 0x11111111: a zero of 0 borrows from the field
    above. With meta.quantizer gptqmodel:* the whole-word rule reads it back exactly."""
    reference = gptq_checkpoint(tmp_path, v1_rule="word", meta={"quantizer": ["gptqmodel:2.2.0"]}, force_zero_groups=6)
    stored = load_file(tmp_path / "model.safetensors")
    fields = [(stored[f"model.layers.{i}.{n}.qzeros"].to(torch.int64) >> s) & 0xF
              for i in range(2) for n in LINEAR_NAMES for s in range(0, 28, 4)]
    assert any(bool((f == 0xF).any()) for f in fields)  # the case exists in this checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known quantizer: no warning
        assert_same_model(tmp_path, reference)


def test_gptq_v1_zero_of_zero_from_an_older_packer_wraps_with_a_warning(tmp_path):
    """Without GPTQModel in meta.quantizer, a v1 all-ones field is a zero of 0 with no borrow (the rule of
    the older packers that wrote such files); the layers where the two rules differ are named."""
    reference = gptq_checkpoint(tmp_path, v1_rule="field", meta=None, force_zero_groups=6)
    with pytest.warns(UserWarning, match=r"GPTQ v1 zero points with an all-ones field .* model\.layers\.\d"):
        assert_same_model(tmp_path, reference)


def test_gptq_v2_and_8bit_quantized_lm_head_from_gptqmodel_dynamic(tmp_path):
    """GPTQModel `lm_head: true`, `dynamic: {"lm_head": {"bits": 8, "group_size": 32}}`: lm_head.qweight/
    qzeros/scales on disk and no lm_head.weight. The head runs as an 8-bit Int4Weight, never tied."""
    reference = gptq_checkpoint(tmp_path, v1_rule="word", meta={"quantizer": ["gptqmodel:2.2.0"]}, lm_head_bits=8)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    ours = assert_same_model(tmp_path, reference)
    head = ours.model.lm_head.weight
    assert isinstance(head, Int4Weight) and (head.bits, head.group_size) == (8, 32)


def test_gptq_v2_zero_of_zero(tmp_path):
    reference = gptq_checkpoint(tmp_path, v1_rule=None, meta=None, force_zero_groups=6)
    assert_same_model(tmp_path, reference)


def test_gptq_sym_claim_with_asymmetric_zeros_uses_the_stored_zeros(tmp_path):
    """`sym: true` with zeros that are not 8 (TGI's quantizer wrote such files): the packer's reader uses
    the stored qzeros, so tritonq does too."""
    reference = gptq_checkpoint(tmp_path, v1_rule=None, meta=None)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["sym"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same_model(tmp_path, reference)


def test_fact_packer_layout():
    """pack_fields puts column j of a word at bits 4j, stored as a signed int32 (one word, by hand)."""
    assert pack_fields(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]), 4).item() == 0xF7654321 - 2**32


# Tensor parallelism: each rank's shard of every linear, dequantized, concatenates back to the whole layer (itself
# checked against compressed-tensors' own decompression above). hidden 128, inter 256: every q/k/v/o and gate/up/down
# splits over 2 ranks into whole groups of 32, packs of 8 and, for the block case, 128x128 blocks (gate/up column,
# down row); the 128-wide q/k/v/o column splits would cut a block, refused below.
CT_TP = {"pack-int4-group-asym": ["column", "row"], "naive-int4-group-asym": ["column", "row"],
         "naive-int8-channel": ["column", "row"], "float-quantized-fp8-channel": ["column", "row"],
         "float-quantized-fp8-tensor": ["row"], "naive-fp8-block": ["column", "row"]}
TP_MODEL = dict(hidden=128, inter=256, heads=4, kv_heads=4)


@pytest.mark.parametrize("case", list(CT_TP))
def test_compressed_tensors_rank_shards_concatenate_to_the_whole_layer(tmp_path, case):
    weights, fmt, _ = CT_WEIGHT_ONLY[case]
    ct_checkpoint(tmp_path, weights, fmt, **TP_MODEL)
    whole = get_loader(tmp_path, torch.float32, "cpu")
    ranks = [get_loader(tmp_path, torch.float32, "cpu", rank=r, world=2) for r in range(2)]
    prefixes = {"column": ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.up_proj"],
                "row": ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"]}
    for parallel in CT_TP[case]:
        for prefix in prefixes[parallel] if weights.get("strategy") != "block" else prefixes[parallel][:1]:
            expected = whole.get_linear(prefix).dequantize(torch.float32)
            shards = [loader.get_linear(prefix, parallel=parallel) for loader in ranks]
            assert all(type(s) is (FP8Weight if weights["type"] == "float" else Int4Weight) for s in shards)
            got = torch.cat([s.dequantize(torch.float32) for s in shards], dim=0 if parallel == "column" else 1)
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case, prefix, parallel, message", [
    # the default tiny Llama (hidden 96): o_proj's 96 inputs over 2 ranks cut the groups of 32
    ("pack-int4-group-asym", "model.layers.0.self_attn.o_proj", "row",
     "K (inputs)=96 row-parallel into 2 parts of 48: each part must be a multiple of 32 (a quantization group"),
    ("naive-fp8-block", "model.layers.0.self_attn.q_proj", "column",
     "N (outputs)=128 column-parallel into 2 parts of 64: each part must be a multiple of 128 (a 128x128 "
     "weight_scale block"),
])
def test_compressed_tensors_split_through_a_group_or_block_is_refused(tmp_path, case, prefix, parallel, message):
    weights, fmt, options = CT_WEIGHT_ONLY[case]
    ct_checkpoint(tmp_path, weights, fmt, **options)
    loader = get_loader(tmp_path, torch.float32, "cpu", rank=0, world=2)
    with pytest.raises(ValueError, match="^" + re.escape(f"{prefix}: cannot split {message}")):
        loader.get_linear(prefix, parallel=parallel)
