"""bitsandbytes checkpoints written by bitsandbytes itself at test time, loaded by tritonq (issue #36).

Whole models: transformers' BitsAndBytesConfig quantizes a tiny random Llama on the CPU and save_pretrained
writes it (blocksize 64, the only one transformers uses). tritonq's logits and greedy tokens are compared with
transformers running those weights: the 4-bit model as loaded (bitsandbytes' CPU forward dequantizes to the
compute dtype, fp32 here, and runs a dense GEMM) and the 8-bit model with each layer replaced by
bitsandbytes' own dequantization (its forward also rounds activations to int8; tritonq runs weight-only).
Single layers: bitsandbytes' functional quantize_4bit at every blocksize, with and without double quant,
saved under the names Linear4bit's state dict uses (`weight.` + QuantState.as_dict(packed=True)), and
compared with bitsandbytes' dequantize_4bit.
"""
from __future__ import annotations

import json

import pytest
import torch
from formats.helpers import dense_llama, save
from formats.test_real_packers import assert_same_model
from safetensors.torch import save_file

from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.quant.weights import DenseWeight, Int4Weight

bnb = pytest.importorskip("bitsandbytes", reason="pip install -e .[test] installs bitsandbytes")
F = bnb.functional
transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def bnb_checkpoint(folder, config: BitsAndBytesConfig):
    """A tiny Llama (every K a multiple of 64) quantized by transformers + bitsandbytes on the CPU and saved
    to folder / "bnb", which is returned."""
    dense_dir = folder / "dense"
    save(dense_llama(hidden=128, inter=192, heads=4, kv_heads=2), dense_dir)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=config, device_map="cpu")
    model.save_pretrained(folder / "bnb")
    byte_tokenizer().save_pretrained(folder / "bnb")
    return folder / "bnb"


def bnb_reference(folder) -> torch.nn.Module:
    """The checkpoint loaded by transformers with each bitsandbytes linear replaced by an fp32 nn.Linear holding
    bitsandbytes' own dequantization, taken before any forward: bitsandbytes' CPU backend repacks 4-bit
    weights in place on the first forward (its dequantize_4bit then reads them wrong), and its CPU GEMMs are
    not fp32-exact (|error| ~3e-3 of |y| per 4-bit layer)."""
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    for name, module in list(model.named_modules()):
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            if isinstance(module, bnb.nn.Linear4bit):
                weight = F.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            else:
                weight = F.int8_vectorwise_dequant(module.weight.data, module.weight.SCB)
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = weight
            if module.bias is not None:
                linear.bias.data = module.bias.data.float()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", True), ("fp4", False)])
def test_4bit_model_matches_transformers(tmp_path, quant_type, double_quant):
    folder = bnb_checkpoint(tmp_path, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                         bnb_4bit_use_double_quant=double_quant,
                                                         bnb_4bit_compute_dtype=torch.float32))
    reference = bnb_reference(folder)
    ours = assert_same_model(folder, reference)
    w = ours.model.layers[0].mlp.down_proj.weight
    assert isinstance(w, Int4Weight) and w.code is not None and w.group_size == 64
    assert torch.equal(w.dequantize(torch.float32), reference.model.layers[0].mlp.down_proj.weight)
    # bitsandbytes' own 4-bit forward (its CPU GEMM): close, not fp32-exact (see bnb_reference)
    bnb_model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    ids = torch.randint(0, 258, (1, 13))
    with torch.no_grad():
        theirs = bnb_model(ids).logits[0]
    ours_logits = ours.engine.prompt_logits(ids[0].tolist())
    assert (ours_logits - theirs).norm() <= 2e-2 * theirs.norm()


def test_8bit_model_matches_transformers(tmp_path):
    folder = bnb_checkpoint(tmp_path, BitsAndBytesConfig(load_in_8bit=True))
    reference = bnb_reference(folder)
    ours = assert_same_model(folder, reference)
    w = ours.model.layers[0].mlp.down_proj.weight
    assert isinstance(w, Int4Weight) and w.bits == 8
    # (q - 128) * (SCB / 127) vs bitsandbytes' int8 * SCB * (1/127): one fp32 rounding apart
    torch.testing.assert_close(w.dequantize(torch.float32), reference.model.layers[0].mlp.down_proj.weight,
                               rtol=2**-22, atol=0)


