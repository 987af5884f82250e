"""Throughput where a CLI user looks: the server logs one vLLM-style line every --log-stats-interval seconds while
busy (and none while idle), on stderr; `tritonq generate` ends with a stats line on stderr, its text on stdout."""
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_util import MODEL_NAME, Server  # noqa: E402

from tritonq.demo import DEFAULT_MODEL  # noqa: E402

LINE = re.compile(r"running (\d+), waiting (\d+) requests; prompt ([\d.]+) tokens/s, generation ([\d.]+) tokens/s; "
                  r"KV cache ([\d.]+)% used")


def test_server_logs_throughput_while_busy_and_not_while_idle(tmp_path):
    log = tmp_path / "server.log"
    server = Server(DEFAULT_MODEL, log, "--log-stats-interval", "0.2")
    try:
        time.sleep(1.0)  # idle: five intervals, no line
        assert not LINE.findall(log.read_text()), log.read_text()[-2000:]
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 300, "ignore_eos": True,
                                 "n": 2})
        assert reply.status_code == 200, reply.text
        lines = [tuple(map(float, found)) for found in LINE.findall(log.read_text())]
    finally:
        server.stop()
    assert lines, log.read_text()[-2000:]
    assert all(0 <= running <= 2 and waiting <= 2 and 0 <= kv <= 100 for running, waiting, _, _, kv in lines)
    busy = [line for line in lines if line[0] > 0]
    assert busy and all(generated > 0 for _, _, _, generated, _ in busy), lines  # 2 sequences decoding
    assert lines[0][2] > 0, lines  # the first line counts the prompt tokens of the request that woke the server


STATS = re.compile(r"prompt (\d+) tokens, ([\d.]+) tokens/s; time to first token ([\d.]+) s; decode (\d+) tokens, "
                   r"([\d.]+) tokens/s")


def test_generate_ends_with_a_stats_line_on_stderr(capsys, monkeypatch):
    import tritonq
    from tritonq import cli
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cli.main(["generate", str(DEFAULT_MODEL), "JULIET:", "--max-new-tokens", "12", "--dtype", "float32"])
    out, err = capsys.readouterr()
    reference = tritonq.load(DEFAULT_MODEL, dtype="float32").generate("JULIET:", max_new_tokens=12, return_dict=True)
    assert reference.finish_reasons == ["length"]  # 12 tokens, none of them EOS
    assert out == reference.text[0] + "\n"  # stdout holds the text only
    found = STATS.fullmatch(err.strip().splitlines()[-1])
    assert found, err
    prompt, prompt_rate, ttft, generated, decode_rate = (float(v) for v in found.groups())
    from transformers import AutoTokenizer
    assert prompt == len(AutoTokenizer.from_pretrained(DEFAULT_MODEL)("JULIET:").input_ids)
    assert generated == len(reference.token_ids[0]) == 12
    assert prompt_rate > 0 and ttft > 0 and decode_rate > 0
