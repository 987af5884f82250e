"""GPTQ and AWQ calibration (tritonq.quantize.calibrate) and the calibrated writer.

The quality claims are checked on the layer output error ||X W^T - X Q^T|| with the quantized
weight Q decoded by the test helper's own formula (formats.helpers.dequantize), against RTN
(quantize_int4) on the same grid. Written checkpoints are checked against transformers.
"""
import json

import pytest
import torch
from formats.helpers import dequantize
from models.test_llama import ATOL, dequantized_transformers_model, our_prefill_logits, write_checkpoint
from safetensors.torch import load_file

import tritonq
from tritonq.quantize.calibrate import awq_search_clip, awq_search_scale, calibrate, calibration_ids, gptq_quantize
from tritonq.cli import quantize_main as main
from tritonq.quant.rtn import quantize_int4


def correlated_activations(T=768, K=160, seed=0) -> torch.Tensor:
    """X [T, K] with strongly correlated features (a low-rank mix plus noise) and uneven channel scales."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(24, K, generator=gen)
    x = torch.randn(T, 24, generator=gen) @ mix + 0.1 * torch.randn(T, K, generator=gen)
    return x * torch.rand(K, generator=gen).mul(3).add(0.2)


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return (x @ w.T - x @ wq.T).norm().item()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_output_error_is_below_rtn(sym, act_order, bits):
    x = correlated_activations()
    w = torch.randn(40, 160, generator=torch.Generator().manual_seed(1))
    hessian = 2 * x.T @ x / len(x)
    gptq = gptq_quantize(w, hessian, bits=bits, group_size=32, sym=sym, act_order=act_order)
    rtn = quantize_int4(w, group_size=32, sym=sym, bits=bits)
    err_gptq, err_rtn = output_error(x, w, dequantize(gptq)), output_error(x, w, dequantize(rtn))
    assert err_gptq < 0.75 * err_rtn, (err_gptq, err_rtn)
    if act_order:  # groups are runs of 32 columns in decreasing diag(H) order
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        assert torch.equal(gptq.g_idx[order].long(), torch.arange(160) // 32)
    else:
        assert gptq.g_idx is None
    assert (gptq.zeros is None) == sym


def test_gptq_lazy_block_updates_equal_immediate_updates():
    """Lazy batch updates only reorder the same arithmetic: any block size gives the same codes."""
    x = correlated_activations(K=96)
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(2))
    hessian = 2 * x.T @ x / len(x)
    a = dequantize(gptq_quantize(w, hessian, group_size=32, sym=False, block_size=1))
    b = dequantize(gptq_quantize(w, hessian, group_size=32, sym=False, block_size=128))
    c = dequantize(gptq_quantize(w, hessian, group_size=32, sym=False, block_size=40))
    assert (a == b).float().mean() > 0.995 and (a == c).float().mean() > 0.995  # rare rounding ties may flip


def test_gptq_with_identity_hessian_is_rtn():
    """With uncorrelated unit inputs (H = 2I) there is nothing to compensate: GPTQ rounds to nearest."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    gptq = gptq_quantize(w, 2 * torch.eye(64), group_size=32, sym=True)
    assert torch.equal(dequantize(gptq), dequantize(quantize_int4(w, group_size=32, sym=True)))


def awq_objective(x, weights, scale, group):
    """The calibration objective, decoded independently: sum ||X W^T - X (deq(RTN(W s)) / s)^T||^2."""
    return sum((x @ w.T - x @ (dequantize(quantize_int4(w * scale, group)) / scale).T).square().sum().item()
               for w in weights)


@pytest.mark.parametrize("outliers", [False, True])
def test_awq_scales_never_worse_than_no_scaling(outliers):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(512, 128, generator=gen)
    if outliers:  # a few salient input channels, as in LLM activations
        x[:, :4] *= 30
    weights = [torch.randn(48, 128, generator=gen), torch.randn(32, 128, generator=gen)]
    scale, losses = awq_search_scale(x, weights, group_size=64)
    assert len(losses) == 20
    best, unscaled = awq_objective(x, weights, scale, 64), awq_objective(x, weights, torch.ones(128), 64)
    assert best <= unscaled * (1 + 1e-5)
    assert best == pytest.approx(min(losses), rel=1e-4)
    if outliers:
        assert best < 0.9 * unscaled


