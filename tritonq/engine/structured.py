"""Structured outputs: constrain generation to a JSON schema, a regex, a list of choices or an EBNF grammar (xgrammar).

A constraint (GenerationConfig.json_schema / regex / choice / grammar) is compiled once per distinct constraint
into an xgrammar grammar over the model's tokenizer (an LRU cache of GRAMMAR_CACHE_SIZE grammars per
engine); each request holds a GrammarMatcher that advances with every token it samples. Compiles run in a
child process (tritonq.engine.structured_worker) with a time budget, and a constraint xgrammar would compile only in
part (it warns and drops a remote `$ref`, a mid-pattern anchor, a lookahead, ...) is refused, as is one
past the budget: an output never follows a looser constraint than the one asked for. Each step,
every constrained row fills its row of a token bitmask [R, ceil(V / 32)] int32 (bit v of word v // 32:
token v may follow), and the sampler sets the logits of the disallowed tokens to -inf in one tensor op
(`apply_token_bitmask`) before any sampling filter. The grammar's stop tokens are the engine's EOS ids, so
EOS is allowed only where the grammar accepts: a request that ends on EOS has a complete match.

JSON is generated compactly (`any_whitespace=False`: `{"a": 1}` separators, no free whitespace), so a
small model cannot run on in whitespace; properties not in the schema are refused unless the schema
allows them (xgrammar's strict mode). A request can still end at max_new_tokens (finish "length")
before its JSON is complete: give it room.

xgrammar is an optional dependency (`pip install 'tritonq[structured]'`), imported on first use.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path

import torch

GRAMMAR_CACHE_SIZE = 64  # grammars (and refusals) kept per engine (a JSON schema compiles in ~1 ms to 100s of ms)
# A compile's budget. Ordinary schemas and patterns compile in well under a second; a short pattern with nested
# bounded repeats ((x{0,128}y{0,128}){0,128}: 26 bytes) builds an automaton cubic in the bounds and runs for
# seconds to minutes, which no text-size rule predicts, so the compile runs in a child process killed past this.
COMPILE_TIMEOUT_S = 10.0
MAX_CONSTRAINT_CHARS = 128 << 10  # a constraint's text (schema JSON, regex, choices): larger ones are refused
START_TIMEOUT_S = 120.0  # the compiler process's start (a Python with xgrammar imported): not the compile's budget
MISSING_XGRAMMAR = ("structured outputs (json_schema / regex / choice / grammar, response_format, tools) need the xgrammar "
                    "package; install it with: pip install 'tritonq[structured]'")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise ModuleNotFoundError(MISSING_XGRAMMAR) from exc
    return xgrammar


def constraint_of(config) -> tuple[str, str] | None:
    """(kind, text) of a GenerationConfig's constraint: ("json_schema", canonical JSON text), ("regex",
    pattern), ("choice", EBNF grammar of the alternatives) or ("grammar", EBNF); None when it has none. Also
    the cache key."""
    if config.json_schema is not None:
        return "json_schema", config.json_schema
    if config.regex is not None:
        return "regex", config.regex
    if config.choice is not None:
        # EBNF string literals take JSON's escapes (\" \\ \n \uXXXX)
        return "choice", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in config.choice)
    if config.grammar is not None:
        return "grammar", config.grammar
    return None


class GrammarError(ValueError):
    """A constraint that does not compile into a grammar (a ValueError: callers that need not tell it apart
    catch that); the server answers it naming the field that asked for the constraint."""


def _message(error: str) -> str:
    """xgrammar's error text (the worker's str of the exception) without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", error.strip()).strip()


_VALUES = ("enum", "const", "default", "examples")  # schema keys whose values are data, not schemas


def _bounded_strings_as_patterns(schema_text: str) -> str:
    r"""The schema with each string's minLength / maxLength (without a pattern) written as the pattern
    `^[^"\\\x00-\x1f\ud800-\udfff]{min,max}$`. xgrammar 0.2 lowers length-bounded strings to a character
    class that admits raw control characters (U+0000-U+001F), which no JSON parser accepts
    (mlc-ai/xgrammar#800), and UTF-8-encoded surrogates, which decode to several U+FFFD each and so
    break the length. Either way such a string has no escapes (as in xgrammar's lowering)."""
    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        node = {k: v if k in _VALUES else rewrite(v) for k, v in node.items()}
        if (node.get("type") == "string" and "pattern" not in node and "format" not in node
                and ("minLength" in node or "maxLength" in node)):
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = rf'^[^"\\\x00-\x1f\ud800-\udfff]{{{low},{high}}}$'
        return node
    schema = json.loads(schema_text)
    rewritten = rewrite(schema)
    return schema_text if rewritten == schema else json.dumps(rewritten)


