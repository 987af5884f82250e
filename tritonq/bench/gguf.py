"""python -m tritonq.bench gguf: one GGUF file through tritonq and llama.cpp: batch-1 decode and offline tokens/s.

    python -m tritonq.bench gguf FILE.gguf [--prompt-len 64] [--new-tokens 32] [--batch 8] [--repeat 3]

Rows: tritonq with the file's block formats on their kernels (Q4_0 / Q8_0 as int weights, the K-quants and
Q4_1 / Q5_x as GGUFWeight: docs/gguf.md); tritonq with every linear of the same file dequantized to dense at
load (what transformers does with a GGUF file: the memory it costs, the speed it buys); and llama.cpp's
`llama-bench` on the same file when it is on PATH (its `tg` test: batch-1 decode from an empty context; `pp`:
prompt tokens/s; run with -t the torch thread count, so both engines use the same threads), skipped with a
message otherwise. Batch-1 decode tokens/s is (N - 1) / (time(N tokens) - time(1 token)), the
median of --repeat interleaved runs (tritonq/bench/generate.py's measure); offline is --batch random prompts generated
together, new tokens / wall time. Weight bytes: the linears' typed weights as loaded (the CPU backend's
repacked copies of 4-bit weights come on top).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tritonq.bench.common import print_table, write_json
from tritonq.bench.generate import _rates, _timed, _weight_bytes


@contextmanager
def _dequantized():
    """tritonq.load reads every linear of a GGUF file dense (GGUFLoader quantizes nothing) inside the block."""
    from tritonq.formats.gguf import GGUFLoader
    real = GGUFLoader.is_quantized
    GGUFLoader.is_quantized = lambda self, prefix: False
    try:
        yield
    finally:
        GGUFLoader.is_quantized = real


def _tritonq_row(path: str, name: str, args, ids: list[list[int]]) -> dict:
    import tritonq
    start = time.perf_counter()
    model = tritonq.load(path, dtype=torch.float32, device="cpu", max_num_seqs=args.batch,
                         max_seq_len=args.prompt_len + args.new_tokens)
    load_s = time.perf_counter() - start
    model.eos_token_ids = set()  # force exactly new_tokens tokens
    one = ids[:1]
    model.generate(one, max_new_tokens=2)  # warm up
    t1, tn, offline = [], [], []
    for _ in range(args.repeat):
        t1.append(_timed(lambda: model.generate(one, max_new_tokens=1)))
        tn.append(_timed(lambda: model.generate(one, max_new_tokens=args.new_tokens)))
        offline.append(_timed(lambda: model.generate(ids, max_new_tokens=args.new_tokens)))
    prefill, decode = _rates(t1, tn, one, args.new_tokens)
    return {"engine": name, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "offline_tok_s": len(ids) * args.new_tokens / statistics.median(offline),
            "weight_MB": _weight_bytes(model.model) / 1e6, "load_s": load_s}


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench's `-o json` (or `-o jsonl`) output -> {"tg": decode tok/s, "pp": prompt tok/s, "n_threads",
    "build"}: tg is the test with n_gen > 0 and no prompt, pp the one with n_prompt > 0 and no generation (a
    combined `-pg` test is neither); the rates are the tests' avg_ts. Lines around the JSON (a build's log on
    stdout) are skipped; output with no test in it raises ValueError."""
    text = stdout.strip()
    start, end = text.find("["), text.rfind("]")
    if start >= 0 and end > start and text[start:end + 1].lstrip("[ \n").startswith("{"):
        tests = json.loads(text[start:end + 1])
    else:  # jsonl: one object a line
        tests = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    if not tests:
        raise ValueError(f"llama-bench printed no test results: {stdout.strip()[-300:]!r}")
    out = {"tg": float("nan"), "pp": float("nan"), "n_threads": tests[0].get("n_threads"),
           "build": f"{tests[0].get('build_commit', '?')} (build {tests[0].get('build_number', '?')})"}
    for t in tests:
        prompt, gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        if gen > 0 and prompt == 0:
            out["tg"] = float(t["avg_ts"])
        elif prompt > 0 and gen == 0:
            out["pp"] = float(t["avg_ts"])
    return out


def _llama_cpp_row(path: str, args, threads: int) -> dict | str:
    """llama-bench's tg (decode) and pp (prompt) tokens/s on the file with `threads` threads, or why there is
    no row."""
    exe = shutil.which("llama-bench")
    if exe is None:
        return ("llama.cpp: skipped (llama-bench is not on PATH; build llama.cpp or install its release binaries "
                "and put llama-bench on PATH to add its row)")
    command = [exe, "-m", path, "-p", str(args.prompt_len), "-n", str(args.new_tokens), "-r", str(args.repeat),
               "-t", str(threads), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        return f"llama.cpp: llama-bench failed (exit {result.returncode}): {result.stderr.strip()[-500:]}"
    try:
        rate = parse_llama_bench(result.stdout)
    except ValueError as e:
        return f"llama.cpp: {e}"
    print(f"llama.cpp: {exe}, build {rate['build']}, threads {rate['n_threads']}")
    return {"engine": "llama.cpp llama-bench", "decode_tok_s": rate["tg"], "prefill_tok_s": rate["pp"],
            "offline_tok_s": "-", "weight_MB": "-", "load_s": "-", "threads": rate["n_threads"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench gguf", description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a .gguf file (one that tritonq.load reads)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="prompts generated together for the offline figure")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both engines: torch's, and llama-bench's -t (default: torch's count)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tritonq.formats.gguf import GGUFWeights, read_config
    vocab = read_config(GGUFWeights([Path(args.file)]))["vocab_size"]
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len)).tolist()
    threads = torch.get_num_threads()
    rows = [_tritonq_row(args.file, "tritonq (block formats)", args, ids)]
    with _dequantized():
        rows.append(_tritonq_row(args.file, "tritonq (dequantized to dense)", args, ids))
    for row in rows:
        row["threads"] = threads
    llama_cpp = _llama_cpp_row(args.file, args, threads)
    if isinstance(llama_cpp, str):
        print(llama_cpp)
    else:
        rows.append(llama_cpp)
    print(f"{args.file}: cpu, fp32 compute, prompt {args.prompt_len}, new tokens {args.new_tokens}, offline batch "
          f"{args.batch}, torch threads {torch.get_num_threads()}")
    print_table(rows)
    if args.out:
        write_json(args.out, "gguf", rows, command="python -m tritonq.bench gguf " + " ".join(argv), **vars(args))
