"""python -m tritonq.bench engine: continuous batching vs static batches, and prefix-cache time to first token.

One random Llama (hidden 1024, 8 layers, fp32 on CPU by default), 128 prompts of random lengths
16..512 each with its own number of new tokens 16..256 (EOS ignored): the issue's size.
`--quick` is a smoke-test size (16 small prompts, hidden 256, 2 layers; seconds). Output tokens/s
(the requested tokens only, the same count for all three) of:
  engine        tritonq's engine, every prompt submitted at once (continuous batching)
  transformers  transformers generate over left-padded batches of 8, each batch running to its
                longest output (what static batching costs)
  static8       tritonq's engine fed one batch of 8 at a time: the next batch starts when the whole
                previous one is done (no continuous batching)
Ratios > 1 mean the engine is faster. Each run also reports CPU seconds (time.process_time):
with --threads 1 on a machine shared with other jobs that is the work done, unlike wall time,
which grows with whatever else runs; the `cpu ratio` rows compare those.

Prefix case: --prefix-prompts prompts that share a --system-len-token system prompt (each then
has 16..64 tokens of its own), time to first token (TTFT) with prefix caching on and off.
- TTFT is first token minus add_request. In the `burst` rows all prompts are submitted at once,
  so a request's TTFT includes waiting behind the prefills before it (the mean is about half the
  time to prefill them all). The `alone` rows send --prefix-alone other prompts one at a time: one
  request's own prefill latency, no queueing.
- Both engines are loaded and warmed before anything is timed: each first runs one request with
  the system prompt (on: the system prompt enters the cache; off: the same warm-up work). Every
  repeat uses fresh suffixes, the same for on and off, so no timed prompt hits more than the
  system prompt's full blocks (the last row counts the tokens served from the cache).
- Off and on alternate, --prefix-repeats times; the median is reported with each repeat's ratio.
Host overhead (--null-model): the engine over a model whose forward costs nothing (it returns fixed
logits of the right shape: token 0 always wins), so a step's time is the engine's own work on the
host: scheduling, preparing the step's tensors, sampling (a --null-vocab-wide argmax), stop checks
and detokenizing. For each batch size (--batch-sizes) --null-steps pure decode steps are timed after
every prompt (--null-prompt-len tokens) is prefilled, --repeats times; the rows give the median
microseconds per step and per sequence: greedy, with a repetition penalty (both read as
Model.generate reads them: text once at the end), and greedy streamed (text detokenized every step).

Why an earlier version reported caching as slower (off / on 0.41-0.63x in full runs, 3.8-4.3x
for that part alone): it timed off once and then on once, on a 2-core machine shared with
seven other jobs, with --threads 2. With two torch threads on busy cores every parallel op can
wait for a descheduled worker, so the cost of a step follows its number of small ops rather than
its tokens. The CPU attention runs per sequence, and with caching all 64 prompts are admitted in
one or two large steps that every one of them waits for, while without it they are spread over
about ten steps and the first ones finish early; once the per-op stall dominates, caching
removes little of the cost and the burst mean can invert. Measured here at the quick model size
with the issue's 64 x 256-token prefix case: --threads 2 gave 1.42x (burst), --threads 1 gave
3.88x (3.84x in CPU seconds; off took 84 s of wall time with 2 threads, 11.5 s with 1). Hence
--threads 1 for CPU figures, CPU seconds beside wall time, and alternating repeats.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

from tritonq.bench.common import add_size_args, fill_sizes, print_table, results_path, write_json

# The size (defaults) and a smoke-test size (--quick); a flag given explicitly wins over both.
FULL = {"num_prompts": 128, "min_in": 16, "max_in": 512, "min_out": 16, "max_out": 256, "hidden": 1024,
        "layers": 8, "vocab": 32000, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "prefix_prompts": 64,
        "system_len": 256, "prefix_repeats": 3, "prefix_alone": 8}
QUICK = {"num_prompts": 16, "min_in": 16, "max_in": 128, "min_out": 8, "max_out": 32, "hidden": 256, "layers": 2,
         "vocab": 4096, "max_num_seqs": 16, "max_num_batched_tokens": 512, "prefix_prompts": 16, "system_len": 128,
         "prefix_repeats": 2, "prefix_alone": 4}


class Clock:
    """Wall and process CPU seconds since construction."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


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


