"""The writer produces the exact on-disk formats of AutoAWQ / GPTQModel / vLLM (docs/formats.md).

Each on-disk tensor is decoded here with the formula from formats.md, written out independently
of tritonq's packing code, and must equal the RTN quantization of the dense weight bit for bit.
"""
import json
import re
from pathlib import Path

import pytest
import torch
from formats.helpers import GROUP_SIZE, LINEARS, dequantize, save_tiny_llama
from safetensors.torch import load_file

import tritonq
from tritonq.cli import quantize_main as main
from tritonq.demo import byte_tokenizer
from tritonq.quant.rtn import quantize_fp8, quantize_int4
from tritonq.quant.weights import FP8Weight
from tritonq.quantize import writer
from tritonq.quantize.writer import write_quantized


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("dense"))
    return folder, load_file(folder / "model.safetensors")


def fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sequential fields of int32 packs along dim (field j at bits j*b..): the GPTQ / formats.md order."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [(p >> (bits * j)) & (2**bits - 1) for j in range(32 // bits)]
    return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)


def test_int4_rtn_error_is_within_one_step():
    w = torch.randn(24, 96) * 3
    for sym in (False, True):
        q = quantize_int4(w, group_size=32, sym=sym)
        step = q.scales.float().repeat_interleave(32, 0).T
        assert ((dequantize(q) - w).abs() <= step * 0.5 + 1e-6).float().mean() > 0.9  # rounding, rare clamps
        assert ((dequantize(q) - w).abs() <= step * 1.0001).all()


