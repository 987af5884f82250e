"""python -m tritonq.bench spec: batch-1 decode tokens/s with and without speculative decoding.

The model (default: tritonq's default model, a ~1M-parameter Llama trained on Shakespeare; --model for
another) decodes greedily at batch 1, --new-tokens tokens with EOS ignored, on two workloads cut from
the held-out play (never seen in training):
  repetitive  a passage of --passage-tokens tokens, a blank line, then the passage again up to its
              middle: the continuation quotes a document already in the context (what prompt lookup
              is for; the default model knows no code, so no code workload)
  free        the text that follows that passage in the play, as long as the repetitive prompt: a
              plain continuation
For each workload the engines run interleaved --repeats times after a warm-up (the box may be shared:
medians), each on its own loaded model: `plain` (no speculation), `ngram` (prompt lookup, --num-tokens
proposals, n = --max-n .. 1) and, with --draft PATH, `draft` (that model proposing). Decode tokens/s is
GenerationOutput.decode_tokens_per_s (tokens after the first over the time from the first token to the
end); speedup is relative to plain on the same workload; acceptance rate and mean accepted length come
from the same runs. Every run's tokens are checked equal to plain's (greedy outputs must not change), in
float32 (see main).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from tritonq.bench.common import print_table, results_path, write_json


def workloads(tokenizer, passage_tokens: int) -> dict[str, list[int]]:
    """The two prompts (token ids, BOS first when the tokenizer adds one); see the module docstring."""
    from tritonq.demo import HELDOUT_TEXT
    ids = tokenizer(HELDOUT_TEXT.read_text(), add_special_tokens=False).input_ids
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    passage = ids[:passage_tokens]
    blank = tokenizer("\n\n", add_special_tokens=False).input_ids
    repetitive = bos + passage + blank + passage[:passage_tokens // 2]
    free = bos + ids[passage_tokens:passage_tokens + len(repetitive) - len(bos)]
    return {"repetitive": repetitive, "free": free}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench spec", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: tritonq's default model)")
    parser.add_argument("--draft", default=None, help="also time draft-model speculation with this checkpoint")
    parser.add_argument("--num-tokens", type=int, default=4, help="proposals per step (k)")
    parser.add_argument("--max-n", type=int, default=4, help="longest n-gram the lookup matches")
    parser.add_argument("--passage-tokens", type=int, default=160)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box)")
    parser.add_argument("--json", default=results_path("spec_cpu.json"), help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import tritonq
    from tritonq.demo import DEFAULT_MODEL
    model_path = str(args.model or DEFAULT_MODEL)
    # float32: in bf16 the logits of this small model tie exactly at times, and a tie may break differently in
    # the verification step (varlen attention over 1 + k rows) than in a decode step, which the check below
    # would report; in float32 the two agree, so every run's tokens are checked equal to plain's
    options = dict(max_num_seqs=1, max_num_batched_tokens=512, device="cpu", dtype=torch.float32)
    specs = {"plain": None,
             "ngram": {"method": "ngram", "num_tokens": args.num_tokens, "min_n": 1, "max_n": args.max_n}}
    if args.draft:
        specs["draft"] = {"method": "draft", "model": args.draft, "num_tokens": args.num_tokens}
    models = {name: tritonq.load(model_path, speculative=spec, **options) for name, spec in specs.items()}
    prompts = workloads(models["plain"].tokenizer, args.passage_tokens)
    rows = []
    for workload, prompt in prompts.items():
        runs: dict[str, list] = {name: [] for name in models}
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, model in models.items():
                out = model.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True, return_dict=True,
                                     progress=False)
                if repeat:
                    runs[name].append(out)
        plain_tokens = runs["plain"][0].token_ids
        plain_rate = statistics.median(o.decode_tokens_per_s for o in runs["plain"])
        for name, outs in runs.items():
            if any(o.token_ids != plain_tokens for o in outs):
                raise SystemExit(f"{name} on {workload}: greedy tokens differ from plain's; speculation is broken")
            rate = statistics.median(o.decode_tokens_per_s for o in outs)
            rate_accepted, length = outs[0].acceptance_rate, outs[0].mean_accepted_length
            rows.append({"workload": workload, "method": name, "prompt_tokens": len(prompt),
                         "decode_tok_s": round(rate, 1), "speedup": round(rate / plain_rate, 2),
                         "acceptance_rate": None if rate_accepted is None else round(rate_accepted, 3),
                         "mean_accepted_length": None if length is None else round(length, 2)})
    print(f"batch-1 greedy decode, {args.new_tokens} new tokens, k={args.num_tokens}, median of {args.repeats}, "
          f"{args.threads} thread(s), model {model_path}")
    print_table(rows)
    if args.json:
        write_json(args.json, "spec", rows, model=model_path, num_tokens=args.num_tokens, new_tokens=args.new_tokens,
                   repeats=args.repeats, threads=args.threads)
