"""One request cannot hold or slow the others: the fairness caps (tritonq.serve.limits) and echo's prompt
scoring queued like generation, against a real `python -m tritonq.serve` on 127.0.0.1 through the official
openai client, httpx and a raw socket.

The server runs with small caps (4 stop strings of 64 characters in all, 512 tokens a request, a 1 s body
timeout) and a small KV cache (--max-num-seqs 2: 2 x 512 tokens), so that two streams hold most of it.
"""
import socket
import threading

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import MODEL_NAME, Server  # noqa: E402

from tolerances import BATCH_ATOL  # noqa: E402


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "2",
               "--max-request-tokens", "512", "--max-stop-strings", "4", "--max-stop-chars", "64",
               "--body-timeout", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.body


def test_stop_strings_past_the_caps_are_400(client):
    def complete(stop):
        return client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, stop=stop)
    error = _refusal(lambda: complete(["a", "b", "c", "d", "e"]))
    assert error["param"] == "stop" and "5 strings" in error["message"] and "--max-stop-strings" in error["message"]
    error = _refusal(lambda: complete(["x" * 40, "y" * 25]))
    assert error["param"] == "stop" and "65 characters" in error["message"] and "--max-stop-chars" in error["message"]
    assert complete(["a" * 16, "b" * 16, "c" * 16, "d" * 16]).choices[0].finish_reason in ("stop", "length")


def test_tokens_a_request_asks_past_the_budget_are_400(client):
    error = _refusal(lambda: client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=65, n=8))
    assert error["param"] == "max_tokens" and "520 tokens" in error["message"]
    assert "--max-request-tokens" in error["message"] and "512" in error["message"]
    # max_tokens left out: each choice may run to the end of the context (512 - the prompt)
    error = _refusal(lambda: client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user",
                                                                                          "content": "Hi"}], n=2))
    assert error["param"] == "n" and "set max_tokens" in error["message"]
    # at the budget: 2 prompts x n=4 x 64 tokens; accepted (closed after its first chunk)
    with client.completions.create(model=MODEL_NAME, prompt=[[5, 6], [7, 8]], max_tokens=64, n=4,
                                   stream=True) as stream:
        assert next(iter(stream)).choices
    # within it, a whole reply
    assert len(client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=8, n=4).choices) == 4


def test_body_that_never_completes_gets_408_and_its_connection_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes, then nothing
        received = b""
        while chunk := sock.recv(65536):  # until the server closes (the socket timeout guards a hang)
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    assert b"--body-timeout" in body and b"1 s" in body
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_echo_logprobs_wait_for_blocks_streams_hold(client, reference):
    """Two streams hold 38 of the 64 KV blocks and grow; echo + logprobs of a 450-token prompt needs 29:
    it waits for them (before: "scheduler stalled", a 503) and its logprobs equal Model.score's; the streams'
    texts equal their runs alone."""
    stream_prompt = [(7 * j) % 256 for j in range(300)]
    prompt = [(11 * j + 3) % 256 for j in range(450)]
    texts, first = ["", ""], threading.Event()

    def read():
        with client.completions.create(model=MODEL_NAME, prompt=stream_prompt, max_tokens=212, n=2, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as stream:
            for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                first.set()
    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(120)
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    reader.join(120)
    scored = reference.score(prompt)
    assert reply.choices[0].logprobs.token_logprobs[0] is None
    assert reply.choices[0].logprobs.token_logprobs[1:] == pytest.approx(scored[1:], abs=BATCH_ATOL)
    alone = reference.generate(stream_prompt, max_new_tokens=212, ignore_eos=True)
    assert texts == [alone, alone]
