"""python -m tritonq.bench generate: prefill and decode tokens/s, tritonq vs transformers generate.

Both run the same random Llama (hidden 1024, 8 layers by default) on the same device in one
process, greedy, with a forced number of new tokens. Prefill time is a 1-token generate; decode
tokens/s is (N - 1) / (time(N tokens) - time(1 token)), measured the same way for both; the
median of --repeat interleaved runs is reported. Ratio > 1 means tritonq is faster.

--formats dense,awq,gptq,gptq8,fp8 instead times tritonq on that model written in each format
(from one fp16 dense checkpoint: AWQ / GPTQ int4 g128 asym, GPTQ 8-bit g128, FP8 per channel),
side by side: decode and prefill tokens/s and decode relative to dense. On CPU each quantized
format is also timed on the torch references (TRITONQ_BACKEND=torch, the path before the CPU
backend, with --reference-new-tokens since it is slow): the "before" columns.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

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
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default hidden * 11 / 4)")
    parser.add_argument("--formats", default=None,
                        help=f"comma-separated subset of {','.join(FORMATS)}: time tritonq per checkpoint format")
    parser.add_argument("--reference-new-tokens", type=int, default=4,
                        help="new tokens for the torch-reference ('before') timings of --formats on CPU")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.formats:
        return _formats(args, argv)

    import tritonq
    from transformers import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    hf = LlamaForCausalLM(_config(args)).eval()
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


# format name -> tritonq.quantize.write_quantized arguments (None: the dense checkpoint itself)
FORMATS = {
    "dense": None,
    "awq": ("awq", dict(group_size=128)),
    "gptq": ("gptq", dict(group_size=128, sym=False)),
    "gptq8": ("gptq", dict(group_size=128, sym=False, bits=8)),
    "fp8": ("fp8", dict(fp8_scheme="channel")),
}


def _config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate or args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=max(args.hidden // 256, 1), max_position_embeddings=4096,
                       eos_token_id=None, bos_token_id=None, pad_token_id=0)


def _rates(t1: list[float], tn: list[float], ids: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from the times of 1-token and new_tokens-token generates (medians)."""
    prefill, full = statistics.median(t1), statistics.median(tn)
    # full <= prefill only when other processes stalled the 1-token run: no decode figure then (nan)
    decode = len(ids) * (new_tokens - 1) / (full - prefill) if full > prefill else float("nan")
    return len(ids) * len(ids[0]) / prefill, decode


def _formats(args, argv: list[str]) -> None:
    import tritonq
    from tritonq.demo import byte_tokenizer
    from tritonq.quantize import write_quantized
    from transformers import LlamaForCausalLM

    names = args.formats.split(",")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown --formats {unknown}; choose from {','.join(FORMATS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt_len)).tolist()
    rows, models, folders = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(tmp) / "dense"
        LlamaForCausalLM(_config(args)).to(torch.float16).save_pretrained(dense)  # an fp16 file, as published
        byte_tokenizer().save_pretrained(dense)  # load() needs a tokenizer; the bench feeds token ids

        def load(name):
            return tritonq.load(folders[name], dtype=dtype, device=device, max_num_seqs=args.batch,
                                max_seq_len=args.prompt_len + args.new_tokens)
        for name in names:
            folders[name] = dense
            if FORMATS[name] is not None:
                fmt, options = FORMATS[name]
                folders[name] = write_quantized(dense, Path(tmp) / name, fmt, **options)
            start = time.perf_counter()
            models[name] = load(name)
            models[name].eos_token_ids = set()  # force exactly new_tokens tokens
            models[name].generate(ids, max_new_tokens=2)  # warm up
            rows[name] = {"format": name, "load_s": time.perf_counter() - start}
        # Interleaved rounds: load from other processes shifts every format alike, not one of them.
        times = {name: ([], []) for name in names}
        for _ in range(args.repeat):
            for name in names:
                times[name][0].append(_timed(lambda: models[name].generate(ids, max_new_tokens=1)))
                times[name][1].append(_timed(lambda: models[name].generate(ids, max_new_tokens=args.new_tokens)))
        for name in names:
            rows[name]["prefill_tok_s"], rows[name]["decode_tok_s"] = _rates(*times[name], ids, args.new_tokens)
        models.clear()
        if device == "cpu":  # before: the torch references, which dequantize the weight on every call
            os.environ["TRITONQ_BACKEND"] = "torch"
            try:
                for name in names:
                    if name == "dense":
                        continue
                    model = load(name)
                    model.eos_token_ids = set()
                    t1 = [_timed(lambda: model.generate(ids, max_new_tokens=1))]
                    tn = [_timed(lambda: model.generate(ids, max_new_tokens=args.reference_new_tokens))]
                    rows[name]["before_prefill_tok_s"], rows[name]["before_decode_tok_s"] = _rates(
                        t1, tn, ids, args.reference_new_tokens)
            finally:
                del os.environ["TRITONQ_BACKEND"]
    rows = list(rows.values())
    dense_decode = next((r["decode_tok_s"] for r in rows if r["format"] == "dense"), None)
    for r in rows:
        if dense_decode:
            r["decode_vs_dense"] = r["decode_tok_s"] / dense_decode
        if "before_decode_tok_s" in r:
            r["decode_speedup"] = r["decode_tok_s"] / r["before_decode_tok_s"]
    print(f"{device}, {dtype} compute, hidden {args.hidden}, intermediate {args.intermediate or args.hidden * 11 // 4}, "
          f"{args.layers} layers, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens} (before: {args.reference_new_tokens}), torch threads {torch.get_num_threads()}")
    cols = ["format", "decode_tok_s", "decode_vs_dense", "prefill_tok_s", "before_decode_tok_s",
            "before_prefill_tok_s", "decode_speedup", "load_s"]
    print_table([{c: r.get(c, "-") for c in cols} for r in rows])
    if args.out:
        write_json(args.out, "generate_formats", rows, command="python -m tritonq.bench generate " + " ".join(argv),
                   **vars(args))
