"""Bad input is refused where it enters (load, generate), before any work: one table of
input -> exception type + a phrase of the message. "Before any work" is checked by making any
weight read fail the test (formats.registry.get_loader is replaced) for every load case.
"""
import json
import shutil

import pytest
import torch

import tritonq
import tritonq.api.load
from tritonq.demo import write_tiny_llama
from tritonq.quant.weights import Int4Weight


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama (hidden 32, 1 layer, vocab 258, max_position_embeddings 512) with its tokenizer."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def model(tiny):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        yield tritonq.load(tiny, max_num_seqs=2, max_seq_len=32)


def variant(tiny, tmp_path, drop=(), config=None, write=None, loop=()):
    """A copy of the tiny checkpoint without the files in drop, config.json updated with config, the files
    in write ({name: text}) replaced, and each file in loop replaced by a symlink to itself."""
    folder = tmp_path / "variant"
    shutil.copytree(tiny, folder)
    for name in drop:
        (folder / name).unlink()
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    for name, text in (write or {}).items():
        (folder / name).write_text(text)
    for name in loop:
        (folder / name).unlink()
        (folder / name).symlink_to(folder / name)
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

LOAD_CASES = {  # name: (variant kwargs, load kwargs, exception, phrase)
    "dtype_int8": ({}, {"dtype": torch.int8}, ValueError, "dtype=torch.int8 is not a compute dtype"),
    "dtype_float64": ({}, {"dtype": torch.float64}, ValueError, "dtype=torch.float64 is not a compute dtype"),
    "dtype_bad_string": ({}, {"dtype": "int4"}, ValueError, "expected one of ['float16', 'bfloat16', 'float32']"),
    "no_config_json": ({"drop": ["config.json"]}, {}, FileNotFoundError, "variant has no config.json"),
    "unknown_model_type": ({"config": {"model_type": "gpt_foo"}}, {}, ValueError,
                           "model_type 'gpt_foo' is not supported; supported: ['deepseek_v2', 'deepseek_v3', 'falcon', "
                           "'gemma3', 'gemma3_text', 'glm4_moe', 'gpt_oss', 'llama', 'mistral', 'mixtral', 'mpt', "
                           "'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', "
                           "'qwen3_5_text', 'qwen3_moe', 'qwen3_next']"),
    "no_tokenizer": ({"drop": TOKENIZER_FILES}, {}, ValueError, "cannot load a tokenizer"),
    "max_seq_len_zero": ({}, {"max_seq_len": 0}, ValueError, "max_seq_len=0; expected a positive int"),
    "max_seq_len_negative": ({}, {"max_seq_len": -4}, ValueError, "max_seq_len=-4; expected a positive int"),
    "max_seq_len_past_positions": ({}, {"max_seq_len": 513}, ValueError,
                                   "max_seq_len=513 exceeds the model's max_position_embeddings=512"),
    "max_num_seqs_zero": ({}, {"max_num_seqs": 0}, ValueError, "max_num_seqs=0; expected a positive int"),
    "group_size_without_int4": ({}, {"group_size": 32}, ValueError, "group_size=32 applies to quantize='int4' only"),
    "group_size_zero": ({}, {"quantize": "int4", "group_size": 0}, ValueError, "group_size=0; expected a positive"),
    # config values no model can have: refused naming the key, the value and the file
    "rope_theta_zero": ({"config": {"rope_theta": 0}}, {}, ValueError, "config.json: rope_theta=0; expected a positive"),
    "rope_parameters_theta_negative": ({"config": {"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}},
                                       {}, ValueError, "config.json: rope_parameters.rope_theta=-1.0; expected a positive"),
    "rope_theta_nan": ({"config": {"rope_theta": float("nan")}}, {}, ValueError, "rope_theta=nan; expected a positive finite"),
    "rms_norm_eps_zero": ({"config": {"rms_norm_eps": 0}}, {}, ValueError, "config.json: rms_norm_eps=0; expected a positive"),
    "rms_norm_eps_negative": ({"config": {"rms_norm_eps": -1e-6}}, {}, ValueError, "rms_norm_eps=-1e-06; expected a positive"),
    "rms_norm_eps_nan": ({"config": {"rms_norm_eps": float("nan")}}, {}, ValueError, "rms_norm_eps=nan; expected a positive"),
    "zero_layers": ({"config": {"num_hidden_layers": 0}}, {}, ValueError, "config.json: num_hidden_layers=0; expected a positive int"),
    "zero_heads": ({"config": {"num_attention_heads": 0}}, {}, ValueError, "num_attention_heads=0; expected a positive int"),
    "zero_kv_heads": ({"config": {"num_key_value_heads": 0}}, {}, ValueError, "num_key_value_heads=0; expected a positive int"),
    "kv_heads_not_dividing": ({"config": {"num_key_value_heads": 3}}, {}, ValueError,
                              "num_key_value_heads=3; expected a divisor of num_attention_heads=4"),
    "zero_hidden_size": ({"config": {"hidden_size": 0}}, {}, ValueError, "hidden_size=0; expected a positive int"),
    "zero_vocab": ({"config": {"vocab_size": 0}}, {}, ValueError, "vocab_size=0; expected a positive int"),
    "zero_positions": ({"config": {"max_position_embeddings": 0}}, {}, ValueError,
                       "config.json: max_position_embeddings=0; expected a positive int"),
    "float_layers": ({"config": {"num_hidden_layers": 1.5}}, {}, ValueError, "num_hidden_layers=1.5; expected a positive int"),
    # files that are not what they claim: the error says what is really wrong
    "config_not_json": ({"write": {"config.json": "{not json"}}, {}, ValueError, "config.json is not a JSON file"),
    "config_not_object": ({"write": {"config.json": "[1, 2]"}}, {}, ValueError, "config.json is not a JSON object"),
    "generation_config_not_json": ({"write": {"generation_config.json": "{\"eos_token_id\": "}}, {}, ValueError,
                                   "generation_config.json is not a JSON file"),
    "generation_config_bad_eos": ({"write": {"generation_config.json": '{"eos_token_id": "end"}'}}, {}, ValueError,
                                  "generation_config.json: eos_token_id='end' is not a token id"),
    "config_symlink_loop": ({"loop": ["config.json"]}, {}, ValueError, "config.json is a symlink loop"),
    "tokenizer_symlink_loop": ({"loop": ["tokenizer.json"]}, {}, ValueError, "tokenizer.json is a symlink loop"),
    "weights_symlink_loop": ({"loop": ["model.safetensors"]}, {}, ValueError, "model.safetensors is a symlink loop"),
}


@pytest.mark.parametrize("name", LOAD_CASES)
def test_load_refuses_bad_input_before_reading_weights(tiny, tmp_path, monkeypatch, name):
    changes, options, error, phrase = LOAD_CASES[name]
    folder = variant(tiny, tmp_path, **changes) if changes else tiny

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the bad input was refused")

    monkeypatch.setattr("tritonq.formats.registry.get_loader", no_weights)
    with pytest.raises(error) as info:
        tritonq.load(folder, **options)
    assert phrase in str(info.value)


def test_unreadable_file_is_named_permission_denied(tiny, tmp_path, monkeypatch):
    """A file this user may not read is a permission problem, not a corrupt download. Tests run as root,
    which chmod 000 does not stop, so the denial is simulated at open()."""
    import builtins
    folder = variant(tiny, tmp_path)
    real_open = builtins.open

    def denying_open(file, *args, **kwargs):
        if str(file).endswith("model.safetensors"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denying_open)
    monkeypatch.setattr("tritonq.formats.registry.get_loader", _no_weights)
    with pytest.raises(PermissionError, match=r"model.safetensors: permission denied"):
        tritonq.load(folder)
    from tritonq.formats.checkpoint import Weights  # the loader says the same when it opens the file itself
    with pytest.raises(PermissionError, match=r"model.safetensors: permission denied"):
        Weights(folder)


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were read before the bad input was refused")


GENERATE_CASES = {  # name: (prompt, options, exception, phrase)
    "token_id_past_vocab": ([5, 258], {}, ValueError, "token id 258 outside the vocabulary (vocab_size=258"),
    "negative_token_id": ([[5], [-1, 3]], {}, ValueError, "prompt 1 has token id -1 outside the vocabulary"),
    "empty_stop_string": ("hi", {"stop": ""}, ValueError, "stop strings must be non-empty"),
    "empty_stop_in_list": ("hi", {"stop": ["x", ""]}, ValueError, "stop strings must be non-empty"),
}


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_generate_refuses_bad_input(model, monkeypatch, name):
    prompt, options, error, phrase = GENERATE_CASES[name]
    monkeypatch.setattr(model, "model", _NoForward(model.model))
    with pytest.raises(error) as info:
        model.generate(prompt, max_new_tokens=2, **options)
    assert phrase in str(info.value)


class _NoForward:
    """Stands in for the model: its config answers, a forward pass fails the test."""

    def __init__(self, inner):
        self.config, self.device = inner.config, inner.device

    def __call__(self, *args, **kwargs):
        raise AssertionError("the model ran before the bad input was refused")


def test_dtype_may_be_named_by_a_string(tiny, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    model = tritonq.load(tiny, dtype="bfloat16", max_seq_len=16)
    assert model.model.dtype == torch.bfloat16 and model.engine.runner.cache.k[0].dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_int4_on_load_takes_a_group_size(tiny, monkeypatch):
    """load(quantize="int4", group_size=16): every linear in groups of 16 input rows; the same
    weights as quantize_int4 at that group size (the writer's RTN, an independent call)."""
    from safetensors.torch import load_file

    from tritonq.quant.rtn import quantize_int4
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    model = tritonq.load(tiny, quantize="int4", group_size=16, max_seq_len=16)
    down = model.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, Int4Weight) and down.group_size == 16
    dense = load_file(tiny / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.qweight, quantize_int4(dense, 16, scale_dtype=torch.float32).qweight)


# ---- generate: the red-team rows (issue 27). Checked by Engine.check_request / GenerationConfig before
# anything is queued; afterwards the model answers a normal request exactly as before. -----------------

REQUEST_CASES = {  # name: (prompt, options, exception, phrase naming the culprit)
    "token_id_minus_one": ([5, -1], {}, ValueError, "token id -1 outside the vocabulary (vocab_size=258: ids 0..257)"),
    "token_id_vocab_size": ([5, 258], {}, ValueError, "token id 258 outside the vocabulary (vocab_size=258: ids"),
    "token_id_huge": ([5, 10 ** 20], {}, ValueError, f"token id {10 ** 20} outside the vocabulary"),
    "token_id_true": ([5, True], {}, TypeError, "token id True (bool); token ids must be int"),
    "empty_prompt_in_list": ([[5], []], {}, ValueError, "prompt 1 has no tokens"),
    "max_new_tokens_float": ("hi", {"max_new_tokens": 2.5}, TypeError, "max_new_tokens=2.5 (float); expected an int"),
    "max_new_tokens_str": ("hi", {"max_new_tokens": "3"}, TypeError, "max_new_tokens='3' (str); expected an int"),
    "max_new_tokens_bool": ("hi", {"max_new_tokens": True}, TypeError, "max_new_tokens=True (bool)"),
    "max_new_tokens_negative": ("hi", {"max_new_tokens": -1}, ValueError, "max_new_tokens=-1; expected an int >= 0"),
    "temperature_str": ("hi", {"temperature": "0.5"}, TypeError, "temperature='0.5' (str); expected a number"),
    "temperature_nan": ("hi", {"temperature": float("nan")}, ValueError, "temperature=nan; expected a finite number"),
    "temperature_bool": ("hi", {"temperature": True}, TypeError, "temperature=True (bool)"),
    "top_p_inf": ("hi", {"top_p": float("inf")}, ValueError, "top_p=inf; expected a finite number in (0, 1]"),
    "top_k_float": ("hi", {"top_k": 2.0}, TypeError, "top_k=2.0 (float); expected an int"),
    "min_p_above_one": ("hi", {"min_p": 1.5}, ValueError, "min_p=1.5; expected a finite number in [0, 1]"),
    "repetition_penalty_zero": ("hi", {"repetition_penalty": 0}, ValueError, "repetition_penalty=0"),
    "min_tokens_past_max_new_tokens": ("hi", {"min_tokens": 5}, ValueError, "min_tokens=5 > max_new_tokens=2"),
    "min_tokens_str": ("hi", {"min_tokens": "1"}, TypeError, "min_tokens='1' (str)"),
    "ignore_eos_str": ("hi", {"ignore_eos": "yes"}, TypeError, "ignore_eos='yes' (str); expected True or False"),
    "seed_float": ("hi", {"seed": 1.5}, TypeError, "seed=1.5 (float); expected an int or None"),
    "seed_str": ("hi", {"seed": "7"}, TypeError, "seed='7' (str)"),
    "stop_int": ("hi", {"stop": 5}, TypeError, "stop=5 (int); expected a tuple of str"),
    "stop_not_str": ("hi", {"stop": ["x", 3]}, ValueError, "stop strings must be non-empty str"),
}


@pytest.fixture
def normal(model):
    """A normal request's output before the case: the model must give the same one after it."""
    return model.generate("hello", max_new_tokens=4, return_dict=True)


@pytest.mark.parametrize("name", REQUEST_CASES)
def test_bad_request_is_refused_and_the_model_still_answers(model, normal, monkeypatch, name):
    prompt, options, error, phrase = REQUEST_CASES[name]
    monkeypatch.setattr(model, "model", _NoForward(model.model))
    monkeypatch.setattr(model.engine.runner, "model", _NoForward(model.model))  # nothing may run
    with pytest.raises(error) as info:
        model.generate(prompt, max_new_tokens=options.pop("max_new_tokens", 2), **options)
    assert phrase in str(info.value), str(info.value)
    assert not model.engine.has_unfinished()  # nothing was queued
    monkeypatch.undo()
    assert model.generate("hello", max_new_tokens=4, return_dict=True).token_ids == normal.token_ids


def test_tiny_temperature_with_top_k_is_greedy(model, normal):
    """temperature 1e-38 overflowed logits / T to inf and top_k=5 then sampled outside the top 5: below
    1e-5 a temperature is greedy (GenerationConfig stores 0.0)."""
    for t in (1e-38, 1e-6):
        out = model.generate("hello", max_new_tokens=4, temperature=t, top_k=5, seed=0, return_dict=True)
        assert out.token_ids == normal.token_ids
    assert tritonq.GenerationConfig(temperature=1e-38).temperature == 0.0
    assert tritonq.GenerationConfig(temperature=1e-5).temperature == 1e-5


def test_engine_check_request_is_the_shared_check(model):
    """The server calls Engine.check_request(prompt_ids, config) directly: the same refusals, default name."""
    config = tritonq.GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"the prompt has token id 300 outside the vocabulary \(vocab_size=258"):
        model.engine.check_request([1, 300], config)
    with pytest.raises(TypeError, match="the prompt has token id '1'"):
        model.engine.check_request(["1"], config)
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        model.engine.check_request([], config)
    with pytest.raises(ValueError, match=r"the prompt has 31 tokens \+ max_new_tokens=2 = 33 > max_seq_len=32"):
        model.engine.check_request([1] * 31, config)
    with pytest.raises(ValueError, match="token id -1 outside"):
        model.engine.add_request([-1], config)
    with pytest.raises(ValueError, match="prompt 0 has token id 999 outside"):
        model.score([[1, 999]])
    assert not model.engine.has_unfinished()
    model.engine.check_request([1, 2], config)


@pytest.mark.parametrize("capability, dtype, phrase", [
    ((8, 0), torch.float32, "dtype=torch.float32 on cuda:0 (sm_80) is not supported: the GPU kernels run fp16/bf16 "
                            "only"),
    ((9, 0), "float32", "load with dtype=torch.bfloat16 or dtype=torch.float16, or on device='cpu' for fp32"),
    ((7, 5), torch.bfloat16, "sm_75 (pre-Ampere: T4, V100) has no bf16 arithmetic"),
    ((7, 5), torch.float32, "load with dtype=torch.float16, or on device='cpu'")])
def test_load_refuses_dtypes_the_gpu_kernels_do_not_run_before_reading_anything(monkeypatch, tmp_path, capability,
                                                                                dtype, phrase):
    """fp32 on any GPU and bf16 before sm_80 are refused before the checkpoint is even resolved."""
    def no_files(*args, **kwargs):
        raise AssertionError("the checkpoint was resolved before the dtype was refused")

    monkeypatch.setattr("tritonq.api.hub.resolve", no_files)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # "cuda" resolves to the current GPU
    with pytest.raises(ValueError) as info:
        tritonq.load(tmp_path, device="cuda", dtype=dtype)
    assert phrase in str(info.value)


@pytest.mark.parametrize("capability, stored, expected", [
    ((9, 0), "bfloat16", torch.bfloat16), ((8, 0), torch.float16, torch.float16), ((8, 9), None, torch.bfloat16),
    ((7, 5), "bfloat16", torch.float16), ((7, 5), torch.float16, torch.float16)])
def test_default_gpu_dtype_is_the_checkpoints_but_fp16_before_sm80(monkeypatch, caplog, capability, stored, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert tritonq.api.load._default_dtype(stored, torch.device("cuda")) == expected
    cast = capability < (8, 0) and stored != torch.float16
    assert ("computing in float16, not the checkpoint's" in caplog.text) == cast
    assert tritonq.api.load._default_dtype(stored, torch.device("cpu")) == torch.float32