def test_awq_clip_never_worse_than_no_clip():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, 128, generator=gen)
    w = torch.randn(24, 128, generator=gen)
    w[:, 7] *= 8  # an outlier weight per row stretches its group's range
    limit = awq_search_clip(x, w, group_size=32).repeat_interleave(32, 1)
    clipped = dequantize(quantize_int4(w.clamp(-limit, limit), 32))
    assert output_error(x, w, clipped) <= output_error(x, w, dequantize(quantize_int4(w, 32))) * (1 + 1e-5)


@pytest.fixture
def calibration_text(tmp_path):
    gen = torch.Generator().manual_seed(6)
    words = ["the", "king", "queen", "castle", "night", "ghost", "sword", "and", "of", "to"]
    text = " ".join(words[i] for i in torch.randint(0, len(words), (800,), generator=gen).tolist())
    path = tmp_path / "calib.txt"
    path.write_text(text)
    return path


def test_awq_folding_preserves_the_dense_model(tmp_path, calibration_text):
    """The AWQ scales folded into norms / v_proj / up_proj (before quantization) leave the function unchanged."""
    hf = write_checkpoint(tmp_path, kv_heads=4)  # MHA: v -> o folding applies
    ids = calibration_ids(tmp_path, calibration_text, samples=4, seq_len=24)
    result = calibrate(tmp_path, "awq", ids, group_size=32, progress=False)
    assert any(k.endswith("v_proj.bias") for k in result.replaced)  # v_proj was a fold target
    probe = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        expected = hf(probe).logits
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        hf.load_state_dict({k: result.replaced.get(k, v) for k, v in state.items()})
        assert any(not torch.equal(state[k], v) for k, v in result.replaced.items())
        torch.testing.assert_close(hf(probe).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt, extra", [("gptq", ["--sym"]), ("gptq", ["--asym", "--act-order"]),
                                        ("awq", []), ("awq", ["--awq-clip"])])
def test_calibrated_checkpoint_loads_and_matches_transformers(tmp_path, monkeypatch, calibration_text, fmt, extra):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    hf = write_checkpoint(tmp_path / "dense", kv_heads=2)
    out = tmp_path / fmt
    main([str(tmp_path / "dense"), str(out), "--format", fmt, "--method", fmt, "--group-size", "32",
          "--calibration", str(calibration_text), "--samples", "4", "--seq-len", "24"] + extra)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "gptq":
        assert config["meta"]["method"] == "gptq" and config["desc_act"] == ("--act-order" in extra)
    stored = load_file(out / "model.safetensors")
    ours = tritonq.load(out, max_num_seqs=1, max_seq_len=24)
    ids = torch.randint(0, 256, (1, 19))
    with torch.no_grad():
        for name, p in hf.named_parameters():  # AWQ rewrote norms and biases: take everything dense from the file
            if name in stored and stored[name].is_floating_point():
                p.copy_(stored[name].float())
        expected = dequantized_transformers_model(hf, out)(ids).logits
    torch.testing.assert_close(our_prefill_logits(ours, ids), expected, atol=ATOL, rtol=0)


def test_calibration_rejects_bad_requests(tmp_path, calibration_text, capsys):
    """The CLI refuses with a one-line error (exit status 2) before writing anything."""
    write_checkpoint(tmp_path / "dense")
    src = str(tmp_path / "dense")
    cases = [([src, str(tmp_path / "a"), "--format", "gptq", "--method", "gptq"], "needs calibration text"),
             ([src, str(tmp_path / "b"), "--format", "awq", "--method", "gptq", "--calibration", str(calibration_text)],
              "does not apply to --format awq"),
             ([src, str(tmp_path / "c"), "--format", "gptq", "--method", "gptq", "--calibration",
               str(calibration_text), "--seq-len", "100000"], "fewer than --seq-len 100000")]
    for argv, phrase in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and phrase in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