def test_skip_modules_stay_dense(tmp_path):
    folder = bnb_checkpoint(tmp_path, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=torch.float32,
                                                         llm_int8_skip_modules=["lm_head", "down_proj"]))
    ours = assert_same_model(folder, bnb_reference(folder))
    assert isinstance(ours.model.layers[0].mlp.down_proj.weight, DenseWeight)
    assert isinstance(ours.model.layers[0].mlp.gate_up_proj.weight, Int4Weight)


# ---------------------------------------------------------------- single layers, every blocksize

def write_4bit_layer(folder, weight: torch.Tensor, blocksize: int, quant_type: str, double_quant: bool):
    """One linear `layer` quantized by bitsandbytes' quantize_4bit, saved as Linear4bit's state dict names it."""
    packed, state = F.quantize_4bit(weight, blocksize=blocksize, compress_statistics=double_quant,
                                    quant_type=quant_type)
    tensors = {"layer.weight": packed} | {f"layer.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": double_quant}}))
    return packed, state


@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 512, 1024, 2048, 4096])
@pytest.mark.parametrize("quant_type, double_quant, dtype", [("nf4", True, torch.bfloat16),
                                                             ("fp4", False, torch.float16),
                                                             ("nf4", False, torch.float32)])
def test_4bit_layer_dequantizes_as_bitsandbytes(tmp_path, blocksize, quant_type, double_quant, dtype):
    N, K = 24, 4096  # every blocksize divides K; bitsandbytes' CPU dequantizer agrees with its quantizer there
    weight = (torch.randn(N, K) * torch.rand(N, 1) * 3).to(dtype)
    packed, state = write_4bit_layer(tmp_path, weight, blocksize, quant_type, double_quant)
    expected = F.dequantize_4bit(packed, state).float()  # W in the original dtype, as bitsandbytes returns it
    w = get_loader(tmp_path, dtype, "cpu").get_linear("layer", shape=(N, K))
    assert w.shape == (N, K) and w.group_size == blocksize
    assert torch.equal(w.dequantize(dtype).float(), expected)


@pytest.mark.parametrize("N, K, blocksize", [(30, 96, 64), (16, 64, 256), (10, 200, 128)])
def test_4bit_blocks_across_rows(tmp_path, N, K, blocksize):
    """Blocks cover the flattened [N, K] weight, so with K not a multiple of the blocksize they straddle
    rows. bitsandbytes' portable dequantizer (backends/default, what its CUDA kernel computes) is the
    reference: its CPU C kernel indexes blocks per row there and disagrees with its own quantizer."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    weight = torch.randn(N, K)
    packed, state = write_4bit_layer(tmp_path, weight, blocksize, "nf4", True)
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    expected = _dequantize_4bit_compute(packed.reshape(-1), absmax, state.code, blocksize, (N, K), torch.float32)
    w = get_loader(tmp_path, torch.float32, "cpu").get_linear("layer")
    assert torch.equal(w.dequantize(torch.float32), expected)
    torch.testing.assert_close(expected, weight, atol=0.2 * weight.abs().max().item(), rtol=0)  # it is W, roughly


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_4bit_tensor_parallel_slices(tmp_path, parallel):
    N, K = 48, 256
    write_4bit_layer(tmp_path, torch.randn(N, K), 64, "nf4", True)
    whole = get_loader(tmp_path, torch.float32, "cpu").get_linear("layer").dequantize(torch.float32)
    parts = [get_loader(tmp_path, torch.float32, "cpu", rank=r, world=2).get_linear("layer", parallel=parallel)
             .dequantize(torch.float32) for r in range(2)]
    assert torch.equal(torch.cat(parts, dim=0 if parallel == "column" else 1), whole)


def test_bad_bitsandbytes_checkpoints_are_refused(tmp_path):
    write_4bit_layer(tmp_path, torch.randn(8, 64), 64, "nf4", False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["load_in_8bit"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="load_in_4bit=True, load_in_8bit=True; expected exactly one"):
        get_loader(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="implies \\[N=8, K=32\\]"):
        config["quantization_config"]["load_in_8bit"] = False
        (tmp_path / "config.json").write_text(json.dumps(config))
        get_loader(tmp_path, torch.float32, "cpu").get_linear("layer", shape=(8, 32))

