"""python -m tritonq.bench generate: prefill and decode tokens/s, tritonq vs transformers generate.

Both run the same random Llama (hidden 1024, 8 layers by default) on the same device in one
process, greedy, with a forced number of new tokens. Prefill time is a 1-token generate; decode
tokens/s is (N - 1) / (time(N tokens) - time(1 token)), measured the same way for both; the
median of --repeat interleaved runs is reported. Ratio > 1 means tritonq is faster.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tritonq.bench.common import print_table, write_json


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench generate", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a busy machine 1 avoids thread-pool stalls on small ops)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import tritonq
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(args.hidden // 256, 1), max_position_embeddings=4096,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        from tritonq.demo import byte_tokenizer
        byte_tokenizer().save_pretrained(folder)  # load() needs a tokenizer; the bench feeds token ids
        ours = tritonq.load(folder, dtype=dtype, device=device, max_num_seqs=args.batch,
                            max_seq_len=args.prompt_len + args.new_tokens)
    ours.eos_token_ids = set()  # force exactly new_tokens tokens, as for transformers below
    hf = hf.to(device=device, dtype=dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt_len), device=device)

    def run_hf(n):
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def run_ours(n):
        ours.generate(ids.tolist(), max_new_tokens=n)

    times = {name: {1: [], args.new_tokens: []} for name in ("tritonq", "transformers")}
    run_hf(2), run_ours(2)  # warm up
    for _ in range(args.repeat):
        for n in (1, args.new_tokens):
            times["transformers"][n].append(_timed(lambda: run_hf(n)))
            times["tritonq"][n].append(_timed(lambda: run_ours(n)))
    rows = []
    for name, t in times.items():
        prefill, full = statistics.median(t[1]), statistics.median(t[args.new_tokens])
        rows.append({"engine": name, "prefill_tok_s": args.batch * args.prompt_len / prefill,
                     "decode_tok_s": args.batch * (args.new_tokens - 1) / (full - prefill)})
    for key in ("prefill_tok_s", "decode_tok_s"):
        rows.append({"engine": f"ratio {key}", key: rows[0][key] / rows[1][key]})
    print(f"{device}, {dtype}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}, "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, torch threads {torch.get_num_threads()}")
    print_table(rows)
    if args.out:
        write_json(args.out, "generate", rows, command="python -m tritonq.bench generate " + " ".join(argv),
                   **vars(args))
