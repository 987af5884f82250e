"""Compiles happen at load, never in a request: tritonq.load(warm_up=True) compiles the int4 GEMM templates of a
4-bit checkpoint before the server's /health answers, so the first request compiles nothing (the server's DEBUG log
names every compile); warm_up=False (a one-shot `tritonq generate`) never compiles."""
import re

import pytest
import torch

import tritonq
from tritonq.demo import DEFAULT_MODEL

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.usefixtures("one_thread")
COMPILE_LINE = re.compile(r"compiled in|did not compile")  # cpu_lowbit's log of each compile, done or failed
LONG_PROMPT = DEFAULT_MODEL.parent.joinpath("heldout.txt").read_text()[:400]  # ~100 tokens: every prefill path


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    from tritonq.quantize.writer import write_quantized
    return write_quantized(DEFAULT_MODEL, tmp_path_factory.mktemp("awq") / "awq", "awq", group_size=128)


def test_one_shot_load_never_compiles(awq, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU backend, as a user runs it
    model = tritonq.load(awq, warm_up=False, max_seq_len=256)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled during a one-shot generate"))
    for prompt in (LONG_PROMPT[:40], LONG_PROMPT):  # prefills above TEMPLATE_ABOVE_M and DEQUANTIZE_ABOVE_M rows
        assert model.generate(prompt, max_new_tokens=4, ignore_eos=True)


def test_server_compiles_before_health_and_not_at_the_first_request(awq, tmp_path):
    from serve_util import MODEL_NAME, Server
    log = tmp_path / "server.log"
    # the CPU backend (Server defaults to the torch references), DEBUG: one log line per weight compiled
    server = Server(awq, log, "--dtype", "bfloat16", env={"TRITONQ_BACKEND": "", "TRITONQ_LOG_LEVEL": "DEBUG"})
    try:
        compiled_at_start = COMPILE_LINE.findall(log.read_text())
        assert compiled_at_start, log.read_text()[-3000:]  # the warm-up compiled (or tried) before /health said ok
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert COMPILE_LINE.findall(log.read_text()) == compiled_at_start, log.read_text()[-3000:]
    finally:
        server.stop()
