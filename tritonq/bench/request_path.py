"""python -m tritonq.bench request_path: the tritonq files and function-to-function hops one /v1/completions
request crosses, traced (sys.settrace, every thread) over a real request to the server app on the shipped model.

Counted once the app is up and one request has warmed it: a file is a tritonq source file one of whose functions
ran; a hop is a distinct (caller, callee) pair of tritonq functions (a function calling itself, comprehensions
and generator expressions excluded), so steps that repeat the same calls count once. --list prints the hops;
the last line counts the calls of every function named *check* (how often the request is validated).
"""
from __future__ import annotations

import argparse
import threading
from collections import Counter
from pathlib import Path

import tritonq

ROOT = str(Path(tritonq.__file__).parent)
SKIPPED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


def _name(code) -> str:
    return f"{code.co_filename[len(ROOT) + 1:]}:{code.co_qualname}"


def trace_request(body: dict) -> tuple[set[str], set[tuple[str, str]], Counter]:
    """(files, hops, calls per function) of one POST /v1/completions with body to the app over the shipped
    model."""
    from fastapi.testclient import TestClient

    from tritonq.demo import DEFAULT_MODEL
    from tritonq.serve.app import create_app

    model = tritonq.load(DEFAULT_MODEL, max_seq_len=256, max_num_seqs=4)
    files: set[str] = set()
    hops: set[tuple[str, str]] = set()
    calls: Counter = Counter()

    def tracer(frame, event, arg):
        if event != "call" or not recording.is_set():
            return None
        code = frame.f_code
        if not code.co_filename.startswith(ROOT) or code.co_name in SKIPPED:
            return None
        files.add(code.co_filename[len(ROOT) + 1:])
        calls[_name(code)] += 1
        caller = frame.f_back
        while caller is not None and caller.f_code.co_name in SKIPPED:
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename.startswith(ROOT) and caller.f_code is not code:
            hops.add((_name(caller.f_code), _name(code)))
        return None

    recording = threading.Event()  # the tracer is set on every thread from the start, records only the request
    threading.settrace(tracer)
    with TestClient(create_app(model, "tiny")) as client:
        assert client.post("/v1/completions", json=body).status_code == 200  # warm: grammar-free first request
        recording.set()
        reply = client.post("/v1/completions", json=body)
        recording.clear()
    threading.settrace(None)
    if reply.status_code != 200:
        raise RuntimeError(f"the traced request failed: {reply.status_code} {reply.text}")
    return files, hops, calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench request_path", description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens the traced request generates")
    parser.add_argument("--list", action="store_true", help="print every hop (caller -> callee)")
    args = parser.parse_args(argv)
    files, hops, calls = trace_request({"model": "tiny", "prompt": "Once upon a time", "max_tokens": args.max_tokens})
    if args.list:
        for caller, callee in sorted(hops):
            print(f"{caller} -> {callee}")
    print(f"/v1/completions (max_tokens={args.max_tokens}): {len(files)} tritonq files, {len(hops)} hops")
    print("files: " + " ".join(sorted(files)))
    checks = {name: n for name, n in sorted(calls.items()) if "check" in name.rsplit(":", 1)[1].lower()}
    print("calls of the checks: " + ", ".join(f"{name} x{n}" for name, n in checks.items()))


if __name__ == "__main__":
    main()
