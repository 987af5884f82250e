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

Every run also reports tritonq's decode step time (median over the timed decode steps) and the host
part of it: the time until the step's model call returns (on CPU the whole computation; on CUDA the
Python and launch time, or a graph replay, before the GPU finishes).

--device cuda (the default on a GPU) instead times tritonq alone on a random AWQ int4 model shaped
like Llama-2-7B (32 layers of 4096 / 11008, vocab 32000; --layers to shorten it): decode tokens/s
at batch 1, 8 and 32 with CUDA graphs and without (eager), and batch 1 as a fraction of the
weight-read floor, i.e. HBM bandwidth (a large device copy, measured in the same run) / bytes of
weights read per step.
"""
from __future__ import annotations

import argparse
import json
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
                        help="new tokens for the torch-reference ('before') timings of --formats on CPU "
                             "(at least 2: a decode rate needs two; 0 skips them)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: the graphs-vs-eager benchmark on a random AWQ Llama-2-7B-shaped model")
    parser.add_argument("--batches", default="1,8,32", help="--device cuda: decode batch sizes")
    args = parser.parse_args(argv)
    if args.reference_new_tokens == 1 or args.reference_new_tokens < 0:
        parser.error(f"--reference-new-tokens {args.reference_new_tokens}: a decode rate needs at least 2 new "
                     "tokens (the first is the prefill's); give 2 or more, or 0 to skip the reference timings")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.formats:
        return _formats(args, argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here; run without --device for the CPU benchmark.")
        return _cuda_graphs(args, argv)

    import tritonq
    from transformers import LlamaForCausalLM

    device = "cpu"
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
    timer = StepTimer(ours.engine)
    for _ in range(args.repeat):
        for n in (1, args.new_tokens):
            times["transformers"][n].append(_timed(lambda: run_hf(n)))
            times["tritonq"][n].append(_timed(lambda: run_ours(n)))
    rows = []
    for name, t in times.items():
        prefill, full = statistics.median(t[1]), statistics.median(t[args.new_tokens])
        rows.append({"engine": name, "prefill_tok_s": args.batch * args.prompt_len / prefill,
                     "decode_tok_s": args.batch * (args.new_tokens - 1) / (full - prefill)})
    rows[0] |= timer.summary()
    for key in ("prefill_tok_s", "decode_tok_s"):
        rows.append({"engine": f"ratio {key}", key: rows[0][key] / rows[1][key]})
    print(f"{device}, {dtype}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}, "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, torch threads {torch.get_num_threads()}")
    print_table(rows)
    print(f"tritonq decode step: {rows[0]['decode_step_ms']:.3g} ms, of which host (until the model call returns; "
          f"on CPU that is all of it) {rows[0]['decode_host_ms']:.3g} ms")
    if args.out:
        write_json(args.out, "generate", rows, command="python -m tritonq.bench generate " + " ".join(argv),
                   **vars(args))


class StepTimer:
    """Times an engine's decode steps: the whole engine.step() and the host part of it (prepare + the
    model call until it returns: without a device sync, that is launch time on CUDA). Installed on the
    instance; summary() gives the medians in ms over the decode steps seen."""

    def __init__(self, engine):
        runner, step, prepare, run = engine.runner, engine.step, engine.runner.prepare, engine.runner.run
        self.steps, self.host, state = [], [], {}

        def timed_prepare(seqs, num_new_tokens, is_prefill, *args, **kwargs):
            state["decode"], state["start"] = not is_prefill, time.perf_counter()
            return prepare(seqs, num_new_tokens, is_prefill, *args, **kwargs)

        def timed_run(ctx):
            out = run(ctx)
            if state.get("decode"):
                self.host.append(time.perf_counter() - state["start"])
            return out

        def timed_step():
            state["decode"] = False
            start = time.perf_counter()
            out = step()
            if state["decode"]:
                self.steps.append(time.perf_counter() - start)
            return out
        runner.prepare, runner.run, engine.step = timed_prepare, timed_run, timed_step

    def summary(self) -> dict:
        def median_ms(times):
            return 1e3 * statistics.median(times) if times else float("nan")
        return {"decode_step_ms": median_ms(self.steps), "decode_host_ms": median_ms(self.host)}


LLAMA_2_7B = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000)


def _write_random_awq_llama(folder: Path, layers: int, group: int = 128, device: str = "cuda") -> None:
    """A Llama-2-7B-shaped AWQ checkpoint (int4 GEMM layout, group 128) with random weights, written fast:
    random packed int4 and zeros, scales small enough to keep activations finite, fp16 embedding and head."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tritonq.demo import byte_tokenizer
    D, I, V = LLAMA_2_7B["hidden"], LLAMA_2_7B["intermediate"], LLAMA_2_7B["vocab"]
    gen = torch.Generator(device=device).manual_seed(0)  # random numbers drawn on the GPU: fast

    def awq(N, K):
        def ints(*shape):
            return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device=device, generator=gen).cpu()
        scales = (torch.rand(K // group, N, device=device, generator=gen) * 2e-3 + 1e-3).half().cpu()
        return {"qweight": ints(K, N // 8), "qzeros": ints(K // group, N // 8), "scales": scales}
    modules = {"self_attn.q_proj": (D, D), "self_attn.k_proj": (D, D), "self_attn.v_proj": (D, D),
               "self_attn.o_proj": (D, D), "mlp.gate_proj": (I, D), "mlp.up_proj": (I, D), "mlp.down_proj": (D, I)}
    weight_map = {}
    for i in range(layers):  # one file per layer: bounded host memory
        tensors = {f"model.layers.{i}.{m}.{k}": t for m, shape in modules.items() for k, t in awq(*shape).items()}
        tensors |= {f"model.layers.{i}.{n}.weight": torch.ones(D, dtype=torch.float16)
                    for n in ("input_layernorm", "post_attention_layernorm")}
        name = f"layer-{i:03d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    rest = {"model.embed_tokens.weight": (torch.randn(V, D, device=device, generator=gen) * 0.02).half().cpu(),
            "lm_head.weight": (torch.randn(V, D, device=device, generator=gen) * 0.02).half().cpu(),
            "model.norm.weight": torch.ones(D, dtype=torch.float16)}
    save_file(rest, str(folder / "rest.safetensors"), metadata={"format": "pt"})
    weight_map |= dict.fromkeys(rest, "rest.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=layers,
                         num_attention_heads=LLAMA_2_7B["heads"], num_key_value_heads=LLAMA_2_7B["kv_heads"],
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)  # load() needs a tokenizer; the bench feeds token ids


def _hbm_gbs() -> float:
    """Device memory bandwidth in GB/s from a 2 GiB device-to-device copy (bytes read + written / time)."""
    x = torch.empty(2 ** 30, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    gbs = 2 * x.numel() * x.element_size() * reps / (time.perf_counter() - start) / 1e9
    del x, y
    return gbs


def _weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every Linear's tensors (the lm_head included) and the norms
    (the embedding only gives one row per token: not counted)."""
    from tritonq.formats.layers import Linear, RMSNorm
    seen, total = set(), 0
    for module in model.modules():
        tensors = [module.weight] if isinstance(module, RMSNorm) else \
            [v for v in vars(module.weight).values() if isinstance(v, torch.Tensor)] if isinstance(module, Linear) else []
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _cuda_graphs(args, argv: list[str]) -> None:
    """--device cuda: decode tokens/s with and without CUDA graphs on a random AWQ Llama-2-7B-shaped model."""
    import tritonq
    batches = [int(b) for b in args.batches.split(",")]
    layers = args.layers if "--layers" in argv else 32
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        _write_random_awq_llama(Path(folder), layers)
        write_s = time.perf_counter() - start
        ours = tritonq.load(folder, dtype=torch.float16, device="cuda", max_num_seqs=max(batches),
                            max_seq_len=args.prompt_len + args.new_tokens)
    ours.eos_token_ids = set()  # force exactly new_tokens tokens
    runner = ours.engine.runner
    capture_s = runner.graphs.capture_s if runner.graphs is not None else float("nan")
    weight_bytes, gbs = _weight_bytes(ours.model), _hbm_gbs()
    floor = gbs * 1e9 / weight_bytes  # tokens/s of batch 1 if a step only read its weights at full bandwidth
    timer = StepTimer(ours.engine)
    rows = []
    for batch in batches:
        ids = torch.randint(0, LLAMA_2_7B["vocab"], (batch, args.prompt_len)).tolist()
        for graphs in (True, False):
            runner.replay_graphs = graphs
            ours.generate(ids, max_new_tokens=2)  # warm up
            timer.steps.clear(), timer.host.clear()
            t1, tn = [], []
            for _ in range(args.repeat):
                t1.append(_timed(lambda: ours.generate(ids, max_new_tokens=1)))
                tn.append(_timed(lambda: ours.generate(ids, max_new_tokens=args.new_tokens)))
            _, decode = _rates(t1, tn, ids, args.new_tokens)
            row = {"batch": batch, "cuda_graphs": graphs, "decode_tok_s": decode, **timer.summary()}
            if batch == 1:
                row["floor_fraction"] = decode / floor
            rows.append(row)
    runner.replay_graphs = True
    print(f"{torch.cuda.get_device_name()}: random AWQ int4 g128 Llama-2-7B shape, {layers} layers, fp16, prompt "
          f"{args.prompt_len}, new tokens {args.new_tokens}; weights read per step {weight_bytes / 1e9:.2f} GB, "
          f"copy bandwidth {gbs:.0f} GB/s -> floor {floor:.0f} tokens/s at batch 1; {len(runner.buckets)} graphs "
          f"captured in {capture_s:.1f} s (checkpoint written in {write_s:.0f} s)")
    print_table(rows)
    if args.out:
        # layers: the model built (32 without --layers), over args.layers (the CPU run's default 8)
        write_json(args.out, "generate_cuda_graphs", rows, command="python -m tritonq.bench generate " + " ".join(argv),
                   **vars(args) | dict(weight_bytes=weight_bytes, hbm_gbs=gbs, floor_tok_s=floor, capture_s=capture_s,
                                       layers=layers))


# format name -> tritonq.quantize.writer.write_quantized arguments (None: the dense checkpoint itself)
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
    from tritonq.quantize.writer import write_quantized
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
        if device == "cpu" and args.reference_new_tokens:  # before: the torch references, which dequantize the weight on every call
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
