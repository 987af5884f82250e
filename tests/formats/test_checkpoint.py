"""Weights (safetensors access over a folder) and the error paths of loading: every bad input
raises an error that names the file and/or tensor, before anything is handed to the model."""
import json
import shutil

import pytest
import torch
from formats.helpers import GROUP_SIZE
from safetensors.torch import load_file, save_file

from tritonq.formats.checkpoint import Weights
from tritonq.formats.registry import get_loader
from tritonq.api.hub import resolve
from tritonq.quantize.writer import write_quantized

TENSORS = {"a.weight": torch.arange(24, dtype=torch.float16).reshape(6, 4), "b.qweight": torch.arange(8, dtype=torch.int32)}


@pytest.fixture
def sharded(tmp_path):
    save_file({"a.weight": TENSORS["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b.qweight": TENSORS["b.qweight"]}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.qweight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def test_sharded_folder_reads_every_tensor_and_slices(sharded):
    w = Weights(sharded)
    assert sorted(w.names()) == sorted(TENSORS)
    for name, t in TENSORS.items():
        assert torch.equal(w.get_tensor(name), t)
    assert torch.equal(w.get_sharded("a.weight", dim=0, rank=1, world=3), TENSORS["a.weight"][2:4])
    assert torch.equal(w.get_sharded("a.weight", dim=1, rank=0, world=2), TENSORS["a.weight"][:, :2])
    with pytest.raises(ValueError, match=r"'a.weight' has size 4 along dim 1, not divisible by world size 3"):
        w.get_sharded("a.weight", dim=1, rank=0, world=3)


def test_dtype_shape_and_missing_tensor_errors_name_file_and_tensor(sharded):
    w = Weights(sharded)
    with pytest.raises(ValueError, match=r"model-00001-of-00002.safetensors: tensor 'a.weight' has dtype torch.float16, "
                                         r"expected torch.int32"):
        w.get_tensor("a.weight", dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tensor 'a.weight' has shape \[6, 4\], expected \[4, 6\]"):
        w.get_tensor("a.weight", shape=(4, 6))
    with pytest.raises(KeyError, match="'c.weight' not found in checkpoint"):
        w.get_tensor("c.weight")


def test_index_pointing_at_missing_shard(sharded):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        Weights(sharded)


def test_index_mapping_a_tensor_to_the_wrong_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["b.qweight"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'b.qweight' is mapped to model-00001-of-00002.safetensors, which does not"):
        Weights(sharded)


def test_truncated_and_corrupt_files(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"model.safetensors: (corrupt or )?truncated"):
        Weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated"):
        Weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        Weights(tmp_path)


@pytest.fixture
def awq(tiny_llama, tmp_path):
    return write_quantized(tiny_llama, tmp_path / "awq", "awq", group_size=GROUP_SIZE)


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= changes
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"quant_method": "hqq"}, r"quant_method='hqq' is not supported \(supported: \['awq', 'bitsandbytes', "),
    ({"quant_method": "exl2", "bits": 4.25}, r"quant_method='exl2'. EXL2 \(ExLlamaV2's mixed-bit format\) is not "
                                            r"supported: .* Load a GPTQ, AWQ, bitsandbytes or FP8 upload"),
    ({"version": "gemv"}, r"AWQ version 'gemv' is not supported \(supported: 'gemm'\)"),
    ({"bits": 3}, r"AWQ bits=3 is not supported \(supported: 4\)"),
    ({"group_size": 48}, r"AWQ group_size=48 is not supported \(supported: \(-1, 32, 64, 128, 256\)\)"),
    ({"quant_method": "gptq", "bits": 2}, r"GPTQ quantization_config: bits=2 is not supported \(supported: \(4, 8\)\)"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, r"activation_scheme='weird' is not supported"),
])
def test_unsupported_quantization_config(awq, changes, message):
    edit_config(awq, **changes)
    with pytest.raises(ValueError, match=message):
        get_loader(awq, torch.float16, "cpu")


def test_exl2_tensors_without_a_quantization_config_are_refused(tiny_llama, tmp_path):
    """Older EXL2 uploads have no quantization_config: their '*.q_groups' tensors say what they are."""
    folder = tmp_path / "exl2"
    shutil.copytree(tiny_llama, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.q_groups"] = torch.tensor([4, 0], dtype=torch.int16)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensors named '\*.q_groups' are EXL2's. EXL2 .* is not supported"):
        get_loader(folder, torch.float16, "cpu")


def test_quantize_on_load_needs_a_dense_checkpoint(awq, tiny_llama):
    with pytest.raises(ValueError, match="needs a dense checkpoint, but .* is already awq-quantized"):
        get_loader(awq, torch.float16, "cpu", quantize="fp8")
    with pytest.raises(ValueError, match=r"quantize='int3' is not supported"):
        get_loader(tiny_llama, torch.float16, "cpu", quantize="int3")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.scales"), "'model.layers.0.self_attn.q_proj.scales' not found"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.scales": torch.ones(3, 64, dtype=torch.float16)}),
     r"'model.layers.0.self_attn.q_proj.scales' has shape \[3, 64\], expected \[2, 64\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.qzeros":
                         t["model.layers.0.self_attn.q_proj.qzeros"].to(torch.int16)}),
     r"'model.layers.0.self_attn.q_proj.qzeros' has dtype torch.int16, expected torch.int32"),
])
def test_bad_quantized_tensors_name_the_tensor(awq, edit, message):
    tensors = load_file(awq / "model.safetensors")
    edit(tensors)
    save_file(tensors, awq / "model.safetensors")
    loader = get_loader(awq, torch.float16, "cpu")
    with pytest.raises((KeyError, ValueError), match=message):
        loader.get_linear("model.layers.0.self_attn.q_proj")