def _run_engine(engine, requests: list[tuple[list[int], int]]) -> list[tuple[float, float]]:
    """Submit (prompt, new tokens) requests at once and step until all are done. Returns each
    request's time to first token as (wall s, CPU s) from its submission (CPU: this process's)."""
    from tritonq.api.model import GenerationConfig
    clock = Clock()
    added = {}
    for prompt, n in requests:
        added[engine.add_request(prompt, GenerationConfig(max_new_tokens=n))] = clock.elapsed()
    first: dict[int, tuple[float, float]] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = clock.elapsed()
        for out in outputs:
            if out.token_id is not None and out.request_id not in first:
                first[out.request_id] = now
    return [(first[rid][0] - t[0], first[rid][1] - t[1]) for rid, t in added.items()]


def _throughput_rows(args, model, hf_folder: str, dtype: torch.dtype, requests, skip: set[str], report) -> None:
    """The engine vs static batches of 8 (tritonq) vs transformers padded batches of 8; report(rows) after each."""
    from transformers import AutoModelForCausalLM
    useful = sum(n for _, n in requests)
    rows = []

    def row(name: str, clock: Clock, **extra) -> None:
        wall, cpu = clock.elapsed()
        rows.append({"run": name, "seconds": wall, "cpu_seconds": cpu, "output_tok_s": useful / wall,
                     "cpu_output_tok_s": useful / cpu, "ratio": "", **extra})
        ratios = []
        if len(rows) > 1:
            first, last = rows[0], rows[-1]
            ratios = [{"run": f"engine / {name.split(' ')[0]}", "ratio": first["output_tok_s"] / last["output_tok_s"],
                       "cpu_ratio": first["cpu_output_tok_s"] / last["cpu_output_tok_s"]}]
        report([rows[-1]] + ratios)

    _run_engine(model.engine, [(requests[0][0][:32], 4)])  # warm up
    preempted = model.engine.scheduler.num_preemptions
    clock = Clock()
    _run_engine(model.engine, requests)
    row("engine", clock, preemptions=model.engine.scheduler.num_preemptions - preempted)

    if "static8" not in skip:  # the same engine, fed one batch of 8 at a time
        clock = Clock()
        for i in range(0, len(requests), 8):
            _run_engine(model.engine, requests[i:i + 8])
        row("static8 (tritonq, batches of 8)", clock)

    if "transformers" not in skip:
        hf = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=dtype).to(args.device).eval()
        with torch.inference_mode():  # warm up
            hf.generate(torch.tensor([requests[0][0][:32]], device=args.device), max_new_tokens=4,
                        min_new_tokens=4, do_sample=False, pad_token_id=0)
        clock = Clock()
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
        row("transformers (padded batches of 8)", clock)
        del hf


def _prefix_rows(args, folder: str, options: dict, rng: random.Random) -> list[dict]:
    """Mean TTFT of a burst of prompts sharing a system prompt, and of prompts sent alone: caching off vs on."""
    import tritonq
    system = [rng.randrange(args.vocab) for _ in range(args.system_len)]
    models = {}
    for caching in (False, True):  # both loaded and warmed before anything is timed
        model = tritonq.load(folder, max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching, **options)
        model.eos_token_ids = set()
        _run_engine(model.engine, [(system + [1, 2, 3], 1)])  # on: the system prompt enters the cache
        models[caching] = model
    burst = {False: [], True: []}   # per repeat: (mean wall TTFT, mean CPU TTFT)
    alone = {False: [], True: []}
    for repeat in range(args.prefix_repeats):
        prompts = [system + [rng.randrange(args.vocab) for _ in range(rng.randint(16, 64))]
                   for _ in range(args.prefix_prompts + args.prefix_alone)]  # fresh suffixes: only the system
        prompts, singles = prompts[:args.prefix_prompts], prompts[args.prefix_prompts:]  # prompt can hit
        for caching in ((False, True) if repeat % 2 == 0 else (True, False)):  # alternate who goes first
            engine = models[caching].engine
            ttft = _run_engine(engine, [(p, 1) for p in prompts])
            burst[caching].append(tuple(statistics.fmean(t[k] for t in ttft) for k in (0, 1)))
            single = [_run_engine(engine, [(p, 1)])[0] for p in singles]
            alone[caching].append(tuple(statistics.fmean(t[k] for t in single) for k in (0, 1)))
    rows = []
    for name, runs in (("burst", burst), ("alone", alone)):
        what = (f"{args.prefix_prompts} prompts submitted at once" if name == "burst"
                else f"{args.prefix_alone} prompts one at a time")
        med = {c: tuple(statistics.median(r[k] for r in runs[c]) for k in (0, 1)) for c in runs}
        for caching in (False, True):
            rows.append({"run": f"prefix {'on' if caching else 'off'}, {what}: mean TTFT",
                         "seconds": med[caching][0], "cpu_seconds": med[caching][1]})
        rows.append({"run": f"prefix TTFT off / on, {name}", "ratio": med[False][0] / med[True][0],
                     "cpu_ratio": med[False][1] / med[True][1],
                     "ratios_per_repeat": [round(off[0] / on[0], 2) for off, on in zip(runs[False], runs[True])]})
    bm = models[True].engine.block_manager
    rows.append({"run": "prefix on: prompt tokens served from the cache", "ratio": bm.prefix_hits / bm.prefix_queries,
                 "hits": bm.prefix_hits})
    return rows


