"""python -m tritonq.bench engine: continuous batching vs static batches, and prefix-cache time to first token.

One random Llama (hidden 1024, 8 layers, fp32 on CPU by default), N prompts of random lengths
(--min-in..--max-in) each with its own number of new tokens (--min-out..--max-out, EOS ignored).
Output tokens/s (the requested tokens only, the same count for all three) of:
  engine        tritonq's engine, every prompt submitted at once (continuous batching)
  transformers  transformers generate over left-padded batches of 8, each batch running to its
                longest output (what static batching costs)
  static8       tritonq's model one batch of 8 at a time: the next batch starts when the whole
                previous one is done (no continuous batching)
Prefix case: --prefix-prompts prompts sharing a --system-len-token system prompt; mean time to
first token with prefix caching on and off (a first request puts the system prompt in the cache).
Ratios > 1 mean the engine (or prefix caching) is faster.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from tritonq.bench.common import print_table, write_json


def _random_llama(folder: str, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonq.demo import byte_tokenizer
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                         num_key_value_heads=max(args.hidden // 256, 1), max_position_embeddings=4096,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)  # load() needs a tokenizer; the bench feeds token ids


def _run_engine(engine, requests: list[tuple[list[int], int]]) -> dict[int, object]:
    """Submit (prompt, new tokens) requests at once and step until done; {request id: Request}."""
    from tritonq.generate import GenerationConfig
    ids = [engine.add_request(p, GenerationConfig(max_new_tokens=n)) for p, n in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request
    return {rid: done[rid] for rid in ids}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-in", type=int, default=16)
    parser.add_argument("--max-in", type=int, default=512)
    parser.add_argument("--min-out", type=int, default=16)
    parser.add_argument("--max-out", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantize", default=None, help="quantize on load, e.g. int4 (AWQ-style kernels on a GPU)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefix-prompts", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--skip", default="", help="comma list of runs to skip: transformers,static8,prefix")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    import tritonq
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if args.device == "cpu" else torch.float16
    rng = random.Random(0)
    requests = [([rng.randrange(args.vocab) for _ in range(rng.randint(args.min_in, args.max_in))],
                 rng.randint(args.min_out, args.max_out)) for _ in range(args.num_prompts)]
    useful = sum(n for _, n in requests)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _random_llama(folder, args)
        max_seq_len = max(args.max_in + args.max_out, args.system_len + 65)
        options = dict(dtype=dtype, device=args.device, quantize=args.quantize, max_seq_len=max_seq_len,
                       max_num_batched_tokens=args.max_num_batched_tokens)
        model = tritonq.load(folder, max_num_seqs=args.max_num_seqs, **options)
        model.eos_token_ids = set()
        _run_engine(model.engine, [(requests[0][0][:32], 4)])  # warm up
        start = time.perf_counter()
        _run_engine(model.engine, requests)
        engine_s = time.perf_counter() - start
        rows.append({"run": "engine", "seconds": engine_s, "output_tok_s": useful / engine_s, "ratio": "",
                     "preemptions": model.engine.scheduler.num_preemptions})

        if "static8" not in skip:  # the same engine, fed one batch of 8 at a time
            start = time.perf_counter()
            for i in range(0, len(requests), 8):
                _run_engine(model.engine, requests[i:i + 8])
            static_s = time.perf_counter() - start
            rows.append({"run": "static8 (tritonq, batches of 8)", "seconds": static_s, "output_tok_s": useful / static_s})

        if "transformers" not in skip:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
            start = time.perf_counter()
            for i in range(0, len(requests), 8):
                batch = requests[i:i + 8]
                width = max(len(p) for p, _ in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for b, (p, _) in enumerate(batch):  # left padding, as decoder-only generate needs
                    ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
                n = max(k for _, k in batch)
                with torch.inference_mode():
                    hf.generate(ids.to(args.device), attention_mask=mask.to(args.device), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
            hf_s = time.perf_counter() - start
            rows.append({"run": "transformers (padded batches of 8)", "seconds": hf_s, "output_tok_s": useful / hf_s})
            del hf
        for row in rows[1:]:
            rows.append({"run": f"engine / {row['run'].split(' ')[0]}",
                         "ratio": rows[0]["output_tok_s"] / row["output_tok_s"]})

        if "prefix" not in skip:
            system = [rng.randrange(args.vocab) for _ in range(args.system_len)]
            prefixed = [(system + [rng.randrange(args.vocab) for _ in range(rng.randint(16, 64))], 1)
                        for _ in range(args.prefix_prompts)]
            ttft = {}
            for caching in (False, True):
                model = tritonq.load(folder, max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching, **options)
                model.eos_token_ids = set()
                _run_engine(model.engine, [(system + [1, 2, 3], 1)])  # the system prompt enters the cache
                done = _run_engine(model.engine, prefixed)
                ttft[caching] = sum(r.time_to_first_token_s for r in done.values()) / len(done)
                rows.append({"run": f"prefix {'on' if caching else 'off'}: mean time to first token",
                             "seconds": ttft[caching]})
            rows.append({"run": "prefix TTFT off / on", "ratio": ttft[False] / ttft[True]})
    print(f"{args.device}, {dtype}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{args.num_prompts} prompts in {args.min_in}..{args.max_in} out {args.min_out}..{args.max_out} "
          f"({useful} output tokens), max_num_seqs {args.max_num_seqs}, torch threads {torch.get_num_threads()}")
    print_table(rows)
    if args.out:
        write_json(args.out, "engine", rows, command="python -m tritonq.bench engine " + " ".join(argv), **vars(args))
