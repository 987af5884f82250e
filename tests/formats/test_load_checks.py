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


# --- non-finite values (issue 27): refused at load, naming the tensor, its file and the count ----------------

def poke(name, count, value=float("nan")):
    """An edit setting the first `count` values of tensor `name` to value (NaN by default)."""
    def edit(t):
        flat = t[name].reshape(-1).clone()
        flat[:count] = value
        t[name] = flat.reshape(t[name].shape)
    return edit


def poke_fp8_nan(name, count):
    """An edit writing the e4m3 NaN bytes 0x7F / 0xFF into the first `count` values of fp8 tensor `name`."""
    def edit(t):
        codes = t[name].view(torch.uint8).reshape(-1).clone()
        codes[:count] = torch.tensor([0x7F, 0xFF] * count, dtype=torch.uint8)[:count]
        t[name] = codes.view(torch.float8_e4m3fn).reshape(t[name].shape)
    return edit


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    """The base checkpoint written as AWQ, GPTQ and per-tensor FP8 by the project's writer."""
    from tritonq.quantize.writer import write_quantized
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: write_quantized(base, root / fmt, fmt, group_size=32) for fmt in ("awq", "gptq", "fp8")}


NONFINITE = {  # case: (checkpoint (None: dense base), tensor edit, phrase)
    "dense-weight-nan": (None, poke("model.layers.1.mlp.down_proj.weight", 3),
                         r"'model.layers.1.mlp.down_proj.weight' in model.safetensors \(3 of 15360 values\)"),
    "norm-inf": (None, poke("model.norm.weight", 1, float("inf")), r"'model.norm.weight' in model.safetensors \(1 of 96"),
    "embedding-neg-inf": (None, poke("model.embed_tokens.weight", 2, -float("inf")),
                          r"'model.embed_tokens.weight' in model.safetensors \(2 of"),
    "awq-scales-nan": ("awq", poke("model.layers.0.self_attn.q_proj.scales", 4),
                       r"'model.layers.0.self_attn.q_proj.scales' in model.safetensors \(4 of"),
    "gptq-scales-inf": ("gptq", poke("model.layers.1.mlp.up_proj.scales", 5, float("inf")),
                        r"'model.layers.1.mlp.up_proj.scales' in model.safetensors \(5 of"),
    "fp8-weight-nan-bytes": ("fp8", poke_fp8_nan("model.layers.0.mlp.gate_proj.weight", 2),
                             r"'model.layers.0.mlp.gate_proj.weight' in model.safetensors \(2 of 15360"),
    "fp8-scale-nan": ("fp8", poke("model.layers.0.self_attn.o_proj.weight_scale", 1),
                      r"'model.layers.0.self_attn.o_proj.weight_scale' in model.safetensors \(1 of 1 values\)"),
}


@pytest.mark.parametrize("case", list(NONFINITE))
def test_nonfinite_values_are_refused_naming_the_tensor(base, quantized, tmp_path, case):
    source, tensors, phrase = NONFINITE[case]
    folder = edit(base if source is None else quantized[source], tmp_path / case, tensors=tensors)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) hold non-finite values \(NaN or inf\).*" + phrase) as info:
        tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
    assert "re-download it, or re-quantize it" in str(info.value)


