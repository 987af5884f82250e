"""Structured outputs: constrain generation to a JSON schema, a regex, a list of choices or an EBNF grammar (xgrammar).

A constraint (GenerationConfig.json_schema / regex / choice / grammar) is compiled once per distinct constraint
into an xgrammar grammar over the model's tokenizer (an LRU cache of GRAMMAR_CACHE_SIZE grammars per
engine); each request holds a GrammarMatcher that advances with every token it samples. Each step,
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
import re
import threading
from collections import OrderedDict

import torch

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine (a JSON schema compiles in ~1 ms to 100s of ms)
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


def _message(exc: Exception) -> str:
    """xgrammar's error text without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()).strip()


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

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = GRAMMAR_CACHE_SIZE):
        xgr = _xgrammar()
        self.vocab_size, self.stop_token_ids = vocab_size, sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here (LRU)
        # xgrammar reads special tokens (<s>, <|im_start|>, ...) as their text, so a grammar could take
        # "<s>" inside a JSON string while the detokenizer drops it: they are never allowed (EOS aside).
        self.no_special = token_bitmask(1, vocab_size)[0]
        for t in set(getattr(tokenizer, "all_special_ids", ())) - set(self.stop_token_ids):
            if 0 <= t < vocab_size:
                bit = -2 ** 31 if t % 32 == 31 else 1 << (t % 32)  # bit 31 of an int32 is its sign
                self.no_special[t // 32] &= ~bit
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled so far (cache misses)

    def compile(self, constraint: tuple[str, str]):
        """The compiled grammar of a (kind, text) constraint (from the cache when seen before). Raises
        GrammarError (a ValueError) naming the constraint and xgrammar's reason when it does not compile."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        kind, text = constraint
        try:
            if kind == "json_schema":
                grammar = self._compiler.compile_json_schema(_bounded_strings_as_patterns(text), any_whitespace=False)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(text)
            else:
                grammar = self._compiler.compile_grammar(text)
        except RuntimeError as exc:
            shown = text if len(text) <= 200 else text[:200] + "..."
            raise GrammarError(f"the {kind} {shown} cannot be compiled into a grammar: {_message(exc)}; "
                               f"fix the {kind}.") from None
        with self._lock:
            self.compiles += 1
            self._cache[constraint] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, constraint: tuple[str, str]) -> GrammarState:
        """A fresh matcher (at the start of the output) for one request."""
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(constraint)), self.no_special)


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
