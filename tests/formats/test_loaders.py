"""Loaders: a checkpoint written by our writer loads back into typed weights that equal the
RTN quantization of the original dense weights bit for bit; the loader class comes from
config.json alone; ignore lists, per-module overrides and quantize-on-load are honoured."""
import json

import pytest
import torch
from formats.helpers import GROUP_SIZE, LINEARS, dequantize
from safetensors.torch import load_file, save_file

from tritonq.formats.awq import AWQLoader
from tritonq.formats.compressed_tensors import CompressedTensorsLoader
from tritonq.formats.dense import DenseLoader
from tritonq.formats.fp8 import FP8Loader
from tritonq.formats.gptq import GPTQLoader
from tritonq.formats.registry import get_loader
from tritonq.quant.packing import pack_int32, unpack_int32
from tritonq.quant.rtn import quantize_fp8, quantize_int4
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight

INT4_CASES = {  # name: (writer options, loader class, quantize_int4 arguments of the original)
    "awq": ("awq", {"group_size": GROUP_SIZE}, AWQLoader, dict(sym=False, bits=4)),
    "gptq-v1-sym": ("gptq", {"group_size": GROUP_SIZE, "sym": True}, GPTQLoader, dict(sym=True, bits=4)),
    "gptq-v1-asym-act-order": ("gptq", {"group_size": GROUP_SIZE, "act_order": True}, GPTQLoader,
                               dict(sym=False, bits=4, act_order=True, min_zero=1)),
    "gptq-v2-8bit": ("gptq", {"group_size": GROUP_SIZE, "bits": 8, "checkpoint_format": "gptq_v2"}, GPTQLoader,
                     dict(sym=False, bits=8)),
}


@pytest.fixture(scope="module")
def original(tiny_llama):
    return load_file(tiny_llama / "model.safetensors")


def assert_same_int4(loaded: Int4Weight, expected: Int4Weight, dtype):
    assert (loaded.bits, loaded.group_size) == (expected.bits, expected.group_size)
    assert torch.equal(loaded.qweight, expected.qweight)
    assert torch.equal(loaded.scales, expected.scales.to(dtype))
    assert (loaded.zeros is None) == (expected.zeros is None) or torch.all(loaded.zeros == 8)
    assert (loaded.g_idx is None) == (expected.g_idx is None)
    assert torch.equal(dequantize(loaded), dequantize(expected))


