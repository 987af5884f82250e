"""The checkpoint boundary (issues #14 / #15): a config that disagrees with the weights, a tensor of the
wrong shape, an untied model without its head, or a stored tensor no module reads is refused at load,
before any generation, by an error naming the tensor; a harmless leftover only warns."""
import json
import shutil

import pytest
import torch
from formats.helpers import dense_llama, save
from safetensors.torch import load_file, save_file

import tritonq


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    save(dense_llama(), folder)
    return folder


def edit(src, dst, config=None, tensors=None):
    """A copy of checkpoint src in dst with config keys replaced and tensors edited by tensors(dict)."""
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(c | config))
    if tensors:
        stored = load_file(dst / "model.safetensors")
        tensors(stored)
        save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def drop(name):
    return lambda t: t.pop(name)


def put(name, shape):
    return lambda t: t.__setitem__(name, torch.randn(shape))


BAD = {  # case: (config changes, tensor edit, error type, phrase of the message)
    "untied-without-lm_head": ({}, drop("lm_head.weight"), ValueError,
                               "tie_word_embeddings=false but the checkpoint has no lm_head.weight"),
    "hidden_size-disagrees": ({"hidden_size": 72, "head_dim": 16}, None, ValueError,
                              r"'model.embed_tokens.weight' has shape \[258, 96\], but config.json implies \[258, 72\]"),
    "dense-linear-wrong-shape": ({}, put("model.layers.1.mlp.down_proj.weight", (96, 150)), ValueError,
                                r"'model.layers.1.mlp.down_proj.weight' has shape \[96, 150\], but config.json implies "
                                r"\[N=96, K=160\]"),
    "norm-wrong-shape": ({}, put("model.layers.0.input_layernorm.weight", (95,)), ValueError,
                         r"'model.layers.0.input_layernorm.weight' has shape \[95\], but config.json implies \[96\]"),
    "fewer-layers-in-config": ({"num_hidden_layers": 1}, None, ValueError,
                               r"stored tensor\(s\) were not used by any module of the model: model.layers.1."),
    "unknown-extra-tensor": ({}, put("model.layers.0.mlp.extra_proj.weight", (4, 4)), ValueError,
                             "not used by any module of the model: model.layers.0.mlp.extra_proj.weight"),
    "fp8-tensor-read-as-dense": ({}, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(
        torch.float8_e4m3fn)), ValueError, r"'model.norm.weight' .* has dtype torch.float8_e4m3fn, expected a float16"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_at_load(base, tmp_path, case):
    config, tensors, error, phrase = BAD[case]
    folder = edit(base, tmp_path / case, config, tensors)
    with pytest.raises(error, match=phrase):
        tritonq.load(folder, max_num_seqs=1, max_seq_len=16)


def test_harmless_leftover_warns_and_loads(base, tmp_path):
    folder = edit(base, tmp_path / "inv_freq", tensors=put("model.layers.0.self_attn.rotary_emb.inv_freq", (8,)))
    with pytest.warns(UserWarning, match=r"ignoring 1 stored tensor\(s\).*rotary_emb.inv_freq"):
        tritonq.load(folder, max_num_seqs=1, max_seq_len=16)


def test_tied_checkpoint_that_also_stores_lm_head_ties_it(base, tmp_path):
    """tie_word_embeddings true with a stored lm_head.weight: transformers ties (the copy is unused), so do we."""
    folder = edit(base, tmp_path / "tied", config={"tie_word_embeddings": True},
                  tensors=lambda t: t.__setitem__("lm_head.weight", torch.randn_like(t["lm_head.weight"])))
    model = tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
    logits = model.engine.prompt_logits([5, 7, 9])
    assert torch.equal(model.model.lm_head.weight.weight, model.model.embed_tokens.weight)
    assert logits.shape == (3, 258)


@pytest.mark.parametrize("quantize", ["fp8", "fp8-mlp"])  # int4 needs a group size dividing K=96: not a load option
def test_quantize_on_load_reads_every_tensor(base, quantize):
    """Norms and embeddings of a dense checkpoint quantized on load are still read as plain tensors."""
    model = tritonq.load(base, quantize=quantize, max_num_seqs=1, max_seq_len=16)
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "FP8Weight"
    assert type(model.model.layers[0].self_attn.o_proj.weight).__name__ == ("FP8Weight" if quantize == "fp8"
                                                                              else "DenseWeight")
