"""The API key against a real server on 127.0.0.1: an empty or whitespace key is refused at startup (before
the model loads), a bare `Authorization: Bearer` never matches, and a non-ASCII key matches the UTF-8 bytes a
client sends (compared as bytes, never as text decoded one way and encoded another)."""
import os
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import MODEL_NAME, ROOT, Server, tiny_checkpoint  # noqa: E402

KEY = "clé-ключ"  # UTF-8 bytes differ from its latin-1 bytes ("é") and it has no latin-1 encoding at all ("ключ")
NORMAL = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = tiny_checkpoint(tmp_path_factory)
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", env={"TRITONQ_API_KEY": KEY})
    yield s
    s.stop()


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITONQ_API_KEY"}
    environ.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])), **(env or {}))
    return subprocess.run([sys.executable, "-m", "tritonq.serve", *args], env=environ, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, env, source", [
    (["--api-key", ""], None, "--api-key"),
    (["--api-key", " \t "], None, "--api-key"),
    (["--api-key", " key"], None, "--api-key"),
    ([], {"TRITONQ_API_KEY": ""}, "TRITONQ_API_KEY"),
    ([], {"TRITONQ_API_KEY": "  "}, "TRITONQ_API_KEY"),
])
def test_an_empty_or_padded_key_is_refused_before_the_model_loads(tmp_path, args, env, source):
    # a folder that does not exist: a check made after loading would fail on the missing model instead
    result = _serve(str(tmp_path / "no-such-model"), *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and source in lines[0] and "non-empty" in lines[0], lines
    assert "no-such-model" not in result.stderr


def test_create_app_refuses_an_empty_key():
    from tritonq.serve.app import create_app
    with pytest.raises(ValueError, match="api_key is ''"):
        create_app(model=None, served_model_name="x", api_key="")


def _status(server, authorization: bytes | None) -> int:
    headers = {} if authorization is None else {"Authorization": authorization}
    return httpx.post(f"{server.url}/v1/completions", json=NORMAL, headers=headers, timeout=60).status_code


def test_a_bearer_without_a_token_is_refused(server):
    for authorization in (None, b"Bearer", b"", b"Basic " + KEY.encode()):  # (h11 refuses trailing spaces)
        assert _status(server, authorization) == 401, authorization
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": b"Bearer"}, timeout=60)
    assert models.status_code == 401 and "API key" in models.json()["error"]["message"]


def test_a_non_ascii_key_matches_its_utf8_bytes_only(server):
    assert _status(server, b"Bearer " + KEY.encode("utf-8")) == 200
    assert _status(server, b"bearer  " + KEY.encode("utf-8")) == 200  # any scheme case, spaces between
    assert _status(server, b"Bearer " + "clé".encode("latin-1")) == 401  # another encoding of a key prefix
    assert _status(server, b"Bearer " + KEY.encode("utf-8")[:-1]) == 401  # one byte short
    assert _status(server, b"Bearer " + KEY.encode("utf-8") + b"x") == 401


def test_the_openai_client_with_a_wrong_key_gets_401(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