@pytest.mark.parametrize("case", list(INT4_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int4_checkpoint_loads_bit_exact(tiny_llama, original, tmp_path, case, dtype):
    fmt, options, loader_class, rtn = INT4_CASES[case]
    write_quantized(tiny_llama, tmp_path, fmt, **options)
    loader = get_loader(tmp_path, dtype, "cpu")
    assert type(loader) is loader_class
    for p in LINEARS:
        w = loader.get_linear(p)
        assert isinstance(w, Int4Weight) and w.shape == tuple(original[f"{p}.weight"].shape)
        expected = quantize_int4(original[f"{p}.weight"], GROUP_SIZE, **rtn)
        assert_same_int4(w, expected, dtype)
        assert torch.equal(w.dequantize(), dequantize(expected).to(dtype))  # the int4 kernels' dequantizer
    lm_head = loader.get_linear("lm_head")
    assert isinstance(lm_head, DenseWeight) and torch.equal(lm_head.weight, original["lm_head.weight"].to(dtype))
    assert torch.equal(loader.get_tensor("model.norm.weight"), original["model.norm.weight"].to(dtype))


def test_fused_and_stacked_int4(tiny_llama, original, tmp_path):
    write_quantized(tiny_llama, tmp_path, "gptq", group_size=GROUP_SIZE, act_order=True)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    attn = "model.layers.0.self_attn"
    qkv = loader.get_fused_linear([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"])
    expected = torch.cat([dequantize(quantize_int4(original[f"{attn}.{m}.weight"], GROUP_SIZE, act_order=True,
                                                   min_zero=1)) for m in ("q_proj", "k_proj", "v_proj")])
    assert qkv.shape == (64 + 32 + 32, 64) and torch.equal(dequantize(qkv), expected)
    experts = loader.get_stacked([f"model.layers.{i}.mlp.gate_proj" for i in range(2)])
    assert experts.qweight.shape == (2, 64 // 8, 128) and experts.scales.shape == (2, 64 // GROUP_SIZE, 128)
    assert experts.g_idx.shape == (2, 64)


def write_block_fp8_unchecked(src, dst, original) -> None:
    """A block-fp8 checkpoint of every linear, also those whose N is not a whole number of 128-row blocks
    (the writer refuses to write those: they load alone but cannot be fused; the loader must say so)."""
    from tritonq.quantize.writer import quantization_config
    write_quantized(src, dst, "fp8", fp8_scheme="channel")
    tensors = load_file(dst / "model.safetensors")
    for p in LINEARS:
        w = quantize_fp8(original[f"{p}.weight"], "block")
        del tensors[f"{p}.weight_scale"]
        tensors |= {f"{p}.weight": w.weight, f"{p}.weight_scale_inv": w.weight_scale}
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config("fp8", fp8_scheme="block")
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_loads_bit_exact(tiny_llama, original, tmp_path, scheme):
    if scheme == "block":
        write_block_fp8_unchecked(tiny_llama, tmp_path, original)
    else:
        write_quantized(tiny_llama, tmp_path, "fp8", fp8_scheme=scheme)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    assert type(loader) is FP8Loader
    for p in LINEARS:
        w, expected = loader.get_linear(p), quantize_fp8(original[f"{p}.weight"], scheme)
        assert isinstance(w, FP8Weight) and w.block_size == expected.block_size and w.input_scale is None
        assert torch.equal(w.weight.view(torch.uint8), expected.weight.view(torch.uint8))
        assert torch.equal(w.weight_scale, expected.weight_scale)
        assert torch.equal(w.dequantize(), expected.dequantize())
    if scheme != "block":  # 128-row blocks cannot be split at 64/32 rows: an error, tested below
        attn = "model.layers.1.self_attn"
        qkv = loader.get_fused_linear([f"{attn}.{m}" for m in ("q_proj", "k_proj", "v_proj")])
        parts = [quantize_fp8(original[f"{attn}.{m}.weight"], scheme).dequantize() for m in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(qkv.dequantize(), torch.cat(parts))


def test_fused_block_fp8_needs_block_aligned_parts(tiny_llama, original, tmp_path):
    write_block_fp8_unchecked(tiny_llama, tmp_path, original)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not multiples of the block 128"):
        loader.get_fused_linear(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"])


def test_static_fp8_input_scale(tiny_llama, tmp_path):
    write_quantized(tiny_llama, tmp_path, "fp8")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors |= {f"{p}.input_scale": torch.tensor(0.5 + i) for i, p in enumerate(LINEARS)}
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loader = get_loader(tmp_path, torch.float32, "cpu")
    assert float(loader.get_linear(LINEARS[1]).input_scale) == 1.5
    qkv = loader.get_fused_linear(LINEARS[:3])
    assert float(qkv.input_scale) == 2.5 and qkv.weight_scale.shape == (128, 1)


def _static_input_scales(folder, fmt: str, scales: list[float]) -> None:
    """Turn the written fp8 / w8a8 checkpoint in folder into static activations with these input scales (one a
    linear, in LINEARS order; the rest 1.0)."""
    tensors = load_file(folder / "model.safetensors")
    for i, p in enumerate(LINEARS):
        tensors[f"{p}.input_scale"] = torch.tensor([scales[i] if i < len(scales) else 1.0])
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    if fmt == "fp8":
        config["quantization_config"]["activation_scheme"] = "static"
    else:
        config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False, "group_size": None}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fmt", ["fp8", "w8a8"])
@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_impossible_static_input_scale_is_refused_naming_the_tensor(tiny_llama, tmp_path, fmt, bad):
    """Activations are divided by a static input scale: 0 gives inf, a negative one flips every code. A checkpoint
    holding one is refused as the linear is read, naming the tensor; 0.25 in the same place loads."""
    write_quantized(tiny_llama, tmp_path / "good", fmt)
    _static_input_scales(tmp_path / "good", fmt, [1.0, 0.25])
    assert float(get_loader(tmp_path / "good", torch.float32, "cpu").get_linear(LINEARS[1]).input_scale) == 0.25
    write_quantized(tiny_llama, tmp_path / "bad", fmt)
    _static_input_scales(tmp_path / "bad", fmt, [1.0, bad])
    loader = get_loader(tmp_path / "bad", torch.float32, "cpu")
    loader.get_linear(LINEARS[0])
    with pytest.raises(ValueError, match=rf"'{LINEARS[1]}\.input_scale' holds {bad}; a static input scale must be "
                                         "finite and > 0"):
        loader.get_linear(LINEARS[1])


def test_modules_to_not_convert_and_gptq_dynamic(tiny_llama, original, tmp_path):
    write_quantized(tiny_llama, tmp_path, "gptq", group_size=GROUP_SIZE, modules_to_not_convert=["down_proj"])
    dense_down = "model.layers.0.mlp.down_proj"
    loader = get_loader(tmp_path, torch.float16, "cpu")
    assert torch.equal(loader.get_linear(dense_down).weight, original[f"{dense_down}.weight"])
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] |= {"modules_to_not_convert": None, "dynamic": {r"-:.*\.down_proj": {}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loader = get_loader(tmp_path, torch.float16, "cpu")
    assert isinstance(loader.get_linear(dense_down), DenseWeight)
    assert isinstance(loader.get_linear("model.layers.0.mlp.up_proj"), Int4Weight)


def test_quantize_on_load(tiny_llama, original):
    loader = get_loader(tiny_llama, torch.float32, "cpu", quantize="int4", group_size=GROUP_SIZE)
    assert type(loader) is DenseLoader
    for p in LINEARS:
        expected = quantize_int4(original[f"{p}.weight"].float(), GROUP_SIZE, scale_dtype=torch.float32)
        assert_same_int4(loader.get_linear(p), expected, torch.float32)
    assert isinstance(loader.get_linear("lm_head"), DenseWeight)
    mlp_only = get_loader(tiny_llama, torch.float32, "cpu", quantize="fp8-mlp")
    assert isinstance(mlp_only.get_linear("model.layers.0.self_attn.q_proj"), DenseWeight)
    down = mlp_only.get_linear("model.layers.0.mlp.down_proj")
    expected = quantize_fp8(original["model.layers.0.mlp.down_proj.weight"].float(), "channel")
    assert torch.equal(down.weight.view(torch.uint8), expected.weight.view(torch.uint8))
    dense = get_loader(tiny_llama, torch.float16, "cpu")
    assert torch.equal(dense.get_linear(LINEARS[0]).weight, original[f"{LINEARS[0]}.weight"])


def write_compressed_tensors(src_tensors: dict, folder, config: dict, symmetric: bool):
    """A pack-quantized checkpoint built from quantize_int4 output with the compressed-tensors layout."""
    tensors = {k: v for k, v in src_tensors.items() if not any(k.startswith(p + ".") for p in LINEARS)}
    for p in LINEARS:
        q = quantize_int4(src_tensors[f"{p}.weight"], GROUP_SIZE, sym=symmetric, scale_dtype=torch.bfloat16)
        codes = unpack_int32(q.qweight, 4, dim=0).T  # [N, K] unsigned codes = signed + 8
        tensors |= {f"{p}.weight_packed": pack_int32(codes, 4, dim=1), f"{p}.weight_scale": q.scales.T.contiguous(),
                    f"{p}.weight_shape": torch.tensor(list(codes.shape), dtype=torch.int32)}
        if not symmetric:
            tensors[f"{p}.weight_zero_point"] = pack_int32(q.zeros.T.to(torch.int32), 4, dim=0)
    save_file(tensors, folder / "model.safetensors")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP_SIZE}}}}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized(tiny_llama, original, tmp_path, symmetric):
    write_compressed_tensors(original, tmp_path, json.loads((tiny_llama / "config.json").read_text()), symmetric)
    loader = get_loader(tmp_path, torch.bfloat16, "cpu")
    assert type(loader) is CompressedTensorsLoader
    for p in LINEARS:
        expected = quantize_int4(original[f"{p}.weight"], GROUP_SIZE, sym=symmetric, scale_dtype=torch.bfloat16)
        assert_same_int4(loader.get_linear(p), expected, torch.bfloat16)
    assert isinstance(loader.get_linear("lm_head"), DenseWeight)


def test_compressed_tensors_float_quantized(tiny_llama, original, tmp_path):
    write_quantized(tiny_llama, tmp_path, "fp8", fp8_scheme="channel")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["re:.*lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {
            "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loader = get_loader(tmp_path, torch.float32, "cpu")
    w, expected = loader.get_linear(LINEARS[4]), quantize_fp8(original[f"{LINEARS[4]}.weight"], "channel")
    assert torch.equal(w.dequantize(), expected.dequantize()) and w.input_scale is None
    assert isinstance(loader.get_linear("lm_head"), DenseWeight)


@pytest.mark.parametrize("side_file,fmt,options,cls", [
    ("quantize_config.json", "gptq", {"group_size": GROUP_SIZE, "sym": True}, GPTQLoader),
    ("quant_config.json", "awq", {"group_size": GROUP_SIZE}, AWQLoader)])
def test_legacy_side_file_config_is_read_when_config_json_has_none(tiny_llama, original, tmp_path, side_file, fmt,
                                                                    options, cls):
    """Old AutoGPTQ (quantize_config.json) / AutoAWQ (quant_config.json, w_bit / q_group_size keys) exports."""
    folder = write_quantized(tiny_llama, tmp_path / fmt, fmt, **options)
    config = json.loads((folder / "config.json").read_text())
    q = config.pop("quantization_config")
    q.pop("quant_method")
    if fmt == "awq":  # AutoAWQ's own key names in quant_config.json
        q = {"w_bit": q.pop("bits"), "q_group_size": q.pop("group_size"), **q}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / side_file).write_text(json.dumps(q))
    loader = get_loader(folder, torch.float16, "cpu")
    assert type(loader) is cls
    prefix = "model.layers.0.mlp.down_proj"
    expected = quantize_int4(original[f"{prefix}.weight"], GROUP_SIZE, sym=options.get("sym", False))
    assert torch.equal(loader.get_linear(prefix).qweight, expected.qweight)
