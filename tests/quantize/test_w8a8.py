"""W8A8 INT8 end to end: the writer (`--format w8a8`, RTN and SmoothQuant) against compressed-tensors' own
reading of what it wrote, the SmoothQuant property itself, and the engine on a W8A8 model (batches equal solo
runs). Kernels: tests/kernels/test_int8_gemm.py; checkpoints written by compressed-tensors itself:
tests/formats/test_real_packers.py."""
from __future__ import annotations

import json

import pytest
import torch
from formats.helpers import dense_llama, save
from formats.test_real_packers import LINEAR_NAMES, ct_reference
from tolerances import assert_greedy_equal, solo_runs
from transformers import AutoModelForCausalLM

import tritonq
from tritonq.quantize.calibrate import _capture_inputs, calibrate, calibration_ids
from tritonq.cli import quantize_main
from tritonq.formats.registry import get_loader
from tritonq.formats.layers import Linear
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import W8A8Weight

CALIBRATION = {"samples": 4, "seq_len": 32}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    save(dense_llama(), folder)
    text = folder / "calibration.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 8)
    return folder


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_writer_w8a8_is_read_by_compressed_tensors_as_we_read_it(tmp_path, monkeypatch, dense, scheme):
    """What the writer stores, compressed-tensors decompresses (transformers' loader) to the weights we load, and
    its dynamic per-token activation fake quantization is ours: per linear, fp32 summation order apart."""
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    write_quantized(dense, tmp_path, "w8a8", w8a8_scheme=scheme)
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "int-quantized"
    reference = ct_reference(tmp_path)
    loader = get_loader(tmp_path, torch.float32, "cpu")
    dense_model = dense_llama()
    for name in LINEAR_NAMES:
        prefix = f"model.layers.1.{name}"
        w = loader.get_linear(prefix)
        assert isinstance(w, W8A8Weight) and w.input_scale is None
        assert w.weight_scale.numel() == (w.shape[0] if scheme == "channel" else 1)
        # RTN: within half a step of the dense weight
        step = w.weight_scale.reshape(-1, 1) if scheme == "channel" else w.weight_scale
        assert ((w.dequantize() - dense_model.get_submodule(prefix).weight).abs() <= step / 2 * 1.0001).all()
        x = torch.randn(2, 5, w.shape[1]) * 2
        with torch.no_grad():
            expected = reference.get_submodule(prefix)(x)
        torch.testing.assert_close(Linear(w)(x), expected, atol=1e-4, rtol=1e-5)


def test_smoothquant_balances_activation_and_weight_ranges(dense):
    """SmoothQuant's defining property at alpha 0.5: after folding, each input channel's activation max equals the
    max of its weight column over the group (max|x_j| / s_j = max|W_j| * s_j), and the model computes the same."""
    ids = calibration_ids(dense, dense / "calibration.txt", **CALIBRATION)
    result = calibrate(dense, "smoothquant", ids, alpha=0.5, progress=False)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        before = model(ids[:1]).logits
        for name, tensor in result.replaced.items():
            model.get_parameter(name).copy_(tensor)
        after = model(ids[:1]).logits
    torch.testing.assert_close(after, before, atol=1e-4 * before.abs().max().item(), rtol=0)
    layer = model.model.layers[0]
    hidden = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    inputs = _capture_inputs(layer, hidden, model.model.rotary_emb(hidden, positions),
                             ["self_attn.q_proj", "mlp.gate_proj"])
    for first, group in (("self_attn.q_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_proj", ("gate_proj", "up_proj"))):
        parent = first.split(".")[0]
        act_max = inputs[first].abs().amax(dim=0)
        weight_max = torch.stack([layer.get_submodule(f"{parent}.{n}").weight.abs().amax(dim=0) for n in group]).amax(0)
        torch.testing.assert_close(act_max, weight_max, rtol=1e-4, atol=0)
    assert "model.layers.0.input_layernorm.weight" in result.replaced


def test_writer_w8a8_smooth_writes_smoothed_norms(tmp_path, dense):
    quantize_main([str(dense), str(tmp_path), "--format", "w8a8", "--smooth", "0.5", "--calibration",
                   str(dense / "calibration.txt"), "--samples", "4", "--seq-len", "32"])
    from safetensors.torch import load_file
    stored, original = load_file(tmp_path / "model.safetensors"), load_file(dense / "model.safetensors")
    assert not torch.equal(stored["model.layers.0.input_layernorm.weight"], original["model.layers.0.input_layernorm.weight"])
    assert stored["model.layers.0.self_attn.o_proj.weight"].dtype == torch.int8
    model = tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=64)
    assert isinstance(model.model.layers[0].mlp.down_proj.weight, W8A8Weight)


def test_writer_w8a8_refuses_bad_options(tmp_path, dense):
    with pytest.raises(ValueError, match="--smooth needs calibration text"):
        write_quantized(dense, tmp_path, "w8a8", calibration={"smooth": 0.5})
    with pytest.raises(ValueError, match="--method gptq does not apply to --format w8a8"):
        write_quantized(dense, tmp_path, "w8a8", method="gptq", calibration={"file": "x"})
    with pytest.raises(SystemExit):
        quantize_main([str(dense), str(tmp_path), "--format", "fp8", "--smooth", "0.5"])


def test_engine_w8a8_batches_equal_solo_runs(tmp_path, monkeypatch, dense):
    """Per-token activation scales make each row's int8 codes its own: many prompts through the engine at once
    (mixed prefill and decode, chunked) give each prompt's solo tokens, through the Triton W8A8 GEMM (Triton's
    interpreter without a GPU)."""
    monkeypatch.setenv("TRITONQ_BACKEND", "auto")
    write_quantized(dense, tmp_path, "w8a8")
    model = tritonq.load(tmp_path, dtype=torch.float32, max_num_seqs=4, max_seq_len=64, max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in (3, 40, 11, 25, 7, 50)]
    out = model.generate(prompts, max_new_tokens=8, return_dict=True)
    assert_greedy_equal(model, prompts, out, solo_runs(model, prompts, max_new_tokens=8))