def test_hub_resolve(tiny_llama, tmp_path, monkeypatch):
    assert resolve(str(tiny_llama)) == tiny_llama
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder"):
        resolve(str(tmp_path / "nowhere"))
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="'tritonq-test/no-such-model' .* is not in the local cache"):
        resolve("tritonq-test/no-such-model", cache_dir=tmp_path / "cache")


def test_hub_resolve_follows_the_index_past_a_merged_copy(tmp_path, monkeypatch):
    """A repo with both model.safetensors and an index + 2 shards: only the shards are fetched.
    huggingface_hub.snapshot_download is replaced by a fake hub that copies the files matching
    allow_patterns (fnmatch, as the hub filters) into one snapshot folder; no network."""
    import fnmatch

    import huggingface_hub
    repo = {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "merged",
            "model-00001-of-00002.safetensors": "1", "model-00002-of-00002.safetensors": "2",
            "model.safetensors.index.json": json.dumps({"weight_map": {
                "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})}
    snapshot, asked = tmp_path / "snapshot", []

    def fake_snapshot_download(name, revision=None, cache_dir=None, allow_patterns=None):
        asked.append(list(allow_patterns))
        snapshot.mkdir(exist_ok=True)
        for file, text in repo.items():
            if any(fnmatch.fnmatch(file, p) for p in allow_patterns):
                (snapshot / file).write_text(text)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve("org/model") == snapshot
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                      "model-00002-of-00002.safetensors"]
    assert asked[-1] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    del repo["model.safetensors.index.json"]  # no index: every *.safetensors, as before
    snapshot_files = list(snapshot.iterdir())
    for f in snapshot_files:
        f.unlink()
    resolve("org/model")
    assert (snapshot / "model.safetensors").exists() and asked[-1] == ["*.safetensors"]


def test_progress_bar_counts_stored_bytes_once_per_tensor(sharded):
    w = Weights(sharded)
    total = sum(t.numel() * t.element_size() for t in TENSORS.values())  # 48 + 32 bytes of data
    with w.progress() as bar:
        assert bar.total == total and bar.n == 0
        w.get_tensor("a.weight")
        w.get_tensor("a.weight")  # a second read of the same tensor counts once
        assert bar.n == TENSORS["a.weight"].numel() * 2
        w.get_sharded("b.qweight", dim=0, rank=0, world=2)  # a shard counts its whole tensor
        assert bar.n == total
    w.get_tensor("b.qweight")  # outside progress(): nothing to update, no error


def test_load_shows_a_progress_bar_that_can_be_silenced(tmp_path, capsys):
    import tritonq
    from tritonq.demo import write_tiny_llama
    folder = write_tiny_llama(tmp_path / "tiny", hidden_size=32, num_layers=1)
    tritonq.load(folder, device="cpu", max_num_seqs=1, max_seq_len=8)
    assert "Loading tiny" in capsys.readouterr().err
    weights = Weights(folder)
    with weights.progress(enabled=False) as bar:
        assert bar.disable


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16, torch.float32])
def test_read_into_streams_into_any_layout_and_dtype(tmp_path, stored):
    """Weights.read_into fills a strided [K, N]-storage view in fp32 block by block (chunks far smaller than
    the tensor, rows that do not divide into them) with exactly safetensors' own values, converted."""
    tensors = {"w": torch.randn(37, 23).to(stored), "v": torch.randn(5).to(stored), "s": torch.tensor(2.5).to(stored)}
    save_file(tensors, tmp_path / "model.safetensors")
    w, reference = Weights(tmp_path), load_file(tmp_path / "model.safetensors")
    out = torch.empty(23, 37).t()  # W [37, 23] stored [23, 37]
    w.read_into("w", out, chunk_bytes=3 * 23 * stored.itemsize + 1)  # 3 rows a block: 13 blocks, the last of 1
    assert not out.is_contiguous() and torch.equal(out, reference["w"].float())
    for name in ("v", "s"):
        assert torch.equal(w.read_into(name, torch.empty(reference[name].shape)), reference[name].float())
    with pytest.raises(ValueError, match=r"'w' has shape \[37, 23\], expected \[23, 37\]"):
        w.read_into("w", torch.empty(23, 37))


def test_dense_fp32_linears_load_straight_into_the_cpu_gemv_layout(tmp_path):
    """A dense fp32 checkpoint on CPU: each fused linear (q/k/v, gate/up) is W [N, K] over [K, N]-contiguous
    storage (the layout Linear runs), equal to the stored parts concatenated; nothing re-laid out later."""
    from formats.helpers import dense_llama, save

    import tritonq
    save(dense_llama(), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    layer = tritonq.load(tmp_path, device="cpu", dtype=torch.float32, max_num_seqs=1, max_seq_len=8).model.layers[1]
    pre = "model.layers.1."
    cases = [(layer.self_attn.qkv_proj, [pre + f"self_attn.{p}_proj.weight" for p in "qkv"]),
             (layer.mlp.gate_up_proj, [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]),
             (layer.mlp.down_proj, [pre + "mlp.down_proj.weight"])]
    for linear, names in cases:
        w = linear.weight.weight
        assert w.t().is_contiguous() and w.untyped_storage().nbytes() == w.nbytes
        assert torch.equal(w, torch.cat([stored[n] for n in names]))
