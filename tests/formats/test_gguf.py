"""GGUF checkpoints end to end: tiny Llama and Qwen3-MoE models written as GGUF (tests/formats/gguf_files.py) in
F32, Q8_0, Q4_0, Q4_K, Q6_K and a Q4_K_M-style mix load with tritonq.load and give transformers' logits and greedy
tokens, transformers running the same weights as the file holds them (dequantized by the gguf package) in fp32.
Also: config and tokenizer from the metadata, and bad files refused before any weight is read."""
import copy

import numpy as np
import pytest
import torch

import gguf  # noqa: E402  (a tritonq dependency: never skipped)

import tritonq  # noqa: E402
from formats.gguf_files import quantize_q4_k, quantize_q6_k, write_gguf  # noqa: E402
from tritonq.formats.gguf import GGUFWeights  # noqa: E402

SCHEMES = ["F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M"]
PROMPTS = [[0, 5, 77, 300, 12], [0, 1999, 3, 3, 3, 41, 7, 1000, 256], [0]]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), config


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1)
    return Qwen3MoeForCausalLM(config).eval(), config


def spread(model):
    """Weights of varied range per element (random init is a narrow std 0.02), norms around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.mul_(torch.empty_like(p).uniform_(0.5, 8))
    return model


def reference_model(model, reference):
    """`model` with the file's weights as the gguf package dequantizes them (experts refused into transformers'
    fused layout)."""
    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    with torch.no_grad():
        for name in sd:
            if name.endswith("experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                E = sd[name].shape[0]
                sd[name].copy_(torch.stack([torch.cat([reference[f"{prefix}{e}.gate_proj.weight"],
                                                       reference[f"{prefix}{e}.up_proj.weight"]]) for e in range(E)]))
            elif name.endswith("experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                sd[name].copy_(torch.stack([reference[f"{prefix}{e}.down_proj.weight"] for e in range(sd[name].shape[0])]))
            elif name in reference:
                sd[name].copy_(reference[name])
            elif name == "lm_head.weight":
                sd[name].copy_(reference["model.embed_tokens.weight"])
            else:
                raise AssertionError(f"{name} not written")
    return ref


@pytest.fixture(scope="module")
def llama():
    model, _ = tiny_llama()
    return spread(model)


@pytest.fixture(scope="module")
def qwen3_moe():
    model, _ = tiny_qwen3_moe()
    return spread(model)


def check_against_transformers(model, path, scheme):
    reference = write_gguf(model, path, scheme)
    ref = reference_model(model, reference)
    ours = tritonq.load(path, dtype=torch.float32, device="cpu", max_num_seqs=4, kv_cache_gb=0.05)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        # fp32 on both sides, different summation orders over a few layers of K <= 512: logits O(10)
        torch.testing.assert_close(ours.engine.prompt_logits(prompt).float(), want, atol=2e-3, rtol=1e-4)
    out = ours.generate(PROMPTS, max_new_tokens=8, temperature=0.0, ignore_eos=True, return_dict=True)
    for prompt, got in zip(PROMPTS, out.token_ids):
        want_ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=1,
                                eos_token_id=None)[0, len(prompt):].tolist()
        assert got == want_ids, (scheme, prompt)
    return ours


# resident bytes per weight of the GGUFWeight planes (docs/gguf.md's table): 4-bit codes, the bits above, fp32 scales
# (and offsets) per group
RESIDENT_BYTES = {"Q4_K": 0.5 + 2 * 4 / 32, "Q6_K": 0.5 + 0.25 + 4 / 16}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llama_gguf_equals_transformers(llama, tmp_path, scheme):
    """Q4_K_M: every layer linear keeps its block format (q / k / v of mixed types as a PartsWeight), so the
    typed weights hold the formats' bytes, none dense."""
    from formats.gguf_files import gguf_name, type_for

    from tritonq.formats.layers import Linear
    ours = check_against_transformers(llama, tmp_path / f"llama-{scheme}.gguf", scheme)
    if scheme == "Q4_K_M":
        linears = {name: m.weight for name, m in ours.model.named_modules()
                   if isinstance(m, Linear) and name != "lm_head"}
        held = sum(t.numel() * t.element_size() for w in linears.values() for t in w.tensors().values())
        expected = sum(p.numel() * RESIDENT_BYTES[type_for(gguf_name(name), scheme)]
                       for name, p in llama.named_parameters() if ".layers." in name and "norm" not in name)
        assert held == expected
        assert {type(w).__name__ for w in linears.values()} == {"GGUFWeight", "PartsWeight"}


