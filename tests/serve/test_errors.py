"""serve/errors.py, the one mapping of exceptions to HTTP statuses: each type's status, and a real server
(tests/serve/serve_faulty.py on 127.0.0.1) answering every type raised on the engine thread with that status and the
OpenAI error body, then serving the next request as before."""
import os
from pathlib import Path

import httpx
import pytest
from serve_util import KEY, Server

from tritonq.engine.engine import EngineDeadError
from tritonq.engine.sequence import RequestTooLong
from tritonq.serve.engine_loop import EngineUnavailable, QueueFull, StepFailed
from tritonq.serve.errors import STATUSES, ClientGone, api_error, status_of
from tritonq.serve.protocol import APIError
from tritonq.engine.structured import GrammarError

# What each type must be answered with, written out (not read from STATUSES): OpenAI's and HTTP's meanings.
EXPECTED = {QueueFull: 429, EngineUnavailable: 503, EngineDeadError: 503, StepFailed: 500, ClientGone: 499,
            RequestTooLong: 400, GrammarError: 400, ValueError: 400, TypeError: 400}
AUTH = {"Authorization": f"Bearer {KEY}"}
NORMAL = {"model": "tiny", "prompt": "Once upon", "max_tokens": 4, "temperature": 0}


def test_every_mapped_type_has_its_status_and_others_are_500():
    assert {kind for kind, _ in STATUSES} == set(EXPECTED)
    for kind, status in EXPECTED.items():
        assert status_of(kind("why")) == status, kind
        error = api_error(kind("why"), "what failed: ")
        assert (error.status, error.message) == (status, "what failed: why")
        assert (error.headers or {}).get("Retry-After") == ("1" if status == 429 else None)
    # subclasses of ValueError keep their own entry's status; an unknown type is a 500 naming it
    assert status_of(RequestTooLong("x")) == 400 and status_of(KeyError("k")) == 500
    assert api_error(KeyError("k")).message == "internal error: KeyError: 'k'"
    own = APIError(404, "no such model", "model")
    assert api_error(own) is own


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fault") / "fault"


@pytest.fixture(scope="module")
def server(checkpoint, fault_file, tmp_path_factory):
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "2", "--api-key", KEY,
               entry=[str(Path(__file__).parent / "serve_faulty.py")],
               env={"TRITONQ_TEST_FAULT_FILE": str(fault_file)}, key=KEY)
    yield s
    s.stop()


def _post(server, body):
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("kind, status", [*EXPECTED.items(), (KeyError, 500)], ids=lambda v: getattr(v, "__name__", v))
def test_an_exception_from_the_engine_is_answered_with_its_status_and_the_server_goes_on(server, fault_file, kind,
                                                                                         status):
    expected = _post(server, NORMAL).json()["choices"][0]["text"]
    staged = fault_file.with_suffix(".tmp")
    staged.write_text(f"add {kind.__name__}")
    os.replace(staged, fault_file)  # the next Engine.add_checked raises kind("injected NAME")
    reply = _post(server, NORMAL)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and f"injected {kind.__name__}" in error["message"], error
    if status == 429:
        assert reply.headers["Retry-After"] == "1"
    assert not fault_file.exists()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert _post(server, NORMAL).json()["choices"][0]["text"] == expected