class NullModel:
    """A model whose forward costs nothing: logits [R, vocab] float32 sliced from one tensor made once
    (row r: 1 at token 0, 0 elsewhere), a one-layer KV cache of one tiny head. Times the engine alone."""

    def __init__(self, vocab: int, max_rows: int):
        from tritonq.models.common import KVLayout
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.config = SimpleNamespace(vocab_size=vocab)
        self.kv_layout = KVLayout(num_layers=1, num_kv_heads=1, d_qk=8, d_v=8)
        self.logits = torch.zeros(max_rows, vocab)
        self.logits[:, 0] = 1.0

    def __call__(self, ctx, cache) -> torch.Tensor:
        rows = ctx.input_ids.shape[0] if ctx.logit_rows is None else ctx.logit_rows.shape[0]
        return self.logits[:rows]


def null_model_rows(args) -> list[dict]:
    """Median host microseconds per pure decode step (and per sequence) of the engine over NullModel."""
    from tritonq.demo import byte_tokenizer
    from tritonq.config import EngineConfig, GenerationConfig
    from tritonq.engine.engine import Engine
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    rows = []
    for batch in args.batch_sizes:
        max_seq_len = args.null_prompt_len + 2 + args.null_steps
        blocks = batch * -(-max_seq_len // 16)
        config = EngineConfig(max_seq_len=max_seq_len, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                              enable_prefix_caching=False)
        engine = Engine(NullModel(args.null_vocab, max(batch, 2048) * 2), tokenizer, config, eos_token_ids=set(),
                        num_blocks=blocks)
        for penalty, stream in ((1.0, False), (1.1, False), (1.0, True)):
            config = GenerationConfig(max_new_tokens=args.null_steps + 2, repetition_penalty=penalty)
            wall, cpu = [], []
            for _ in range(args.repeats):
                for _ in range(batch):
                    engine.add_request([rng.randrange(256) for _ in range(args.null_prompt_len)], config,
                                       stream=stream)
                while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.seqs.values()) \
                        or engine.scheduler.waiting:
                    engine.step()   # prefill every prompt (and sample its first token)
                clock = Clock()
                for _ in range(args.null_steps):
                    engine.step()
                seconds = clock.elapsed()
                wall.append(seconds[0] / args.null_steps)
                cpu.append(seconds[1] / args.null_steps)
                while engine.has_unfinished():
                    engine.step()
            step_us = statistics.median(wall) * 1e6
            what = "streamed (detokenized every step)" if stream else f"repetition_penalty {penalty}"
            rows.append({"run": f"null model, batch {batch}, {what}", "batch": batch,
                         "step_us": step_us, "seq_us": step_us / batch, "cpu_step_us": statistics.median(cpu) * 1e6,
                         "step_us_per_repeat": [round(w * 1e6) for w in wall]})
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench engine", description=__doc__.splitlines()[0])
    add_size_args(parser, FULL, QUICK, "smoke-test size (seconds), not the issue's size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--null-model", action="store_true",
                        help="only the host overhead: the engine over a model that costs nothing (see above)")
    parser.add_argument("--batch-sizes", default="1,64,256", help="--null-model: comma list of batch sizes")
    parser.add_argument("--null-steps", type=int, default=50, help="--null-model: decode steps timed per repeat")
    parser.add_argument("--null-prompt-len", type=int, default=128, help="--null-model: tokens per prompt")
    parser.add_argument("--null-vocab", type=int, default=512, help="--null-model: vocabulary of its logits")
    parser.add_argument("--repeats", type=int, default=5, help="--null-model: timed repeats (the median is reported)")
    parser.add_argument("--quantize", default=None, help="quantize on load, e.g. int4 (AWQ-style kernels on a GPU)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: engine (and so static8, "
                        "transformers), static8, transformers, prefix")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared machine 1 makes CPU seconds a measure of work)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: bench/results/engine_<device>.json at the full size, none with --quick)")
    args = parser.parse_args(argv)
    fill_sizes(args, FULL, QUICK)
    for low, high in (("min_in", "max_in"), ("min_out", "max_out")):
        if not 1 <= getattr(args, low) <= getattr(args, high):
            parser.error(f"--{low.replace('_', '-')} {getattr(args, low)} and --{high.replace('_', '-')} "
                         f"{getattr(args, high)}: expected 1 <= min <= max (--quick sets its own, smaller sizes)")
    if args.out is None and not args.quick:
        args.out = results_path("engine_null_model.json" if args.null_model else f"engine_{args.device}.json")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.null_model:
        try:
            args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            parser.error(f"--batch-sizes {args.batch_sizes}: expected a comma list of ints, e.g. 1,64,256")
        if min(args.batch_sizes + [args.null_steps, args.null_prompt_len, args.null_vocab, args.repeats]) < 1:
            parser.error("--null-model: batch sizes, --null-steps, --null-prompt-len, --null-vocab and --repeats "
                         "must be >= 1")
        rows = null_model_rows(args)
        print(f"host overhead: null model (vocab {args.null_vocab}), prompts of {args.null_prompt_len} tokens, "
              f"{args.null_steps} decode steps x {args.repeats} repeats, torch threads {torch.get_num_threads()}")
        print_table(rows)
        if args.out:
            write_json(args.out, "engine", rows, command="python -m tritonq.bench engine " + " ".join(argv),
                       **vars(args))
        return
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {"engine", "transformers", "static8", "prefix"}
    if unknown:
        parser.error(f"--skip {args.skip}: unknown {sorted(unknown)}; expected a comma list of "
                     "engine,static8,transformers,prefix")

    import tritonq

    dtype = torch.float32 if args.device == "cpu" else torch.float16
    rng = random.Random(0)
    requests = [([rng.randrange(args.vocab) for _ in range(rng.randint(args.min_in, args.max_in))],
                 rng.randint(args.min_out, args.max_out)) for _ in range(args.num_prompts)]
    useful = sum(n for _, n in requests)
    header = (f"{args.device}, {dtype}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
              f"{args.num_prompts} prompts in {args.min_in}..{args.max_in} out {args.min_out}..{args.max_out} "
              f"({useful} output tokens), max_num_seqs {args.max_num_seqs}, torch threads {torch.get_num_threads()}")
    rows: list[dict] = []

    def report(new_rows: list[dict]) -> None:
        """Print and save after each part (a long run keeps what it measured)."""
        rows.extend(new_rows)
        columns = dict.fromkeys(key for row in rows for key in row)
        print(header)
        print_table([{key: row.get(key, "") for key in columns} for row in rows])
        if args.out:
            write_json(args.out, "engine", rows, command="python -m tritonq.bench engine " + " ".join(argv),
                       **vars(args))

    with tempfile.TemporaryDirectory() as folder:
        _random_llama(folder, args)
        max_seq_len = max(args.max_in + args.max_out, args.system_len + 65)
        options = {"dtype": dtype, "device": args.device, "quantize": args.quantize, "max_seq_len": max_seq_len,
                   "max_num_batched_tokens": args.max_num_batched_tokens}
        if "engine" not in skip:
            model = tritonq.load(folder, max_num_seqs=args.max_num_seqs, **options)
            model.eos_token_ids = set()
            _throughput_rows(args, model, folder, dtype, requests, skip, report)
            del model
        if "prefix" not in skip:
            report(_prefix_rows(args, folder, options, rng))
