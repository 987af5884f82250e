"""python -m tritonq.bench serve: online serving metrics (vLLM benchmark_serving style) vs the offline engine.

Starts `python -m tritonq.serve` on a free local port (a tiny random Llama unless --model is
given), sends --num-prompts streamed /v1/completions requests of random token ids (input and
output lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]) at each --rate
(Poisson arrivals; inf = all at t=0), greedy, and reports per rate: TTFT, TPOT, ITL (mean, p50,
p99, ms), request/s and output tokens/s, the best of --repeat runs. Then stops the server and runs the same prompts through
the offline Engine in this process; `server/offline` is server output tokens/s at rate inf over
offline output tokens/s (target >= 0.9: the HTTP layer should cost little).

Definitions as vLLM's: TTFT = arrival to the first non-empty chunk; ITL = gaps between chunks;
TPOT = (latency - TTFT) / (output tokens - 1); output tokens from the final usage chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tritonq.bench.common import print_table, write_json


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def launch(command: list[str], port: int, log: Path, env: dict | None = None,
           timeout_s: float = 300) -> subprocess.Popen:
    """Start a server (command: its argv, serving on `port`) and wait up to timeout_s for /health 200."""
    import httpx
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def tritonq_server_command(model: str, port: int, extra: list[str]) -> tuple[list[str], dict]:
    """argv and environment of `python -m tritonq.serve` for this checkout, serving `model` as "bench"."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return ([sys.executable, "-m", "tritonq.serve", model, "--port", str(port), "--served-model-name", "bench",
             "--log-level", "warning", *extra], env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, url: str, prompt: list[int], max_tokens: int, delay: float, ignore_eos: bool) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with client.stream("POST", url, json={
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed with {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            elif data["choices"] and data["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else float("nan")
    return {"ttft": ttft, "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])], "tokens": tokens,
            "latency": end - start, "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None}


async def _run_rate(url: str, prompts, out_lens, rate: float, seed: int, ignore_eos: bool = False) -> dict:
    """Send every prompt (streamed, greedy) at Poisson arrivals of `rate` per second (inf: all at t=0);
    TTFT / TPOT / ITL statistics and throughput of the run. ignore_eos (a vLLM extension tritonq.serve
    also takes): each request runs to its max_tokens."""
    import httpx
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)  # Poisson arrivals: exponential gaps
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, p, n, d, ignore_eos) for p, n, d in zip(prompts, out_lens, delays)])
        duration = time.perf_counter() - start
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    out_tokens = sum(r["tokens"] for r in results)
    row = {"rate": "inf" if rate == float("inf") else rate, "requests": len(results), "duration_s": duration,
           "req/s": len(results) / duration, "out_tok/s": out_tokens / duration,
           "total_tok/s": (out_tokens + sum(len(p) for p in prompts)) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row[f"{name}_mean_ms"] = statistics.fmean(values) if values else float("nan")
        row[f"{name}_p50_ms"] = _percentile(values, 50)
        row[f"{name}_p99_ms"] = _percentile(values, 99)
    return row


def _offline(model_path: str, prompts, out_lens, load_options: dict, repeat: int) -> float:
    """Output tokens/s of the offline engine on the same prompts and lengths (all queued at once);
    the best of `repeat` runs (a shared machine makes single runs noisy)."""
    import tritonq
    from tritonq.api.model import GenerationConfig
    model = tritonq.load(model_path, **load_options)
    engine = model.engine
    engine.add_request(prompts[0], GenerationConfig(max_new_tokens=2))  # warm-up, as the server had its first requests
    while engine.has_unfinished():
        engine.step()
    best = 0.0
    for _ in range(repeat):
        start, tokens = time.perf_counter(), 0
        for p, n in zip(prompts, out_lens):
            engine.add_request(p, GenerationConfig(max_new_tokens=n))
        while engine.has_unfinished():
            tokens += sum(out.token_id is not None for out in engine.step())
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: a tiny random Llama built here)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--rates", default="8,inf", help="comma-separated requests/s; inf = all at once")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="runs per rate and offline; the best is reported")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in rates):
        parser.error(f"--rates must be positive numbers or inf; got {args.rates}")
    if args.input_len * (1 + args.range_ratio) + args.output_len * (1 + args.range_ratio) > args.max_seq_len:
        parser.error("input_len and output_len at their largest exceed --max-seq-len; lower them")

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        if model_path is None:
            from tritonq.demo import write_tiny_llama
            model_path = str(write_tiny_llama(Path(tmp) / "tiny", hidden_size=args.hidden))
        rng = random.Random(args.seed)

        def length(n):
            return rng.randint(max(1, int(n * (1 - args.range_ratio))), max(1, int(n * (1 + args.range_ratio))))
        # token ids 33..126: printable ASCII in the byte tokenizer; any model's vocabulary has them
        prompts = [[rng.randint(33, 126) for _ in range(length(args.input_len))] for _ in range(args.num_prompts)]
        out_lens = [length(args.output_len) for _ in range(args.num_prompts)]

        port = free_port()
        command, env = tritonq_server_command(model_path, port, ["--max-num-seqs", str(args.max_num_seqs),
                                                                 "--max-seq-len", str(args.max_seq_len)])
        server = launch(command, port, Path(tmp) / "server.log", env)
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            asyncio.run(_run_rate(url, prompts[:1], [2], float("inf"), args.seed))  # a single request must pass first
            rows = [max((asyncio.run(_run_rate(url, prompts, out_lens, rate, args.seed)) for _ in range(args.repeat)),
                        key=lambda row: row["out_tok/s"]) for rate in rates]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        offline = _offline(model_path, prompts, out_lens,
                           {"max_seq_len": args.max_seq_len, "max_num_seqs": args.max_num_seqs}, args.repeat)
    for row in rows:
        row["offline_out_tok/s"] = offline
        row["server/offline"] = row["out_tok/s"] / offline
    print_table([{k: v for k, v in r.items() if not k.endswith("mean_ms")} for r in rows])
    at_inf = [r for r in rows if r["rate"] == "inf"]
    if at_inf:
        print(f"rate inf: server {at_inf[0]['out_tok/s']:.1f} output tok/s vs offline engine {offline:.1f} "
              f"= {at_inf[0]['server/offline']:.2f} (target >= 0.9)")
    if args.out:
        write_json(args.out, "serve", rows, num_prompts=args.num_prompts, input_len=args.input_len,
                   output_len=args.output_len, range_ratio=args.range_ratio)
