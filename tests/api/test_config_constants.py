"""Impossible config.json constants are refused by load() before any weight is read, naming the file and the key:
rope scaling factors, DeepSeek's routed_scaling_factor and group routing, gpt-oss's clamped SwiGLU, MPT's clip_qkv,
epsilons, the MoE top-k against the expert count. Each config is the one transformers' own config class writes
for the architecture (small sizes), with one value changed; the unchanged config passes the same check."""
import json

import pytest
import transformers

import tritonq
from tritonq.api.load import _read_config

ARCHITECTURES = {  # name: (transformers config class, its arguments)
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)),
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                             topk_group=2, routed_scaling_factor=2.5, vocab_size=128,
                                             max_position_embeddings=64)),
    "gpt_oss": ("GptOssConfig", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=128, max_position_embeddings=64)),
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                      max_position_embeddings=64)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=8, num_experts_per_tok=2, vocab_size=128,
                                         max_position_embeddings=64)),
    "mpt": ("MptConfig", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, vocab_size=128, max_seq_len=64)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                    max_position_embeddings=64)),
}

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}

BAD = {  # name: (architecture, config.json changes, the key=value the message names)
    "yarn_factor_zero": ("llama", {"rope_parameters": YARN | {"factor": 0.0}}, "rope_parameters.factor=0.0"),
    "yarn_beta_negative": ("llama", {"rope_parameters": YARN | {"beta_fast": -32.0}}, "rope_parameters.beta_fast=-32.0"),
    "linear_factor_negative": ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": -2.0}},
                               "rope_scaling.factor=-2.0"),
    "dynamic_factor_nan": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": float("nan")}},
                           "rope_parameters.factor=nan"),
    "llama3_equal_freq_factors": ("llama", {"rope_parameters": LLAMA3 | {"high_freq_factor": 1.0}},
                                  "rope_parameters.high_freq_factor=1.0"),
    "yarn_original_positions_zero": ("llama", {"rope_parameters": YARN | {"original_max_position_embeddings": 0}},
                                     "rope_parameters.original_max_position_embeddings=0"),
    "routed_scaling_negative": ("deepseek_v3", {"routed_scaling_factor": -2.5}, "routed_scaling_factor=-2.5"),
    "routed_scaling_zero": ("deepseek_v3", {"routed_scaling_factor": 0}, "routed_scaling_factor=0"),
    "n_group_not_dividing": ("deepseek_v3", {"n_group": 3}, "n_group=3; expected a positive divisor of "
                                                            "n_routed_experts=8"),
    "n_group_zero": ("deepseek_v3", {"n_group": 0}, "n_group=0"),
    "topk_group_past_n_group": ("deepseek_v3", {"topk_group": 5}, "topk_group=5; expected a positive int <= n_group=4"),
    "topk_group_zero": ("deepseek_v3", {"topk_group": 0}, "topk_group=0"),
    "top_k_past_kept_groups": ("deepseek_v3", {"num_experts_per_tok": 5}, "num_experts_per_tok=5; expected at most "
                                                                          "topk_group * n_routed_experts / n_group = 4"),
    "top_k_past_experts": ("deepseek_v3", {"num_experts_per_tok": 9}, "num_experts_per_tok=9; expected an int in "
                                                                      "1..n_routed_experts=8"),
    "top_k_zero": ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    "top_k_past_local_experts": ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5; expected an int in "
                                                                        "1..num_local_experts=4"),
    "top_k_past_qwen_experts": ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "swiglu_limit_zero": ("gpt_oss", {"swiglu_limit": 0.0}, "swiglu_limit=0.0"),
    "swiglu_limit_negative": ("gpt_oss", {"swiglu_limit": -7.0}, "swiglu_limit=-7.0"),
    "gpt_oss_yarn_factor_negative": ("gpt_oss", {"rope_parameters": YARN | {"factor": -32.0}},
                                     "rope_parameters.factor=-32.0"),
    "clip_qkv_negative": ("mpt", {"attn_config": {"clip_qkv": -6.0}}, "attn_config.clip_qkv=-6.0"),
    "mpt_layer_norm_epsilon_nan": ("mpt", {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon=nan"),
    "falcon_layer_norm_epsilon_negative": ("falcon", {"layer_norm_epsilon": -1e-5}, "layer_norm_epsilon=-1e-05"),
    "falcon_layer_norm_epsilon_zero": ("falcon", {"layer_norm_epsilon": 0.0}, "layer_norm_epsilon=0.0"),
}

GOOD = {  # values that look odd but are possible: accepted
    "clip_qkv_off": ("mpt", {"attn_config": {"clip_qkv": None}}),
    "clip_qkv_zero_is_off": ("mpt", {"attn_config": {"clip_qkv": 0}}),  # transformers' `if clip_qkv:`
    "clip_qkv_set": ("mpt", {"attn_config": {"clip_qkv": 6.0}}),
    "yarn_mscale_zero": ("llama", {"rope_parameters": YARN | {"mscale": 0.0, "mscale_all_dim": 0.0}}),
    "llama3": ("llama", {"rope_parameters": LLAMA3}),
    "one_group": ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
    "top_k_all_experts": ("mixtral", {"num_experts_per_tok": 4}),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    """config.json of each architecture as transformers writes it."""
    out = {}
    for name, (cls, arguments) in ARCHITECTURES.items():
        folder = tmp_path_factory.mktemp(name)
        getattr(transformers, cls)(**arguments).save_pretrained(folder)
        out[name] = json.loads((folder / "config.json").read_text())
    return out


def _write(tmp_path, config: dict, changes: dict):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    changed = dict(config)
    for key, value in changes.items():
        if key == "attn_config":
            changed[key] = {**config.get(key, {}), **value}
        elif value is None:
            changed.pop(key, None)
        else:
            changed[key] = value
    (folder / "config.json").write_text(json.dumps(changed))
    return folder


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_configs_as_transformers_writes_them_pass(configs, tmp_path, name):
    _read_config(_write(tmp_path, configs[name], {}))


@pytest.mark.parametrize("name", GOOD)
def test_possible_constants_pass(configs, tmp_path, name):
    architecture, changes = GOOD[name]
    _read_config(_write(tmp_path, configs[architecture], changes))


@pytest.mark.parametrize("name", BAD)
def test_impossible_constant_is_refused_before_any_weight_naming_file_and_key(configs, tmp_path, monkeypatch, name):
    architecture, changes, phrase = BAD[name]
    folder = _write(tmp_path, configs[architecture], changes)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the bad constant was refused")

    monkeypatch.setattr("tritonq.formats.registry.get_loader", no_weights)
    with pytest.raises(ValueError) as info:
        tritonq.load(folder)
    assert f"{folder / 'config.json'}: {phrase}" in str(info.value)