def test_nonfinite_count_of_each_float_dtype():
    from tritonq.formats.checkpoint import nonfinite_count
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.ones(1000, dtype=dtype)
        assert int(nonfinite_count(t)) == 0
        t[[3, 500, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        assert int(nonfinite_count(t)) == 3
    codes = torch.tensor([0x00, 0x7E, 0x7F, 0xFE, 0xFF], dtype=torch.uint8)  # 0x7E / 0xFE: +-448, finite
    assert int(nonfinite_count(codes.view(torch.float8_e4m3fn))) == 2
    assert int(nonfinite_count(codes[:2].view(torch.float8_e4m3fn))) == 0
    e5m2 = torch.tensor([0x7B, 0x7C, 0x7F, 0xFB, 0xFC], dtype=torch.uint8)  # 0x7C / 0xFC: +-inf, 0x7F: NaN
    assert int(nonfinite_count(e5m2.view(torch.float8_e5m2))) == 3
    assert nonfinite_count(torch.ones(4, dtype=torch.int32)) is None  # packed codes cannot be non-finite


# --- header checks before any read (issue 27): a bad last tensor fails with no data read ----------------------

BEFORE_ANY_READ = {  # case: (checkpoint (None: dense base), tensor edit, error type, phrase)
    "last-tensor-missing": (None, drop("model.norm.weight"), KeyError, "'model.norm.weight' not found"),
    "last-tensor-wrong-dtype": (None, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(
        torch.float8_e4m3fn)), ValueError, r"'model.norm.weight' .* has dtype torch.float8_e4m3fn"),
    "head-wrong-shape": (None, put("lm_head.weight", (258, 95)), ValueError, r"'lm_head.weight' has shape \[258, 95\]"),
    "awq-last-scales-missing": ("awq", drop("model.layers.1.mlp.down_proj.scales"), KeyError,
                                "'model.layers.1.mlp.down_proj.scales' not found"),
    "gptq-last-qzeros-wrong-dtype": ("gptq", lambda t: t.__setitem__("model.layers.1.mlp.down_proj.qzeros", t[
        "model.layers.1.mlp.down_proj.qzeros"].to(torch.int64)), ValueError,
        r"'model.layers.1.mlp.down_proj.qzeros' has dtype torch.int64, expected torch.int32"),
    "fp8-last-scale-wrong-shape": ("fp8", put("model.layers.1.mlp.down_proj.weight_scale", (3,)), ValueError,
                                   r"'model.layers.1.mlp.down_proj.weight_scale' has shape \[3\]"),
}


@pytest.mark.parametrize("case", list(BEFORE_ANY_READ))
def test_header_checks_fail_before_any_tensor_is_read(base, quantized, tmp_path, monkeypatch, case):
    from tritonq.formats.checkpoint import Weights
    source, tensors, error, phrase = BEFORE_ANY_READ[case]
    folder = edit(base if source is None else quantized[source], tmp_path / case, tensors=tensors)
    reads = []
    real = Weights._read_exactly  # every data read (get_tensor, read_into) goes through it
    monkeypatch.setattr(Weights, "_read_exactly", lambda self, f, t, name: (reads.append(name), real(self, f, t, name)))
    monkeypatch.setattr(Weights, "get_sharded", lambda *a, **k: pytest.fail("a sharded read"))
    with pytest.raises(error, match=phrase):
        tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
    assert reads == []


def test_a_good_checkpoint_still_loads_reading_each_tensor_once(base, quantized, monkeypatch, caplog):
    """The dry run reads nothing: a normal load reads every tensor once, and a tokenizer smaller than vocab_size
    (here the same size) gives no warning."""
    from tritonq.formats.checkpoint import Weights
    real = Weights._read_exactly
    for folder in (base, quantized["gptq"]):
        reads = []
        monkeypatch.setattr(Weights, "_read_exactly",
                            lambda self, f, t, name: (reads.append(name), real(self, f, t, name)))
        with caplog.at_level("WARNING", logger="tritonq"):
            model = tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
        assert isinstance(model.generate("hi", max_new_tokens=2), str)
        assert sorted(reads) == sorted(load_file(folder / "model.safetensors"))  # each < 4 MiB: one read each
        assert not [r for r in caplog.records if r.name == "tritonq"]


# --- files are unambiguous (issue 27) ------------------------------------------------------------------------

def test_a_tensor_in_two_files_is_refused_naming_both(base, tmp_path):
    folder = edit(base, tmp_path / "dup")
    save_file({"model.norm.weight": torch.ones(96)}, folder / "extra.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' is stored in both extra.safetensors and "
                                         r"model.safetensors"):
        tritonq.load(folder, max_num_seqs=1, max_seq_len=16)


def test_an_index_decides_and_stray_files_are_ignored_with_one_warning(base, tmp_path):
    folder = edit(base, tmp_path / "indexed")
    names = list(load_file(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    save_file({"model.norm.weight": torch.full((96,), 7.0)}, folder / "stray.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"ignoring 1 \*.safetensors file\(s\) that model.safetensors.index.json "
                                         r"does not name: \['stray.safetensors'\]"):
        model = tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
    assert torch.equal(model.model.norm.weight, load_file(folder / "model.safetensors")["model.norm.weight"])


# --- tokenizer vs model (issue 27): warned at load, stating what generation will do ---------------------------

def test_tokenizer_larger_than_vocab_warns(tmp_path, caplog):
    from formats.helpers import dense_llama
    save(dense_llama(vocab=200), tmp_path)  # the byte tokenizer has 258 tokens
    with caplog.at_level("WARNING", logger="tritonq"):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=16)
    assert "the tokenizer has 258 tokens but config.json has vocab_size=200" in caplog.text
    assert "ids 200..257, so a prompt that encodes to any of them is refused" in caplog.text


def test_no_eos_anywhere_warns(base, tmp_path, caplog, monkeypatch):
    folder = edit(base, tmp_path / "no_eos", config={"eos_token_id": None})
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    with caplog.at_level("WARNING", logger="tritonq"):
        model = tritonq.load(folder, max_num_seqs=1, max_seq_len=16)
    if model.tokenizer.eos_token_id is not None:
        pytest.skip("this tokenizer keeps an EOS token whatever tokenizer_config.json says")
    assert "no EOS token id in config.json, generation_config.json or the tokenizer: generation runs until " \
           "max_new_tokens or a stop string" in caplog.text


def test_load_reads_config_json_once(base, monkeypatch):
    """tritonq.load parses config.json once and hands the dict down (the checks, transformers' config and
    tokenizer, the loader) instead of each reading the file: every read of a file named config.json is counted
    (an open that reads nothing, the files' readability check, is not a read)."""
    import builtins
    import io
    from pathlib import Path

    reads, real_open = [], io.open

    class Counted:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def read(self, *args):
            reads.append(self.name)
            return self.f.read(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    def counting_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        return Counted(f, str(file)) if isinstance(file, (str, Path)) and Path(file).name == "config.json" else f

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    tritonq.load(base, max_seq_len=64)
    assert reads == [str(base / "config.json")]
