"""Tiny GGUF checkpoints for the GGUF tests, written with the gguf package's GGUFWriter as llama.cpp's
converter lays them out (tensor names, metadata keys, Llama's Q/K rows permuted for rope, the byte-level BPE
vocabulary of the shipped model as a "gpt2" tokenizer). Quantized with gguf.quants.quantize where the package has
a quantizer (Q8_0, Q4_0, ...); Q4_K and Q6_K with the test-only quantizers here, whose output the gguf
package's dequantizer reads back within the format's rounding (test_gguf.py checks it)."""
from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import gguf
import numpy as np
import torch

from tritonq.formats.gguf import BLOCK_FORMATS, gguf_weight, planes_of

SHIPPED_TOKENIZER = files("tritonq.default_model") / "checkpoint" / "tokenizer.json"
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> Q6_K blocks uint8 [..., K / 256 * 210]: per 16 values a signed 8-bit
    scale times the block's fp16 d, 6-bit codes q meaning q - 32 (bit layout: gguf.quants.Q6_K)."""
    rows = x.reshape(-1, 256).astype(np.float32)
    B = rows.shape[0]
    sub = rows.reshape(B, 16, 16)
    amax = np.abs(sub).max(-1)  # [B, 16]
    d = (amax.max(-1) / (31 * 127)).astype(np.float16).astype(np.float32)  # [B]
    sc = np.where(d[:, None] > 0, np.round(amax / 31 / np.where(d[:, None] > 0, d[:, None], 1)), 0).clip(-128, 127)
    step = d[:, None] * sc
    q = np.where(step[..., None] > 0, np.round(sub / np.where(step > 0, step, 1)[..., None]), 0).clip(-32, 31) + 32
    q = q.astype(np.uint8).reshape(B, 2, 2, 64)
    ql = (q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)
    q = q.reshape(B, 2, 4, 32)
    qh = sum(((q[:, :, s] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
    out = np.concatenate([ql.reshape(B, 128), qh.reshape(B, 64), sc.astype(np.int8).view(np.uint8),
                          d.astype(np.float16).view(np.uint8).reshape(B, 2)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> Q4_K blocks uint8 [..., K / 256 * 144]: per 32 values a 6-bit scale
    and min times the block's fp16 d and dmin, 4-bit codes (bit layout: gguf.quants.Q4_K)."""
    rows = x.reshape(-1, 256).astype(np.float32)
    B = rows.shape[0]
    sub = rows.reshape(B, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # [B, 8]
    scale, offset = (sub.max(-1) - low) / 15, -low

    def six_bit(v):
        top = (v.max(-1) / 63).astype(np.float16).astype(np.float32)
        return top, np.where(top[:, None] > 0, np.round(v / np.where(top[:, None] > 0, top[:, None], 1)), 0).clip(0, 63)

    d, sc = six_bit(scale)
    dmin, mn = six_bit(offset)
    step, base = d[:, None] * sc, dmin[:, None] * mn
    q = np.where(step[..., None] > 0, np.round((sub + base[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(B, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(B, 128)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(B, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(B, 2), scales, qs], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "Q4_K":
        return quantize_q4_k(x)
    if type_name == "Q6_K":
        return quantize_q6_k(x)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute of Llama's q/k rows (pairs interleaved for its rope)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *module, kind = hf.split(".")
    return f"blk.{layer}.{HF_TO_GGUF['.'.join(module)]}.{kind}"


def type_for(name: str, scheme: str) -> str:
    """The tensor type of GGUF tensor `name` in a file of `scheme` (F32, a block type, or "Q4_K_M": Q4_K with
    Q6_K for attn_v / ffn_down / the output head, as llama-quantize's Q4_K_M mixes them; "Q4_K_M up Q6_K": with the
    ffn_up (experts') tensors in Q6_K too, so that gate and up differ in type)."""
    if name.endswith("norm.weight") or name.endswith(".bias") or "ffn_gate_inp" in name:
        return "F32"
    if scheme == "Q4_K_M up Q6_K":
        return "Q6_K" if "ffn_up" in name else type_for(name, "Q4_K_M")
    if scheme == "Q4_K_M":
        return "Q6_K" if any(p in name for p in ("attn_v", "ffn_down", "output.weight")) else "Q4_K"
    return scheme


def write_gguf(model, path: Path, scheme: str, drop_keys: tuple[str, ...] = (), override_arch: str | None = None,
               split_max_tensors: int = 0) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers Llama / Qwen3-MoE in fp32) to `path` in `scheme`; returns its state dict as
    the file holds it, dequantized by the gguf package (the reference weights), Q/K rows back in HF order.
    Broken files for the error tests: drop_keys leaves metadata keys out, override_arch replaces general.architecture;
    split_max_tensors > 0 writes gguf-split shards (path's name numbered) instead of one file."""
    config = model.config
    arch = {"llama": "llama", "qwen3_moe": "qwen3moe"}[config.model_type]
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
    tok = json.loads(SHIPPED_TOKENIZER.read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab] + ["<pad%d>" % i for i in range(config.vocab_size - len(vocab))])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab] + [4] * (config.vocab_size - len(vocab)))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template(CHAT_TEMPLATE)
    reference = {}
    for hf, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if hf.startswith("lm_head") and config.tie_word_embeddings:
            continue
        if ".experts." in hf:  # written once per layer, stacked, below
            continue
        name = gguf_name(hf)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            w = permute(w, heads)
        _add(writer, name, w, type_for(name, scheme), reference, hf, arch, config)
    if arch == "qwen3moe":
        sd = model.state_dict()
        for layer in range(config.num_hidden_layers):
            for hf_kind, kind in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                  ("down_proj", "ffn_down_exps")):
                w = _experts(sd, layer, hf_kind, config)
                name = f"blk.{layer}.{kind}.weight"
                t = type_for(name.replace("_exps", ""), scheme)
                data = w if t == "F32" else quantize(w, t)
                writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[t])
                back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t])
                for e in range(config.num_experts):
                    reference[f"model.layers.{layer}.mlp.experts.{e}.{hf_kind}.weight"] = torch.from_numpy(back[e])
    for key in drop_keys:
        del writer.kv_data[0][key]
    if override_arch is not None:
        writer.kv_data[0]["general.architecture"] = gguf.GGUFValue(override_arch, gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _experts(sd, layer, kind, config) -> np.ndarray:
    """The [E, N, K] expert weights of one layer in transformers' layout (fused or per expert, by version)."""
    prefix = f"model.layers.{layer}.mlp.experts"
    if f"{prefix}.gate_up_proj" in sd:  # transformers >= 5 fuses them: gate_up [E, 2I, H], down [E, H, I]
        if kind == "down_proj":
            return sd[f"{prefix}.down_proj"].float().numpy()
        gate_up = sd[f"{prefix}.gate_up_proj"].float().numpy()
        inter = config.moe_intermediate_size
        return gate_up[:, :inter] if kind == "gate_proj" else gate_up[:, inter:]
    return np.stack([sd[f"{prefix}.{e}.{kind}.weight"].float().numpy() for e in range(config.num_experts)])


def _add(writer, name, w, t, reference, hf, arch, config):
    data = w if t == "F32" else quantize(w, t)
    writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[t])
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t]).astype(np.float32)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
    reference[hf] = torch.from_numpy(np.ascontiguousarray(back))


# byte offsets of the fp16 d (and dmin / m) in each block of the formats tritonq keeps as GGUFWeight
SCALE_BYTES = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0]}


