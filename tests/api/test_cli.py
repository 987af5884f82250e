"""The `tritonq` command (tritonq/cli.py): help without torch, one error line for bad input, the extras it
names, generate / chat against the Python API, the demo's output and the perplexity hint."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tritonq
from tritonq import cli
from tritonq.demo import DEFAULT_MODEL, HELDOUT_TEXT

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a thread pool only adds sync overhead
# The commands run as a user's do: on the CPU backend, not through Triton's interpreter (tests/conftest.py
# sets TRITON_INTERPRET=1 for the kernel tests; it makes the default model ~100x slower).
NO_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
MODEL = str(DEFAULT_MODEL)
HEAVY = ("torch", "transformers", "triton", "fastapi", "uvicorn")


def run_python(code: str, stdin: str = "") -> subprocess.CompletedProcess:
    """code in a fresh interpreter from the checkout (nothing imported yet)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=stdin, capture_output=True, text=True,
                          timeout=120, env={**NO_INTERPRETER, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


HELP_CASES = [[], ["eval", "perplexity"], ["eval", "lm_eval"], *([name] for name in cli.COMMANDS)]


@pytest.mark.parametrize("argv", HELP_CASES, ids=lambda a: " ".join(a) or "tritonq")
def test_help_exits_0_without_importing_torch(argv):
    """Every command's --help prints its usage and exits 0 before torch (or another heavy package) is imported."""
    result = run_python(f"""
import sys
from tritonq.cli import main
try:
    main({[*argv, '--help']!r}, prog="tritonq")
except SystemExit as e:
    print("EXIT", e.code)
print("HEAVY", [m for m in {HEAVY!r} if m in sys.modules])
""")
    assert result.returncode == 0, result.stderr
    assert "usage: tritonq" in result.stdout and "EXIT 0" in result.stdout, result.stdout
    assert "HEAVY []" in result.stdout, result.stdout


def test_python_m_tritonq_is_the_command():
    result = subprocess.run([sys.executable, "-m", "tritonq", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "usage: python -m tritonq" in result.stdout
    assert all(name in result.stdout for name in cli.COMMANDS)


def _actions(parser: argparse.ArgumentParser):
    """(the parser, its action) for every option and positional of parser and its subcommands' parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser, action


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_every_option_is_described_with_its_default(name):
    for parser, action in _actions(cli.COMMANDS[name].parser_for(f"tritonq {name}")):
        assert action.help, f"{parser.prog}: {action.dest} has no help text"
        if action.option_strings and action.default is not None and action.default is not False \
                and action.default != "":  # `is`: 0 and 0.0 are defaults to show, though 0 == False
            no_space = "".join  # help text wraps lines, at spaces or after a "-"
            assert no_space(f"(default: {action.default})".split()) in no_space(parser.format_help().split()), \
                f"{parser.prog} {action.option_strings[0]}: default {action.default!r} not shown"


def cli_error(argv: list[str], capsys) -> str:
    """The message for a user error: exit status 2, exactly one line on stderr, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, prog="tritonq")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1 and " error: " in err, err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["nope"], "unknown command 'nope'"),
    (["serve", "tritonq/default_modl/checkpoint"], "is not a checkpoint folder"),
    (["serve", MODEL, "--quantize", "int5"], "invalid choice: 'int5'"),
    (["serve", MODEL, "--port", "http"], "--port: invalid int value"),
    (["serve", MODEL, "--tensor-parallel", "2"], "needs 2 processes: start the server with `torchrun --nproc-per-node 2"),
    (["generate", MODEL, "Hi", "--top-p", "2"], "top_p"),
    (["generate", "no/such-model-here", "Hi"], "no/such-model-here"),
    (["chat", MODEL, "--temperature", "-1"], "temperature"),
    (["quantize", "missing_src", "dst", "--format", "awq"], "missing_src has no config.json"),
    (["quantize", MODEL, "dst", "--format", "awq", "--sym"], "drop --sym"),
    (["eval", "perplexity", MODEL, "missing.txt"], "missing.txt is not a file"),
    (["eval", "bleu"], "invalid choice: 'bleu'"),
    (["bench", "int4-gem"], "unknown benchmark 'int4-gem'; choose from attention, engine,"),
    (["tune", "--kernel", "int5_gemm"], "invalid choice: 'int5_gemm'"),
    (["check", "--workers", "0"], "--workers 0"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens 0"),
])
def test_bad_argument_is_one_error_line(argv, expected, capsys):
    assert expected in cli_error(argv, capsys)