@pytest.mark.parametrize("scheme, expert_types", [("Q8_0", ("Int4Weight", "Int4Weight")),
                                                   ("Q4_K_M", ("GGUFWeight", "GGUFWeight")),
                                                   ("Q4_K_M up Q6_K", ("PartsWeight", "GGUFWeight"))])
def test_qwen3_moe_gguf_equals_transformers(qwen3_moe, tmp_path, scheme, expert_types):
    """The experts keep their block formats through fused_moe (Q4_K_M: Q4_K gate/up, Q6_K down as GGUFWeight); a
    Q4_K gate beside a Q6_K up stays so too (a PartsWeight of the two stacked GGUFWeights, no dense copy): its
    experts hold the formats' resident bytes, 0.75 + 1.0 a gate + up weight pair where dense fp32 held 8."""
    from tritonq.formats.layers import RoutedExperts
    ours = check_against_transformers(qwen3_moe, tmp_path / f"qwen3moe-{scheme.replace(' ', '-')}.gguf", scheme)
    experts = [m for m in ours.model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 2
    for m in experts:
        assert (type(m.gate_up).__name__, type(m.down).__name__) == expert_types
        if scheme == "Q4_K_M":
            assert (m.gate_up.type_name, m.down.type_name) == ("Q4_K", "Q6_K")
        if scheme == "Q4_K_M up Q6_K":
            assert [p.type_name for p in m.gate_up.parts] == ["Q4_K", "Q6_K"]
            config = qwen3_moe.config
            gate_weights = config.num_experts * config.moe_intermediate_size * config.hidden_size
            held = sum(t.numel() * t.element_size() for t in m.gate_up.tensors().values())
            assert held == gate_weights * (RESIDENT_BYTES["Q4_K"] + RESIDENT_BYTES["Q6_K"])


def test_test_quantizers_round_trip_through_gguf_dequantizer():
    """The test-only Q4_K / Q6_K quantizers write blocks the gguf package's dequantizer reads back within the
    formats' rounding: Q6_K within half a step of 63 levels per 16 values, Q4_K within a step of 15 per 32 (plus
    the 6-bit rounding of each sub-block's scale and min)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 10, (8, 1))).astype(np.float32)
    for quantize, qtype, levels, block in ((quantize_q6_k, "Q6_K", 63, 16), (quantize_q4_k, "Q4_K", 15, 32)):
        back = gguf.quants.dequantize(quantize(x), gguf.GGMLQuantizationType[qtype])
        ranges = np.ptp(x.reshape(8, -1, block), axis=-1, keepdims=True)
        err = np.abs(back - x).reshape(8, -1, block)
        assert (err <= ranges / levels * 1.5 + 1e-6).all(), qtype
        assert np.abs(back - x).mean() < np.abs(x).mean() * 4 / levels, qtype  # a wrong bit layout: errors ~ x


def test_config_and_tokenizer_come_from_the_metadata(llama, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from formats.gguf_files import CHAT_TEMPLATE, SHIPPED_TOKENIZER
    from tritonq.formats.gguf import read_config, tokenizer
    path = tmp_path / "llama.gguf"
    write_gguf(llama, path, "Q8_0")
    weights = GGUFWeights([path])
    config, c = read_config(weights), llama.config
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"],
            config["max_position_embeddings"], config["head_dim"]) == \
        ("llama", c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
         c.intermediate_size, c.vocab_size, c.max_position_embeddings, c.head_dim)
    assert config["rms_norm_eps"] == pytest.approx(c.rms_norm_eps) and config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True
    ours, shipped = tokenizer(weights), PreTrainedTokenizerFast(tokenizer_file=str(SHIPPED_TOKENIZER))
    for text in ["hello world", "  Two spaces, punctuation!? and digits 12345", "über 😀"]:
        assert ours.encode(text, add_special_tokens=False) == shipped.encode(text, add_special_tokens=False)
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.bos_token_id, ours.eos_token_id) == (0, 1)


@pytest.mark.parametrize("type_name, bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_q4_0_and_q8_0_linears_load_as_int_weights_exactly(llama, tmp_path, type_name, bits):
    from tritonq.formats.gguf import GGUFLoader, read_config
    from tritonq.quant.weights import Int4Weight
    path = tmp_path / "llama.gguf"
    reference = write_gguf(llama, path, type_name)
    weights = GGUFWeights([path])
    loader = GGUFLoader(weights, read_config(weights), torch.float32, "cpu")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        w = loader.get_linear(name)
        assert isinstance(w, Int4Weight) and (w.bits, w.group_size, w.zeros) == (bits, 32, None)
        # exact: the same fp32 values as the gguf package's dequantization (q / k rows back in HF order)
        assert torch.equal(w.dequantize(torch.float32), reference[f"{name}.weight"])


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_other_block_linears_load_as_gguf_weights_exactly(llama, tmp_path, type_name):
    from tritonq.formats.gguf import GGUFLoader, read_config
    from tritonq.quant.weights import GGUFWeight
    path = tmp_path / f"llama-{type_name}.gguf"
    reference = write_gguf(llama, path, type_name)
    weights = GGUFWeights([path])
    loader = GGUFLoader(weights, read_config(weights), torch.float32, "cpu")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        w = loader.get_linear(name)
        assert isinstance(w, GGUFWeight) and w.type_name == type_name
        assert torch.equal(w.dequantize().view(torch.int32), reference[f"{name}.weight"].view(torch.int32))


def test_a_fused_group_of_mixed_block_types_keeps_each_type(llama, tmp_path):
    """Q4_K_M: q / k in Q4_K, v in Q6_K: one fused q/k/v linear no one kernel runs, so a PartsWeight of the fused
    Q4_K q / k and the Q6_K v, each as stored (exact in fp32); gate / up (both Q4_K) stay one GGUFWeight. Its
    linear (one GEMM per part) equals x @ W^T on the gguf package's values."""
    from tritonq.formats.gguf import GGUFLoader, read_config
    from tritonq.formats.layers import Linear
    from tritonq.quant.weights import GGUFWeight, PartsWeight
    path = tmp_path / "llama-q4_k_m.gguf"
    reference = write_gguf(llama, path, "Q4_K_M")
    weights = GGUFWeights([path])
    loader = GGUFLoader(weights, read_config(weights), torch.float32, "cpu")
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    fused = loader.get_fused_linear(qkv)
    assert isinstance(fused, PartsWeight)
    assert [(type(p).__name__, p.type_name, p.shape[0]) for p in fused.parts] == [
        ("GGUFWeight", "Q4_K", 384), ("GGUFWeight", "Q6_K", 128)]
    W = torch.cat([reference[f"{p}.weight"] for p in qkv])
    assert torch.equal(fused.dequantize(), W)
    x = torch.randn(3, 256)
    ref = x @ W.t()
    # interpreter: gguf_gemm per part; the CPU backend (with a GPU present): the C GGUF linear per part; both form
    # the gguf package's fp32 values and sum in fp32: the summation order only
    torch.testing.assert_close(Linear(fused)(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    gate_up = loader.get_fused_linear([f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up")])
    assert isinstance(gate_up, GGUFWeight) and gate_up.type_name == "Q4_K"
    assert torch.equal(gate_up.dequantize(), torch.cat([reference[f"model.layers.0.mlp.{p}_proj.weight"]
                                                        for p in ("gate", "up")]))


@pytest.mark.parametrize("type_name, tensor, hf_name", [
    ("Q8_0", "blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),  # repacked: its scales are checked
    ("Q6_K", "blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj.weight"),  # GGUFWeight
])
def test_a_nan_scale_is_refused_naming_the_tensor(llama, tmp_path, type_name, tensor, hf_name):
    path = tmp_path / "nan.gguf"
    write_gguf(llama, path, type_name)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    data = bytearray(path.read_bytes())
    at = t.data_offset + (208 if type_name == "Q6_K" else 0)  # the first block's fp16 d
    data[at:at + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8).tobytes()
    path.write_bytes(bytes(data))
    message = _refused(path, hf_name, "non-finite")
    assert "1 tensor(s)" in message


def test_gguf_split_shards_in_a_folder_load(llama, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_gguf(llama, folder / "llama.gguf", "Q8_0", split_max_tensors=8)
    assert len(list(folder.glob("*.gguf"))) > 1
    whole = tmp_path / "llama.gguf"
    write_gguf(llama, whole, "Q8_0")
    prompt = PROMPTS[1]
    split = tritonq.load(folder, dtype=torch.float32, device="cpu", max_num_seqs=2, kv_cache_gb=0.02)
    one = tritonq.load(whole, dtype=torch.float32, device="cpu", max_num_seqs=2, kv_cache_gb=0.02)
    assert torch.equal(split.engine.prompt_logits(prompt), one.engine.prompt_logits(prompt))
    sorted(folder.glob("*.gguf"))[-1].unlink()
    _refused(folder, "split.count=", "download the missing ones")


def _tensor_field_offset(path, name, part):
    """Byte offset in `path` of part `part` (2: n_dims, 3: dims, 4: type) of tensor `name`'s info."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:part])


def _refused(path, *phrases):
    with pytest.raises(ValueError) as info:
        tritonq.load(path, dtype=torch.float32, device="cpu", max_num_seqs=2, kv_cache_gb=0.02)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    return str(info.value)


def test_bad_files_are_refused_naming_the_tensor_and_the_fix(llama, tmp_path, monkeypatch):
    from tritonq.formats import gguf as ours
    path = tmp_path / "good.gguf"
    write_gguf(llama, path, "Q8_0")
    data = path.read_bytes()
    # nothing is dequantized before the checks: any read would fail the test
    monkeypatch.setattr(ours, "dequantize", lambda *a: pytest.fail("a weight was read before the file was checked"))

    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[:-1000])
    _refused(cut, "output_norm.weight", "truncated", "re-download")
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    _refused(header_cut, "re-download")

    for value, phrases in ((99, ["blk.0.attn_q.weight", "tensor type 99", "llama-quantize"]),
                           (int(gguf.GGMLQuantizationType.IQ2_XXS), ["blk.0.attn_q.weight", "IQ2_XXS",
                                                                     "llama-quantize"])):
        bad = bytearray(data)
        at = _tensor_field_offset(path, "blk.0.attn_q.weight", 4)
        bad[at:at + 4] = np.uint32(value).tobytes()
        broken = tmp_path / "type.gguf"
        broken.write_bytes(bytes(bad))
        _refused(broken, *phrases)

    bad = bytearray(data)  # a Q8_0 row of 255 values: no whole number of 32-value blocks
    at = _tensor_field_offset(path, "blk.1.ffn_up.weight", 3)
    bad[at:at + 8] = np.uint64(255).tobytes()
    broken = tmp_path / "rows.gguf"
    broken.write_bytes(bytes(bad))
    _refused(broken, "blk.1.ffn_up.weight", "not a multiple of its 32-value blocks")

    bad = bytearray(data)  # Q8_0 -> F32: the same shape needs ~4x the bytes, running into the next tensor
    at = _tensor_field_offset(path, "blk.0.attn_k.weight", 4)
    bad[at:at + 4] = np.uint32(int(gguf.GGMLQuantizationType.F32)).tobytes()
    broken = tmp_path / "size.gguf"
    broken.write_bytes(bytes(bad))
    _refused(broken, "blk.0.attn_k.weight", "disagrees with its type")

    missing = tmp_path / "missing.gguf"
    monkeypatch.undo()
    write_gguf(llama, missing, "F32", drop_keys=("llama.feed_forward_length",))
    monkeypatch.setattr(ours, "dequantize", lambda *a: pytest.fail("a weight was read before the file was checked"))
    _refused(missing, "llama.feed_forward_length is missing", "convert_hf_to_gguf")

    other = tmp_path / "phi3.gguf"
    monkeypatch.undo()
    write_gguf(llama, other, "F32", override_arch="phi3")
    monkeypatch.setattr(ours, "dequantize", lambda *a: pytest.fail("a weight was read before the file was checked"))
    _refused(other, "general.architecture='phi3' is not supported", "safetensors")


def test_cli_generate_and_serve_a_gguf_file(llama, tmp_path, capsys):
    """`tritonq generate model.gguf` prints what the Python API generates; `tritonq serve model.gguf` answers the
    official openai client with the same text (chat through the file's own chat template)."""
    import openai
    from serve_util import MODEL_NAME, Server

    from tritonq import cli
    path = tmp_path / "llama.gguf"
    write_gguf(llama, path, "Q4_K_M")
    model = tritonq.load(path, dtype=torch.float32, device="cpu", max_num_seqs=2, kv_cache_gb=0.02)
    expected = model.generate("hello world", max_new_tokens=6, temperature=0)
    cli.main(["generate", str(path), "hello world", "--max-new-tokens", "6", "--temperature", "0", "--dtype",
              "float32", "--kv-cache-gb", "0.02", "--device", "cpu"])
    assert capsys.readouterr().out == expected + "\n"
    messages = [{"role": "user", "content": "hi there"}]
    chat = model.chat(messages, max_new_tokens=5, temperature=0)
    server = Server(path, tmp_path / "server.log", "--kv-cache-gb", "0.02", "--device", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
        reply = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0)
        assert reply.choices[0].text == expected
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0)
        assert reply.choices[0].message.content == chat
    finally:
        server.stop()


def prompt_logits(model) -> list[torch.Tensor]:
    """Each prompt's prefill logits (run alike by tensor-parallel ranks and one process)."""
    return [model.engine.prompt_logits(p) for p in PROMPTS]


@pytest.mark.parametrize("scheme", ["Q4_0", "Q4_K_M"])
def test_two_tensor_parallel_ranks_match_one_process(llama, tmp_path, scheme):
    """2 CPU ranks (gloo) on a GGUF Llama: Q4_0's Int4Weights and Q4_K_M's GGUFWeights split by whole blocks
    (o_proj's 128 input rows per rank would cut a Q4_K super-block: read dense), the rest by rows or columns,
    the embedding by vocabulary rows. Both sides fp32 from the same weights; the ranks only regroup the
    sums (row-parallel layers add two partial dot products): float32 rounding, atol 1e-4 as the other TP tests."""
    from test_tensor_parallel import run_on_ranks
    path = tmp_path / f"llama-{scheme}.gguf"
    write_gguf(llama, path, scheme)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        single = prompt_logits(tritonq.load(path, device="cpu", dtype=torch.float32, max_num_seqs=2,
                                            max_seq_len=24))
        ranks = run_on_ranks(prompt_logits, {"gguf": path}, tmp_path / "out")
    for rank in ranks:
        for got, want in zip(rank["gguf"], single, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
