"""Shared fixtures for the format tests: tiny random Llamas built by transformers, and an
independent int4 dequantizer written from the Int4Weight docstring formula."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tritonq.demo import byte_tokenizer
from tritonq.quant.packing import unpack_int32
from tritonq.quant.weights import Int4Weight

LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
GROUP_SIZE = 32  # divides both K values of the tiny model (hidden 64, intermediate 128)


def dense_llama(hidden=96, inter=160, heads=6, kv_heads=3, tied=False, vocab=None, seed=0) -> LlamaForCausalLM:
    """A tiny random Llama in float32 whose weights vary in range across rows and groups; vocab (default
    the byte tokenizer's 258) may be padded past the tokenizer, as real checkpoints often are."""
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            else:  # std 0.02 init, spread per element so rows and groups differ in range
                p.mul_(torch.empty_like(p).uniform_(0.5, 20))
    return model


def save(model: LlamaForCausalLM, folder) -> None:
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def save_tiny_llama(folder: Path, dtype=torch.float16) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # random init is tiny (std 0.02); spread the weights so groups differ in range
        for p in model.parameters():
            p.mul_(torch.empty_like(p).uniform_(0.5, 50))
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return folder


def dequantize(w: Int4Weight) -> torch.Tensor:
    """W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n] in float32 -> [N, K]."""
    q = unpack_int32(w.qweight, w.bits, dim=0).float()
    K = q.shape[0]
    g = w.g_idx.long() if w.g_idx is not None else torch.arange(K) // w.group_size
    zeros = w.zeros.float()[g] if w.zeros is not None else 2 ** (w.bits - 1)
    return ((q - zeros) * w.scales.float()[g]).T
