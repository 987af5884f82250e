"""A `python -m tritonq.serve` process on 127.0.0.1 for the server tests (tests/serve/)."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_SEQ_LEN = 512
MODEL_NAME = "tiny"
KEY = "sk-test-key"


def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama the server tests serve (hidden 128, byte tokenizer), written once per module."""
    from tritonq.demo import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("serve") / "tiny", hidden_size=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The server on the torch backend; `entry` replaces `-m tritonq.serve` (a script taking the same
    arguments, e.g. one that patches the engine first), `env` is added to the environment and `key`
    is sent by `metric`."""

    def __init__(self, folder: Path, log: Path, *args: str, entry: list[str] | None = None,
                 env: dict | None = None, key: str | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        environ.update({"TRITONQ_BACKEND": "torch",  # env may override it
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))}
                       | (env or {}))
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, *(entry or ["-m", "tritonq.serve"]), str(folder), "--port", str(self.port),
             "--served-model-name", MODEL_NAME, "--max-seq-len", str(MAX_SEQ_LEN), "--log-level", "warning",
             *([] if "--dtype" in args else ["--dtype", "float32"]), *args],  # fp32 on any CPU, as in process
            env=environ, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"server did not answer /health within 180 s:\n{log.read_text()[-3000:]}")

    def metric(self, name: str) -> float:
        """The sum of a metric's samples over its labels; a labelled counter no request has touched yet has
        no sample, only its # TYPE line (prometheus_client), and counts 0."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        text = httpx.get(f"{self.url}/metrics", timeout=10, headers=headers).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"tritonq:{name}{{")]
        assert values or f"# TYPE tritonq:{name} " in text, f"tritonq:{name} not in /metrics"
        return sum(values)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