@pytest.fixture
def no_load(monkeypatch):
    """tritonq.load replaced by a failure: the error must come before the model loads."""
    monkeypatch.setattr(tritonq, "load", lambda *a, **k: pytest.fail("the model started loading before the error"))


@pytest.fixture
def cpu_torch(monkeypatch):
    """torch as a CPU-only build has it, on any machine."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


@pytest.mark.parametrize("command", [["generate", MODEL, "Hi"], ["chat", MODEL], ["serve", MODEL],
                                     ["eval", "perplexity", MODEL, __file__]])
def test_cuda_on_a_cpu_torch_is_one_error_line_before_the_model_loads(command, no_load, cpu_torch, capsys):
    err = cli_error([*command, "--device", "cuda"], capsys)
    assert "--device cuda: this torch" in err and "is built without CUDA; pass --device cpu" in err


@pytest.mark.parametrize("device, expected", [
    ("cuda:3", "--device cuda:3: this machine has 2 CUDA GPUs (cuda:0 to cuda:1)"),
    ("mps", "--device mps: tritonq runs on cpu or cuda"),
    ("cuda:x", "--device 'cuda:x' is not a device name; expected cpu, cuda or cuda:N")])
def test_unavailable_device_is_one_error_line_before_the_model_loads(device, expected, no_load, monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert expected in cli_error(["generate", MODEL, "Hi", "--device", device], capsys)


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_invalid_port_is_one_error_line_before_the_model_loads(port, no_load, capsys):
    assert f"argument --port: {port} is not a TCP port; expected 1-65535" in cli_error(["serve", MODEL, "--port", port],
                                                                                       capsys)


def test_busy_port_is_one_error_line_before_the_model_loads(no_load, capsys):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = cli_error(["serve", MODEL, "--port", str(port)], capsys)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; stop the process using it" in err


def test_address_not_on_this_machine_is_one_error_line_before_the_model_loads(no_load, capsys):
    err = cli_error(["serve", MODEL, "--host", "192.0.2.1"], capsys)  # TEST-NET-1: never a local address
    assert "cannot listen on 192.0.2.1:8000: Cannot assign requested address" in err


def test_bench_unknown_name_lists_every_benchmark(capsys):
    err = cli_error(["bench", "nope"], capsys)
    for name in ("attention", "engine", "generate", "int4_gemm", "quality", "serve", "vs-vllm"):
        assert name in err


@pytest.mark.parametrize("argv, module, extra", [
    (["serve", MODEL], "fastapi", "serve"),
    (["serve", MODEL], "uvicorn", "serve"),
    (["eval", "lm_eval", "--model-path", MODEL, "--tasks", "x"], "lm_eval", "eval"),
    (["check"], "pytest", "test"),
])
def test_missing_extra_is_named_with_its_install(argv, module, extra, monkeypatch, capsys):
    """A missing optional dependency (simulated: None in sys.modules hides an installed package from
    find_spec and import) ends in one line naming it and the extra that installs it, before any work."""
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(tritonq, "load", lambda *a, **k: pytest.fail("loaded a model without the extra"))
    err = cli_error(argv, capsys)
    assert f"{module} is not installed; pip install 'tritonq[{extra}]'" in err


def test_serve_help_runs_without_the_serve_extra():
    result = run_python("""
import sys
for name in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
    sys.modules[name] = None  # as if not installed