def random_weight(type_name: str, N: int, K: int, seed: int = 0, exponents: list[int] | None = None):
    """For the kernel tests: an N x K weight of random blocks (every code and sub-block scale; fp16 d / dmin / m
    of both signs, ~1 / K^0.5 of a code step so y stays O(1), or with exponents (N of them) +-2^exponents[n] in
    every block of row n) as (GGUFWeight on the CPU, tritonq.formats.gguf's repack; the gguf package's fp32
    dequantization [N, K])."""
    block, size, _ = BLOCK_FORMATS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(N * K // block, size), dtype=np.uint8)
    for start in SCALE_BYTES[type_name]:
        step = 4 if type_name in ("Q4_1", "Q5_0", "Q5_1") else 0.3  # a code's level times d: K-quant / IQ4 ~ 1e2
        d = (rng.standard_normal(len(blocks)) * step / K ** 0.5).astype(np.float16)
        if exponents is not None:
            d = (np.sign(d) * np.exp2(np.repeat(np.asarray(exponents, float), K // block))).astype(np.float16)
        blocks[:, start:start + 2] = d.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(N, K // block * size)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    codes, scales, offsets = planes_of(torch.from_numpy(raw).reshape(N, K // block, size), type_name)
    return gguf_weight(codes, scales, offsets, type_name, "cpu"), reference


def random_experts(type_name: str, E: int, D: int, inter: int):
    """For the MoE kernel tests: stacked random GGUF experts, gate_up [E, 2I, D] and down [E, D, I] (on the CPU), and
    the gguf package's fp32 values of each expert's two weights (lists of E)."""
    from tritonq.quant.weights import stack_experts
    with torch.device("cpu"):
        gate_up = [random_weight(type_name, 2 * inter, D, seed=10 + e) for e in range(E)]
        down = [random_weight(type_name, D, inter, seed=20 + e) for e in range(E)]
    return (stack_experts([w for w, _ in gate_up]), stack_experts([w for w, _ in down]),
            [W for _, W in gate_up], [W for _, W in down])


def routed_reference(x, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """The routed experts per token and slot in float32 on the CPU: sum_k w_k * down_e(silu(gate_e x) * up_e x),
    gate_up / down the lists of fp32 weights `random_experts` gives."""
    out = torch.zeros(x.shape[0], down[0].shape[0], device="cpu")
    inter = down[0].shape[1]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            g, u = (x[t].float() @ gate_up[e].t()).split(inter)
            out[t] += topk_weights[t, k] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out