class Grammars:
    """Compiles constraints over one tokenizer and vocabulary and makes per-request matchers.

    tokenizer: a Hugging Face tokenizer; vocab_size: the model's (its logits' V, which may exceed the
    tokenizer's: the extra ids are never allowed); stop_token_ids: the ids that end a request (EOS).
    Thread-safe: the server compiles on its handler threads (to refuse a bad schema with a 400 before
    queueing) and the engine thread reads the same cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = GRAMMAR_CACHE_SIZE,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        xgr = _xgrammar()
        self.vocab_size, self.stop_token_ids = vocab_size, sorted(stop_token_ids)
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=self.stop_token_ids)
        self._process = _CompilerProcess(self._info.serialize_json())
        self.compile_timeout_s = compile_timeout_s
        # xgrammar reads special tokens (<s>, <|im_start|>, ...) as their text, so a grammar could take
        # "<s>" inside a JSON string while the detokenizer drops it: they are never allowed (EOS aside).
        self.no_special = token_bitmask(1, vocab_size)[0]
        for t in set(getattr(tokenizer, "all_special_ids", ())) - set(self.stop_token_ids):
            if 0 <= t < vocab_size:
                bit = -2 ** 31 if t % 32 == 31 else 1 << (t % 32)  # bit 31 of an int32 is its sign
                self.no_special[t // 32] &= ~bit
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # a grammar, or the GrammarError
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled so far (cache misses)

    def compile(self, constraint: tuple[str, str]):
        """The compiled grammar of a (kind, text) constraint (from the cache when seen before). Raises
        GrammarError (a ValueError) naming the constraint and the reason when it does not compile, compiles only
        in part, is larger than MAX_CONSTRAINT_CHARS or takes longer than compile_timeout_s (refusals are cached
        too: a slow constraint sent again is refused at once)."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                found = self._cache[constraint]
                if isinstance(found, GrammarError):
                    raise GrammarError(str(found))  # a fresh exception: threads may raise it at once
                return found
        try:
            grammar = self._compile(*constraint)
        except GrammarError as error:
            grammar = error
        with self._lock:
            self.compiles += 1
            self._cache[constraint] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if isinstance(grammar, GrammarError):
            raise grammar
        return grammar

    def _compile(self, kind: str, text: str):
        shown = text if len(text) <= 200 else text[:200] + "..."

        def refuse(why: str) -> GrammarError:
            return GrammarError(f"the {kind} {shown} {why}")
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise refuse(f"is {len(text)} characters long, more than the {MAX_CONSTRAINT_CHARS} a constraint may "
                         "have; send a smaller one")
        try:
            outcome, result, warnings = self._process.compile(
                kind, _bounded_strings_as_patterns(text) if kind == "json_schema" else text, self.compile_timeout_s)
        except TimeoutError:
            raise refuse(f"took longer than {self.compile_timeout_s:g} s to compile into a grammar (nested bounded "
                         "repeats, such as (a{0,100}b{0,100}){0,100}, make automata that explode); "
                         "simplify it") from None
        except EOFError:
            raise refuse("made the grammar compiler crash; simplify it") from None
        if outcome == "error":
            raise refuse(f"cannot be compiled into a grammar: {_message(result)}; fix the {kind}.")
        if warnings:
            raise refuse(f"cannot be compiled exactly: the grammar compiler would drop part of it "
                         f"({'; '.join(warnings)}); rewrite that part (only local $refs '#/...' are resolved; "
                         "a regex may not use anchors other than a leading ^ and a trailing $, lookarounds, "
                         "backreferences or unknown escapes).")
        return _xgrammar().CompiledGrammar.deserialize_json(result, self._info)

    def matcher(self, constraint: tuple[str, str]) -> GrammarState:
        """A fresh matcher (at the start of the output) for one request."""
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(constraint)), self.no_special)


class _CompilerProcess:
    """The compiler child process (`python -m tritonq.engine.structured_worker`: a fresh interpreter, so nothing of the
    caller's script or server runs again in it), one compile at a time, started on first use and again after a
    compile past its budget killed it."""

    def __init__(self, tokenizer_info: str):
        self.tokenizer_info = tokenizer_info
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.finalizer: weakref.finalize | None = None
        self.lock = threading.Lock()

    def compile(self, kind: str, text: str, timeout_s: float) -> tuple[str, str, list[str]]:
        """structured_worker's answer; TimeoutError past timeout_s (the process is killed), EOFError if it died."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            conn = self.conn
            assert conn is not None  # _start connected it
            try:
                conn.send((kind, text))
                if not conn.poll(timeout_s):
                    raise TimeoutError
                return conn.recv()
            except TimeoutError:
                self._stop()
                raise
            except (EOFError, OSError) as error:
                self._stop()
                raise EOFError("the grammar compiler process died") from error

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])  # where this tritonq is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        with theirs:
            worker = [sys.executable, "-m", "tritonq.engine.structured_worker", str(theirs.fileno())]
            self.process = subprocess.Popen(worker, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL)
        self.conn = Connection(ours.detach())
        self.finalizer = weakref.finalize(self, _CompilerProcess._end, self.process, self.conn)  # when garbage
        try:
            self.conn.send(self.tokenizer_info)
            ready = self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop()
            raise RuntimeError(f"the grammar compiler process (python -m tritonq.engine.structured_worker) did not "
                               f"start within {START_TIMEOUT_S:g} s")

    def _stop(self) -> None:
        assert self.finalizer is not None  # set by _start, which every _stop follows
        self.finalizer()  # _end, once
        self.process = self.conn = self.finalizer = None

    @staticmethod
    def _end(process: subprocess.Popen, conn: Connection) -> None:
        conn.close()
        if process.poll() is None:
            process.kill()
        process.wait()


class GrammarState:
    """One request's position in its grammar: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher, no_special: torch.Tensor):
        self.matcher, self.no_special = matcher, no_special

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [R, ceil(V / 32)], on the CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self.no_special

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the state is unchanged)."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask int32 [rows, ceil(vocab_size / 32)] on the CPU (-1: every bit set)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with -inf where bitmask [R, ceil(V / 32)] int32 (same device) has a 0 bit: bit b of
    word w stands for token 32 * w + b. Out of place (the raw logits give the logprobs). One tensor op
    over the batch, on any device: xgrammar's apply_token_bitmask_inplace does the same in place."""
    V = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :V]  # [R, V]
    return logits.masked_fill(~allowed, float("-inf"))