from tritonq.cli import main
main(["serve", "--help"])
""")
    assert result.returncode == 0 and "--served-model-name" in result.stdout, result.stderr


def test_quantize_choices_match_the_loader():
    from tritonq.config import KV_CACHE_DTYPES, QUANTIZE_ON_LOAD  # what EngineConfig (and so load) accepts
    from tritonq.formats.dense import QUANTIZE_ON_LOAD as LOADER_QUANTIZE
    assert set(QUANTIZE_ON_LOAD) == set(LOADER_QUANTIZE) - {None}
    choices = {a.dest: a.choices for a in cli.generate_parser()._actions}
    assert choices["kv_cache_dtype"] == KV_CACHE_DTYPES and choices["quantize"] == QUANTIZE_ON_LOAD


SAMPLING = ["--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--dtype", "float32"]
SAMPLING_OPTIONS = dict(max_new_tokens=12, temperature=0.8, top_k=20, seed=3)


@pytest.fixture(scope="module")
def default_model():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield tritonq.load(MODEL, dtype="float32")


def test_generate_prints_the_python_api_continuation(default_model, capsys):
    cli.main(["generate", MODEL, "ROMEO:", *SAMPLING])
    out = capsys.readouterr().out
    assert out == default_model.generate("ROMEO:", **SAMPLING_OPTIONS) + "\n"


def test_generate_reads_the_prompt_from_stdin(default_model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("JULIET:\n"))
    cli.main(["generate", MODEL, "-", *SAMPLING])
    assert capsys.readouterr().out == default_model.generate("JULIET:\n", **SAMPLING_OPTIONS) + "\n"


def test_chat_answers_each_stdin_line_with_the_conversation_so_far(default_model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who goes there?\n\nSpeak, man.\n"))
    cli.main(["chat", MODEL, "--system-prompt", "You are Horatio.", *SAMPLING])
    out = capsys.readouterr().out
    messages = [{"role": "system", "content": "You are Horatio."}, {"role": "user", "content": "Who goes there?"}]
    first = default_model.chat(messages, **SAMPLING_OPTIONS)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Speak, man."}]
    second = default_model.chat(messages, **SAMPLING_OPTIONS)
    assert out == f"{first}\n{second}\n"  # the blank line is skipped, not sent as a turn


def test_perplexity_without_context_hints_at_the_training_window(tmp_path, capsys):
    text = tmp_path / "heldout.txt"
    text.write_text(HELDOUT_TEXT.read_text()[:3000])
    cli.main(["eval", "perplexity", MODEL, str(text), "--dtype", "float32"])
    captured = capsys.readouterr()
    trained = json.loads((DEFAULT_MODEL / "training.json").read_text())["seq_len"]
    assert captured.out.startswith("perplexity ") and "windows of 512 tokens" in captured.out
    assert "hint:" in captured.err and f"trained on {trained}-token windows" in captured.err
    cli.main(["eval", "perplexity", MODEL, str(text), "--dtype", "float32", "--context", "128"])
    assert "hint:" not in capsys.readouterr().err


def test_demo_prints_prompt_continuation_and_reply_apart_and_keeps_its_checkpoint(tmp_path, capsys):
    """The demo's output: the prompt, then the continuation under its own heading (never run into the
    prompt), then the chat reply as text (no Python repr), and the checkpoint it wrote, at the path printed."""
    output = tmp_path / "awq"
    prompt = "HAMLET:\nTo be, or not to be"
    cli.main(["demo", "--output", str(output), "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert f"to {output.resolve()}\n" in out
    model = tritonq.load(output)  # the checkpoint is still there and loads
    assert json.loads((output / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    options = dict(max_new_tokens=16, temperature=0.8, top_k=20, seed=0)
    continuation = model.generate(prompt, **options)
    reply = model.chat([{"role": "user", "content": prompt}], **options)
    assert f"\nprompt:\n{prompt}\n\ncontinuation (streamed):\n{continuation}\n\nchat reply" in out
    assert f"through the chat template):\n{reply}\n(" in out
    assert repr(reply) not in out  # text, not a Python repr


def test_chat_keeps_a_long_conversation_inside_the_context(default_model, capsys, monkeypatch):
    """Ten turns on the shipped model (max_seq_len 512) with 100 new tokens each outgrow the context: the CLI
    drops the oldest turns for good (keeping the system prompt), cuts a reply to the room a long line leaves, skips a
    line too long for any reply, and says each once. Reference: the longest suffix of earlier turns that fits,
    found by trying every suffix, and the Python API's reply to it."""
    limit, new = default_model.max_seq_len, 100
    system = [{"role": "system", "content": "You are Horatio."}]

    def line_of(tokens: int) -> str:  # a user line whose prompt alone is about `tokens` tokens
        words = 1
        while len(default_model.chat_prompt(system + [{"role": "user", "content": "O Romeo, " * words}])) < tokens:
            words += 1
        return "O Romeo, " * words
    long_line, too_long = line_of(limit - new // 2), line_of(limit + 1)
    lines = ["Who goes there?", "Speak, man.", "What news?", "Where is the king?", long_line, "Is he well?",
             too_long, "Then go.", "Stay!", "Farewell.", "Good night, sweet prince."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    cli.main(["chat", MODEL, "--system-prompt", "You are Horatio.", "--max-new-tokens", str(new),
              "--dtype", "float32"])
    captured = capsys.readouterr()

    history, replies, dropped, capped = [], [], False, False
    for line in lines:
        user = [{"role": "user", "content": line}]
        keep = next(k for k in range(len(history), -1, -2)  # whole (user, reply) pairs, newest kept
                    if k == 0 or len(default_model.chat_prompt(system + history[len(history) - k:] + user)) + new <= limit)
        prompt = default_model.chat_prompt(system + history[len(history) - keep:] + user)
        if len(prompt) >= limit:
            continue  # no room for a reply: the line is skipped
        dropped |= keep < len(history)
        capped |= limit - len(prompt) < new
        replies.append(default_model.generate(prompt, max_new_tokens=min(new, limit - len(prompt))))
        history = history[len(history) - keep:] + user + [{"role": "assistant", "content": replies[-1]}]
    assert dropped and capped and len(replies) == 10  # the case covers each rule
    assert captured.out == "".join(f"{reply}\n" for reply in replies)
    assert captured.err.count("dropping the oldest turns") == 1 and captured.err.count("replies are cut") == 1
    assert captured.err.count("leaves no room for a reply") == 1


@pytest.mark.parametrize("command", [["generate", MODEL, "Hi"], ["chat", MODEL], ["serve", MODEL, "--port", "1"],
                                     ["eval", "perplexity", MODEL, __file__]])
def test_threads_option_reaches_load(command, monkeypatch):
    given = {}

    class Stop(Exception):
        pass

    def load(*args, **options):
        given.update(options)
        raise Stop
    monkeypatch.setattr(tritonq, "load", load)
    monkeypatch.setattr("tritonq.serve.__main__._listen", lambda *args: None)  # no socket: load is stubbed
    with pytest.raises(Stop):
        cli.main([*command, "--threads", "3"])
    assert given["threads"] == 3


@pytest.mark.parametrize("command, parallel", [(["serve", MODEL, "--port", "1"], True),
                                               (["generate", MODEL, "Hi"], False), (["chat", MODEL], False)])
def test_engine_options_are_engine_config_fields(command, parallel, monkeypatch):
    """The engine options of a command are EngineConfig's fields (the serve-only parallel ones on serve only),
    each with the field's default, and what is given reaches load as one EngineConfig."""
    import dataclasses

    from tritonq.config import EngineConfig
    parser = cli.COMMANDS[command[0]].parser_for("tritonq")
    options = {a.dest: a for _, a in _actions(parser) if a.option_strings}
    fields = [f for f in dataclasses.fields(EngineConfig) if parallel or not f.metadata.get("parallel")]
    assert len(fields) >= 14
    for f in fields:
        assert options[f.name].default == f.default, f.name
    assert {"tensor_parallel", "expert_parallel"} <= set(options) if parallel else not {"tensor_parallel",
                                                                                          "expert_parallel"} & set(options)
    given = {}

    class Stop(Exception):
        pass

    def load(*args, **kwargs):
        given.update(kwargs)
        raise Stop
    monkeypatch.setattr(tritonq, "load", load)
    monkeypatch.setattr("tritonq.serve.__main__._listen", lambda *args: None)
    with pytest.raises(Stop):
        cli.main([*command, "--max-num-seqs", "3", "--block-size", "32", "--no-enable-prefix-caching",
                  "--speculative-config", '{"method": "ngram", "num_tokens": 2}'])
    expected = EngineConfig(max_num_seqs=3, block_size=32, enable_prefix_caching=False,
                            speculative={"method": "ngram", "num_tokens": 2})
    assert given["config"] == expected and not set(given) & {f.name for f in fields}


@pytest.mark.parametrize("argv, expected", [(["--max-num-seqs", "0"], "max_num_seqs=0; expected a positive int"),
                                            (["--block-size", "24"], "block_size=24; expected a power of two")])
def test_bad_engine_option_is_one_error_line(argv, expected, no_load, capsys):
    assert expected in cli_error(["generate", MODEL, "Hi", *argv], capsys)


@pytest.mark.parametrize("command", [["generate", MODEL, "Hi"], ["quantize", MODEL, "dst", "--format", "awq"],
                                     ["demo"]])
def test_threads_below_one_is_one_error_line(command, no_load, capsys):
    assert "argument --threads: 0; expected 1 or more threads" in cli_error([*command, "--threads", "0"], capsys)


def test_load_threads_sets_the_process_threads():
    import torch
    before = torch.get_num_threads()
    try:
        tritonq.load(MODEL, threads=2, dtype="float32")
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="threads=0; expected an int >= 1"):
            tritonq.load("no/such/model", threads=0)  # refused before the checkpoint is looked for
    finally:
        torch.set_num_threads(before)


def test_openmp_waits_passively_unless_told_otherwise():
    """`import tritonq` before torch sets OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep; spinning ones
    starve the working ones on shared cores: docs/cli_behaviour.md); a value already set is kept."""
    code = "import os, tritonq, torch; print(os.environ['OMP_WAIT_POLICY'])"
    assert run_python(code).stdout.strip() == "PASSIVE"
    kept = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**NO_INTERPRETER, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "ACTIVE"})
    assert kept.stdout.strip() == "ACTIVE", kept.stderr
