"""Shared fixtures for the format tests: a tiny random Llama saved by transformers, and an
independent int4 dequantizer written from the Int4Weight docstring formula."""
from __future__ import annotations

from pathlib import Path

import torch

from tritonq.formats.base import Int4Weight
from tritonq.formats.packing import unpack_int32

LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
GROUP_SIZE = 32  # divides both K values of the tiny model (hidden 64, intermediate 128)


def save_tiny_llama(folder: Path, dtype=torch.float16) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
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