def test_fp8_rtn_error_is_within_e4m3_precision():
    w = torch.randn(40, 200) * 5
    for scheme in ("tensor", "channel", "block"):
        f = quantize_fp8(w, scheme, (16, 64))
        scale = f.weight_scale if scheme != "block" else \
            f.weight_scale.repeat_interleave(16, 0)[:40].repeat_interleave(64, 1)[:, :200]
        deq = f.weight.float() * scale
        assert ((deq - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()  # e4m3: 3 mantissa bits, subnormal 2^-9


def test_awq_writer_matches_autoawq_layout(dense, tmp_path):
    src, original = dense
    main([str(src), str(tmp_path), "--format", "awq", "--group-size", str(GROUP_SIZE)])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    assert (tmp_path / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    t = load_file(tmp_path / "model.safetensors")
    column_to_nibble = [0, 4, 1, 5, 2, 6, 3, 7]
    for p in LINEARS:
        N, K = original[f"{p}.weight"].shape
        G = K // GROUP_SIZE
        assert (t[f"{p}.qweight"].dtype, t[f"{p}.qweight"].shape) == (torch.int32, (K, N // 8))
        assert (t[f"{p}.qzeros"].dtype, t[f"{p}.qzeros"].shape) == (torch.int32, (G, N // 8))
        assert (t[f"{p}.scales"].dtype, t[f"{p}.scales"].shape) == (torch.float16, (G, N))
        nib = lambda x: fields(x, 4, 1).reshape(x.shape[0], -1, 8)[..., column_to_nibble].flatten(1)  # noqa: E731
        q, z, s = nib(t[f"{p}.qweight"]).float(), nib(t[f"{p}.qzeros"]).float(), t[f"{p}.scales"].float()
        deq = ((q - z.repeat_interleave(GROUP_SIZE, 0)) * s.repeat_interleave(GROUP_SIZE, 0)).T
        expected = quantize_int4(original[f"{p}.weight"], GROUP_SIZE)
        assert torch.equal(deq, dequantize(expected))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(t[name], original[name])


@pytest.mark.parametrize("bits, sym, act_order, fmt", [(4, True, False, "gptq"), (4, False, True, "gptq"),
                                                       (8, False, False, "gptq_v2")])
def test_gptq_writer_matches_gptqmodel_layout(dense, tmp_path, bits, sym, act_order, fmt):
    src, original = dense
    main([str(src), str(tmp_path), "--format", "gptq", "--group-size", str(GROUP_SIZE), "--bits", str(bits),
          "--sym" if sym else "--asym", "--checkpoint-format", fmt] + (["--act-order"] if act_order else []))
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == \
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP_SIZE, "desc_act": act_order, "sym": sym,
         "checkpoint_format": fmt}
    t = load_file(tmp_path / "model.safetensors")
    per, offset = 32 // bits, 1 if fmt == "gptq" else 0
    for p in LINEARS:
        N, K = original[f"{p}.weight"].shape
        G = K // GROUP_SIZE
        assert (t[f"{p}.qweight"].dtype, t[f"{p}.qweight"].shape) == (torch.int32, (K // per, N))
        assert (t[f"{p}.qzeros"].dtype, t[f"{p}.qzeros"].shape) == (torch.int32, (G, N // per))
        assert (t[f"{p}.scales"].dtype, t[f"{p}.scales"].shape) == (torch.float16, (G, N))
        assert (t[f"{p}.g_idx"].dtype, t[f"{p}.g_idx"].shape) == (torch.int32, (K,))
        g = t[f"{p}.g_idx"].long()
        assert torch.equal(g, torch.arange(K) % G if act_order else torch.arange(K) // GROUP_SIZE)
        q_codes = fields(t[f"{p}.qweight"], bits, 0).float()                # [K, N]
        zeros = fields(t[f"{p}.qzeros"], bits, 1).float() + offset          # [G, N]
        if sym:
            assert (zeros == 2 ** (bits - 1)).all()
        if fmt == "gptq":
            assert (zeros >= 1).all()  # v1 cannot store a zero of 0
        deq = ((q_codes - zeros[g]) * t[f"{p}.scales"].float()[g]).T
        expected = quantize_int4(original[f"{p}.weight"], GROUP_SIZE, sym, bits, act_order, min_zero=offset)
        assert torch.equal(deq, dequantize(expected))


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_writer_matches_vllm_layout(dense, tmp_path, scheme):
    src, original = dense
    # block: q/k/gate have N=64, half a 128-row block, which the loader cannot fuse (refused: see
    # test_writer_refuses_block_fp8_it_cannot_load); the others are still written, partial blocks included.
    fused_firsts = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] if scheme == "block" else []
    main([str(src), str(tmp_path), "--format", "fp8", "--fp8-scheme", scheme,
          *(["--modules-to-not-convert", *fused_firsts] if fused_firsts else [])])
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == ("fbgemm_fp8" if scheme == "channel" else "fp8")
    assert q.get("weight_block_size") == ([128, 128] if scheme == "block" else None)
    t = load_file(tmp_path / "model.safetensors")
    for p in LINEARS:
        if p.endswith(tuple(fused_firsts)):
            assert torch.equal(t[f"{p}.weight"], original[f"{p}.weight"])
            continue
        N, K = original[f"{p}.weight"].shape
        scale = t[f"{p}.weight_scale_inv" if scheme == "block" else f"{p}.weight_scale"]
        assert t[f"{p}.weight"].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == {"tensor": (), "channel": (N, 1), "block": (-(-N // 128), -(-K // 128))}[scheme]
        expected = quantize_fp8(original[f"{p}.weight"], scheme)
        assert torch.equal(t[f"{p}.weight"].view(torch.uint8), expected.weight.view(torch.uint8))
        assert torch.equal(scale, expected.weight_scale)


def test_writer_honours_modules_to_not_convert(dense, tmp_path):
    src, original = dense
    main([str(src), str(tmp_path), "--format", "awq", "--group-size", str(GROUP_SIZE),
          "--modules-to-not-convert", "down_proj"])
    t = load_file(tmp_path / "model.safetensors")
    assert torch.equal(t["model.layers.1.mlp.down_proj.weight"], original["model.layers.1.mlp.down_proj.weight"])
    assert "model.layers.1.mlp.down_proj.qweight" not in t and "model.layers.1.mlp.up_proj.qweight" in t
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == \
        ["down_proj"]


def cli_error(argv: list[str], capsys) -> str:
    """The CLI's message for a user error: exit status 2, one line on stderr, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_writer_rejects_bad_requests(dense, tmp_path, capsys):
    src, _ = dense
    assert re.search(r"cannot quantize model\.layers\.0\..*must be a multiple of group_size=48",
                     cli_error([str(src), str(tmp_path / "a"), "--format", "awq", "--group-size", "48"], capsys))
    main([str(src), str(tmp_path / "b"), "--format", "fp8"])
    assert "already has a quantization_config" in cli_error([str(tmp_path / "b"), str(tmp_path / "c"), "--format",
                                                             "awq"], capsys)
    assert f"{tmp_path / 'nowhere'} has no config.json" in cli_error([str(tmp_path / "nowhere"), str(tmp_path / "d"),
                                                                      "--format", "awq"], capsys)


def test_writer_refuses_block_fp8_it_cannot_load(dense, tmp_path, capsys):
    """q_proj (N=64) and k_proj (N=32) would be fused with k/v along N, cutting a 128-row block: refused, naming it;
    the fix the message gives (keep self_attn dense) writes a checkpoint that loads and runs."""
    src, _ = dense
    err = cli_error([str(src), str(tmp_path / "a"), "--format", "fp8", "--fp8-scheme", "block"], capsys)
    assert re.search(r"model\.layers\.0\.self_attn\.[qk]_proj\.weight has N=(64|32) outputs, not a multiple of "
                     "the 128-row fp8 block", err)
    assert not (tmp_path / "a").exists()
    assert "--modules-to-not-convert self_attn" in err
    main([str(src), str(tmp_path / "b"), "--format", "fp8", "--fp8-scheme", "block",
          "--modules-to-not-convert", "self_attn"])
    byte_tokenizer().save_pretrained(tmp_path / "b")  # the tiny source has no tokenizer files
    model = tritonq.load(tmp_path / "b", max_seq_len=16)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.weight, FP8Weight)
    assert len(model.generate([1, 2, 3], max_new_tokens=2, return_dict=True).token_ids[0]) == 2


def test_writer_refuses_a_non_empty_destination_before_any_work(dense, tmp_path, capsys):
    """An existing checkpoint in DST is never overwritten silently: refused before calibrating or reading a
    tensor (the missing calibration file would be the error otherwise), its files left byte for byte."""
    src, _ = dense
    dst = tmp_path / "existing"
    dst.mkdir()
    (dst / "config.json").write_text("{\"keep\": 1}")
    (dst / "model.safetensors").write_bytes(b"precious")
    err = cli_error([str(src), str(dst), "--format", "gptq", "--method", "gptq", "--calibration",
                     str(tmp_path / "missing.txt")], capsys)
    assert f"DST {dst} is not empty (it holds config.json, model.safetensors)" in err and "--overwrite" in err
    assert (dst / "config.json").read_text() == "{\"keep\": 1}" and (dst / "model.safetensors").read_bytes() == b"precious"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_quantized(src, dst, "awq", group_size=GROUP_SIZE)
    (tmp_path / "file").write_text("x")
    assert f"DST {tmp_path / 'file'} is a file" in cli_error([str(src), str(tmp_path / "file"), "--format", "fp8"], capsys)
    assert "is SRC" in cli_error([str(src), str(src), "--format", "fp8", "--overwrite"], capsys)
    main([str(src), str(tmp_path / "empty"), "--format", "fp8"])  # absent: written
    (tmp_path / "made").mkdir()
    main([str(src), str(tmp_path / "made"), "--format", "fp8"])  # empty: written
    assert json.loads((tmp_path / "made" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_overwrite_replaces_the_whole_destination(dense, tmp_path):
    src, _ = dense
    dst = tmp_path / "dst"
    main([str(src), str(dst), "--format", "fp8"])
    (dst / "stale.bin").write_bytes(b"from an older checkpoint")
    main([str(src), str(dst), "--format", "awq", "--group-size", str(GROUP_SIZE), "--overwrite"])
    assert not (dst / "stale.bin").exists()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert "model.layers.0.self_attn.q_proj.qweight" in load_file(dst / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # nothing staged or set aside is left


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_write_leaves_no_half_checkpoint(dense, tmp_path, monkeypatch, existing):
    """The tensors file fails half-written (a full disk): DST is as before (absent, or the old checkpoint
    under --overwrite) and nothing staged remains beside it."""
    src, _ = dense
    dst = tmp_path / "dst"
    if existing:
        main([str(src), str(dst), "--format", "fp8"])
    before = {p.name: p.read_bytes() for p in dst.iterdir()} if existing else None

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(writer, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_quantized(src, dst, "awq", group_size=GROUP_SIZE, overwrite=True)
    assert ({p.name: p.read_bytes() for p in dst.iterdir()} if dst.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["dst"] if existing else [])
