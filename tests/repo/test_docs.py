"""Every ```python and ```bash block of README.md and docs/*.md runs, as a reader would run it, on the shipped model.

Each block is one subprocess (a fresh interpreter or `bash -e`), offline (HF_HUB_OFFLINE=1: a hub id fails), on one
thread, in a temporary folder that links the checkout's top-level entries (so `tritonq/default_model/checkpoint`
and `tests/data/...` resolve as from the checkout's root, and what a block writes stays there). A block preceded by
`<!-- docs-test: skip (reason) -->` is not run (hub downloads, GPUs, installs, long runs); ```text / ```json /
```yaml blocks are output or config and are never run. A block that starts the server (`tritonq serve`,
`python -m tritonq.serve`) runs in the background until `/health` answers; the blocks after it in the same page
talk to it, and it is stopped (Ctrl-C, exit status 0) when the tests end. Its port, 8000 in the text, is the only
thing rewritten: each page's server gets a free port.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!-- docs-test: skip \((.+)\) -->$")
SERVER = re.compile(r"(^|\s)(tritonq serve|python -m tritonq\.serve)\s(?!.*--help)")  # starts one (not --help)
PORT = re.compile(r"(?<=127\.0\.0\.1:)8000\b|(?<=--port )8000\b")
BLOCK_TIMEOUT_S = 300  # a hang guard, not a timing check: the slowest block takes ~20 s on a loaded 2-core VM


def starts_server(code: str) -> bool:
    return any(SERVER.search(line) for line in code.splitlines())


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason given in the skip marker, or None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the skip marker (the line before the fence) when there is one."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.name}:{i + 1}: a code block that is never closed"
        marker = SKIP.match(lines[i - 1].strip()) if i else None
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.lang in ("python", "bash") and b.skip is None]


def test_the_pages_have_runnable_examples_and_every_marker_a_reason():
    """The collection is not empty by accident, markers sit on runnable blocks, and a fence names its language."""
    assert len(RUN) >= 15 and {b.page.name for b in RUN} >= {"README.md", "usage.md", "server.md"}
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip().startswith("<!-- docs-test"):
                assert SKIP.match(line.strip()), f"{page.name}:{n + 1}: write `<!-- docs-test: skip (reason) -->`"
                assert n + 1 < len(lines) and re.match(r"```(python|bash)\s*$", lines[n + 1]), \
                    f"{page.name}:{n + 1}: a skip marker must be the line right before a python or bash block"
    unnamed = [b.id for b in ALL if not b.lang]
    assert not unnamed, f"blocks without a language (```text for output): {unnamed}"
    portless = [b.id for b in RUN if starts_server(b.code) and "--port 8000" not in b.code]
    assert not portless, f"server blocks must say `--port 8000` (the test gives each page's server a free port): {portless}"


def test_readme_is_a_front_door():
    """The README stays short (issue 54: at most ~200 lines); the rest lives in docs/."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_readme_setup_is_what_ci_runs():
    """CI installs the way the README says: each command of the README's set-up block begins a line of .ci/run
    (which may add `python -m` before pip and pytest, `--quiet` and pytest options)."""
    def plain(command: str) -> str:
        return " ".join(w for w in command.replace("python -m ", "").split() if w != "--quiet")

    setup = next(b for b in blocks(REPO / "README.md") if b.lang == "bash")
    ci = [plain(line) for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    commands = [plain(c) for line in setup.code.splitlines() for c in line.split("&&") if c.strip()]
    missing = [c for c in commands if not any(line.startswith(c) for line in ci)]
    assert len(commands) == 7 and not missing, f"README set-up commands that .ci/run does not run: {missing}"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A folder that looks like the checkout's root (links to its entries) without writing into it."""
    root = tmp_path_factory.mktemp("docs")
    for entry in REPO.iterdir():
        if entry.name != "build" and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    return root


def environment() -> dict[str, str]:
    """A reader's shell: offline, one thread, this checkout's tritonq and python first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's CPU backend (conftest sets it)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TRITONQ_LOG_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    return env


def command(block: Block, workdir: Path) -> list[str]:
    """bash -e for a shell block; a Python block is a script in workdir (so `import tritonq` finds the link there)."""
    if block.lang == "bash":
        return ["bash", "-e", "-o", "pipefail", "-c", block.code]
    script = workdir / f"block_{block.page.stem}_{block.line}.py"
    script.write_text(block.code)
    return [sys.executable, str(script)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """One server per page, started by the page's server block, stopped with Ctrl-C at the end."""

    def __init__(self, workdir: Path):
        self.workdir, self.running = workdir, {}

    def port(self, page: Path) -> int | None:
        return self.running[page][1] if page in self.running else None

    def start(self, block: Block) -> None:
        assert block.page not in self.running, f"{block.id}: a second server on one page"
        port = free_port()
        log = open(self.workdir / f"server_{block.page.stem}.log", "w+")
        process = subprocess.Popen(command(self.rewrite(block, port), self.workdir), cwd=self.workdir,
                                   env=environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.running[block.page] = (process, port, log)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{block.id}: the server exited ({process.returncode}):\n{self.output(log)}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"{block.id}: /health did not answer 200 within {BLOCK_TIMEOUT_S} s:\n{self.output(log)}")

    @staticmethod
    def rewrite(block: Block, port: int) -> Block:
        return Block(block.page, block.line, block.lang, PORT.sub(str(port), block.code), block.skip)

    @staticmethod
    def output(log) -> str:
        log.seek(0)
        return log.read()[-4000:]

    def stop_all(self) -> list[str]:
        problems = []
        for page, (process, _, log) in self.running.items():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal that runs it
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            if process.returncode != 0:
                problems.append(f"{page.name}: the server ended with {process.returncode}:\n{self.output(log)}")
            log.close()
        return problems


@pytest.fixture(scope="session")
def servers(workdir):
    running = Servers(workdir)
    yield running
    problems = running.stop_all()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, workdir: Path, servers: Servers):
    if starts_server(block.code):
        servers.start(block)
        return
    port = servers.port(block.page)
    if port is None and PORT.search(block.code):
        server = next((b for b in RUN if b.page == block.page and b.line < block.line and starts_server(b.code)), None)
        assert server is not None, f"{block.id} talks to a server that no block before it starts"
        servers.start(server)  # run alone (-k): start the page's server first
        port = servers.port(block.page)
    if port is not None:
        block = Servers.rewrite(block, port)
    result = subprocess.run(command(block, workdir), cwd=workdir, env=environment(), capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (f"{block.id} ({block.lang}) exited {result.returncode}\n--- code\n{block.code}"
                                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")
