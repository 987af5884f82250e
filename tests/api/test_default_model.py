"""The shipped default model (tritonq/default_model, built by its train.py) loads and is trained.

Perplexity bound: the shipped checkpoint (seed 0, 600 steps, torch 2.13 CPU; training loss 4.4)
scores 68.5 on the first 1024 held-out tokens of Hamlet (a play it never saw) with transformers,
256-token windows. The bound 80 leaves ~15% for numerics of other torch builds and is far below
what an untrained model scores (about the vocabulary size, 2048), so a broken or swapped
checkpoint or tokenizer fails this regression guard.
"""
import torch
from models.test_llama import our_prefill_logits
from transformers import AutoModelForCausalLM, AutoTokenizer

import tritonq
from tritonq.bench.quality import window_perplexity
from tritonq.demo import DEFAULT_MODEL, HELDOUT_TEXT

PERPLEXITY_BOUND = 80.0
TOKENS = 1024


def test_default_model_perplexity_on_heldout_text_is_below_bound():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer(HELDOUT_TEXT.read_text())["input_ids"][:TOKENS])
    with torch.no_grad():
        ppl = window_perplexity(lambda x: hf(x).logits, ids, 256)
    assert ppl < PERPLEXITY_BOUND, ppl


def test_default_model_loads_in_tritonq_like_transformers(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    ours = tritonq.load(DEFAULT_MODEL, max_num_seqs=1, max_seq_len=64)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor([ours.tokenizer("HAMLET:\nTo be, or not to be, that is the question")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(our_prefill_logits(ours, ids), hf(ids).logits, atol=1e-4, rtol=0)
