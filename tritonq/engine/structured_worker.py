"""The child process that compiles structured-output grammars for tritonq.engine.structured (imports only xgrammar):
`python -m tritonq.engine.structured_worker FD`, FD its end of a socket pair with the parent.

Why a process: xgrammar compiles in C++ and cannot be interrupted, and a short pattern whose automaton
explodes (nested bounded repeats) compiles for minutes; the parent kills this process past its time budget.
And xgrammar drops what it cannot express (a remote `$ref`, `^` in the middle of a regex, a lookahead in a
schema pattern) with only a warning on stderr: here stderr belongs to this process alone, so each compile's
warnings are read from it and sent back, and the parent refuses the constraint.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    """Receive the tokenizer (TokenizerInfo JSON) and answer "ready"; then answer each (kind, text) with ("ok",
    the serialized grammar, warnings) or ("error", xgrammar's message, warnings), until the parent closes conn."""
    import xgrammar

    tokenizer_info = conn.recv()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(tokenizer_info), max_threads=1,
                                        cache_enabled=False)  # the parent caches
    conn.send("ready")
    with tempfile.TemporaryFile() as log:
        while True:
            try:
                kind, text = conn.recv()
            except EOFError:
                return
            conn.send(_compile(compiler, kind, text, log))


def _compile(compiler, kind: str, text: str, log) -> tuple[str, str, list[str]]:
    log.seek(0)
    log.truncate()
    stderr = os.dup(2)
    os.dup2(log.fileno(), 2)  # xgrammar's C++ log writes to fd 2
    try:
        if kind == "json_schema":
            outcome = ("ok", compiler.compile_json_schema(text, any_whitespace=False).serialize_json())
        elif kind == "regex":
            outcome = ("ok", compiler.compile_regex(text).serialize_json())
        else:
            outcome = ("ok", compiler.compile_grammar(text).serialize_json())
    except RuntimeError as exc:
        outcome = ("error", str(exc))
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
    log.seek(0)
    lines = log.read().decode("utf-8", errors="replace").splitlines()
    warnings = [line.split("Warning: ", 1)[1].strip() for line in lines if "Warning: " in line]
    return (*outcome, list(dict.fromkeys(warnings)))  # each once (xgrammar repeats some per pass)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which ends this process
    serve(Connection(int(sys.argv[1])))
