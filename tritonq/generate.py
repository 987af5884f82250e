"""Model: generate / stream / chat on top of the continuous-batching engine (tritonq.engine).

generate() queues every prompt as a request of one Engine (one paged KV cache per Model) and
steps it until they are all done: new requests join the running batch as others finish, so any
number of prompts runs with the memory the cache has. Each request stops on its own at EOS, a
stop string or max_new_tokens; results come back in input order.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from tritonq.engine.engine import Engine
from tritonq.engine.sampler import MAX_TOP_LOGPROBS
from tritonq.engine.speculative import SpeculativeStats

GREEDY_BELOW = 1e-5  # temperatures in (0, GREEDY_BELOW) are taken as 0 (greedy); see GenerationConfig


def _check_int(name: str, value, low: int) -> None:
    # bool is an int subclass: True would silently mean 1, so it is refused like a str or a float
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected an int >= {low}.")
    if value < low:
        raise ValueError(f"{name}={value}; expected an int >= {low}.")


def _check_float(name: str, value, ok, expected: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected a number {expected}.")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}={value}; expected a finite number {expected}.")


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates; every field is checked (types strictly: True is not an int, "3" not a
    number) when the config is made, so a bad value never reaches the engine.

    max_new_tokens: tokens to generate at most (>= 0).
    temperature: >= 0; 0 is greedy (argmax). Values below GREEDY_BELOW (1e-5) are stored as 0.0:
        dividing logits by them overflows float32 to inf, which breaks sampling and the top-k filter.
    top_k: keep the k most likely tokens (0: off). top_p: keep the smallest set of most likely tokens
        whose probability reaches top_p (1.0: off). min_p in [0, 1]: keep tokens whose probability is
        >= min_p x the most likely one's (0.0: off). All three apply after temperature, min_p first (as vLLM).
    repetition_penalty: > 0, CTRL-style on every token seen (prompt and generated); 1.0 is off.
    stop: a tuple of non-empty strings; the text ends before the earliest one that appears.
    seed: an int makes sampling repeatable whatever shares the batch; None draws one.
    min_tokens: EOS and stop strings cannot end the request before this many tokens are generated
        (EOS is masked out of sampling until then); 0 <= min_tokens <= max_new_tokens.
    ignore_eos: EOS does not end the request (it runs to max_new_tokens, a stop string or a stop token).
    stop_token_ids: a tuple of token ids that end the request like EOS (finish reason "stop"; the token
        is kept in token_ids), also masked until min_tokens; not affected by ignore_eos.
    presence_penalty, frequency_penalty in [-2, 2] (OpenAI): each token's logit is lowered by
        frequency_penalty x (times it was generated) + presence_penalty x (1 if it was generated); the
        prompt does not count (as OpenAI and vLLM). 0.0 is off; negative values favour repeats.
    logit_bias: {token id: bias in [-100, 100]} (OpenAI), added to those logits before the penalties,
        temperature and filters (-100 bans a token in practice, 100 all but forces it). Stored as a tuple
        of (token id, bias) pairs sorted by id (a dict or such pairs are accepted).
    top_logprobs: 0..20; also return the log-probabilities of that many most likely tokens at each
        generated position (GenerationOutput.top_logprobs).
    Order in the sampler, as vLLM: min_tokens mask, logit_bias, repetition / frequency / presence
    penalties, the structured-output grammar mask, temperature, min_p, top_k, top_p. Every log-probability
    returned is under the raw logits.
    json_schema / regex / choice (at most one; tritonq.structured, needs `pip install 'tritonq[structured]'`):
        constrain the output to JSON matching a schema (a dict, or its JSON text; stored as compact JSON
        text), to a full match of a regex, or to exactly one of a tuple of non-empty strings. EOS is
        allowed only where the output is complete; min_tokens and ignore_eos cannot be combined with them
        (the grammar decides where the output ends).
    """
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_p: float = 0.0  # the new fields come last: positional construction keeps its meaning
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} > max_new_tokens={self.max_new_tokens}; the request "
                             "would end at max_new_tokens first. Lower min_tokens or raise max_new_tokens.")
        _check_int("top_k", self.top_k, 0)
        _check_float("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 means greedy)")
        _check_float("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1] (1.0 disables it)")
        _check_float("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1] (0.0 disables it)")
        _check_float("repetition_penalty", self.repetition_penalty, lambda p: p > 0, "> 0 (1.0 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed={self.seed!r} ({type(self.seed).__name__}); expected an int or None.")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos={self.ignore_eos!r} ({type(self.ignore_eos).__name__}); expected True "
                            "or False.")
        if not isinstance(self.stop, tuple):
            raise TypeError(f"stop={self.stop!r} ({type(self.stop).__name__}); expected a tuple of str "
                            "(Model.generate also takes a str or a list).")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty str (an empty one would stop before any text); "
                             f"got stop={self.stop!r}.")
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r} ({type(self.stop_token_ids).__name__}); "
                            "expected a tuple of int token ids (Model.generate also takes a list).")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, 0)
        _check_float("presence_penalty", self.presence_penalty, lambda p: -2 <= p <= 2, "in [-2, 2] (0.0 disables it)")
        _check_float("frequency_penalty", self.frequency_penalty, lambda p: -2 <= p <= 2,
                     "in [-2, 2] (0.0 disables it)")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        if not isinstance(bias, (dict, tuple)) or not all(isinstance(e, tuple) and len(e) == 2 for e in pairs):
            raise TypeError(f"logit_bias={bias!r}; expected a dict {{token id: bias}} (or a tuple of "
                            "(token id, bias) pairs).")
        for t, b in pairs:
            _check_int("logit_bias token id", t, 0)
            _check_float(f"logit_bias[{t}]", b, lambda v: -100 <= v <= 100, "in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in dict(pairs).items())))
        _check_int("top_logprobs", self.top_logprobs, 0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs}; expected an int in [0, {MAX_TOP_LOGPROBS}].")
        self._check_constraint()
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


    def _check_constraint(self) -> None:
        schema = self.json_schema
        if schema is not None:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema is not valid JSON ({exc}); pass a dict or its JSON text.") from None
            if not isinstance(schema, dict):
                raise TypeError(f"json_schema={self.json_schema!r:.80} ({type(schema).__name__}); expected a JSON "
                                "schema: a dict (e.g. {'type': 'object'}) or its JSON text.")
            # compact text: hashable, and the grammar cache key. Keys keep their order: properties are
            # generated in the order the schema lists them.
            object.__setattr__(self, "json_schema", json.dumps(schema, separators=(",", ":")))
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise TypeError(f"regex={self.regex!r} ({type(self.regex).__name__}); expected a non-empty str.")
        if self.choice is not None:
            if not isinstance(self.choice, tuple):
                raise TypeError(f"choice={self.choice!r} ({type(self.choice).__name__}); expected a tuple of str "
                                "(Model.generate also takes a list).")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice={self.choice!r}; expected at least one choice, each a non-empty str.")
        given = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are both set; a request takes one constraint: pass one of them.")
        if given and (self.min_tokens or self.ignore_eos):
            name = "min_tokens" if self.min_tokens else "ignore_eos"
            raise ValueError(f"{name} cannot be combined with {given[0]}: the grammar decides where the output "
                             f"ends (EOS is allowed exactly when it is complete); leave {name} out.")


@dataclass(frozen=True)
class GenerationOutput:
    """Per prompt, in input order: generated text, generated token ids (EOS included if hit), the
    log-probability of each generated token under the model (raw logits, before sampling filters),
    why it finished ("eos", "stop" or "length") and its time to first token (seconds since generate
    was called). decode_tokens_per_s: tokens generated after each request's first, over all requests,
    per second of the time from the first first token to the end. top_logprobs: with
    GenerationConfig.top_logprobs = N > 0, per prompt and generated token {token id: log-probability}
    of the N most likely tokens there (raw logits, most likely first); empty lists otherwise. With
    speculative decoding (load's `speculative`), over these requests: acceptance_rate (accepted / proposed
    draft tokens) and mean_accepted_length (tokens emitted per verification, 1 .. k + 1); None without it
    or without any verification."""
    text: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    time_to_first_token_s: list[float]
    decode_tokens_per_s: float
    top_logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None


@dataclass(frozen=True)
class ScoreOutput:
    """Per prompt, in input order: its token ids (BOS included when the tokenizer added it), each token's
    log-probability given the tokens before it, and whether it is the model's greedy (argmax) choice there.
    Entry 0 of logprobs and greedy is None: the first token has no context to be predicted from.
    top_logprobs (score(top_logprobs=N > 0)): per prompt and token, {token id: log-probability} of the N
    most likely tokens at that position (entry 0 None); empty lists otherwise."""
    token_ids: list[list[int]]
    logprobs: list[list[float | None]]
    greedy: list[list[bool | None]]
    top_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)


class Model:
    """A loaded model with its tokenizer and its engine (paged KV cache); built by tritonq.load().

    Tensor parallel (world > 1): every rank must call generate / chat with the same arguments (they run
    in lockstep); only rank 0 returns the result, the others return None (stream=True: they run the
    whole generation inside the call and return an empty iterator).

    Many callers: generate / stream / chat / score may be called concurrently on one Model, from several
    threads or as interleaved generators of one thread; each gets exactly its own outputs. The engine is
    stepped by one caller at a time (under `_lock`): whoever needs outputs and has none waiting takes the
    lock, steps the engine once and routes every output to the inbox of the caller whose request it is
    (request id -> that caller's deque). A closed or abandoned stream aborts its unfinished requests.
    A request that fails in the engine (finish_reason "error") raises RuntimeError in its caller.
    """

    def __init__(self, model, tokenizer, engine: Engine, max_seq_len: int, rank: int = 0, world: int = 1):
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.max_seq_len, self.rank, self.world = max_seq_len, rank, world
        self._lock = threading.Lock()  # held while the engine is called: one step (or score) at a time
        self._routes: dict[int, deque] = {}  # request id -> the inbox (deque of RequestOutput) of its caller
        # Requests of closed callers, aborted by the next lock holder. A generator may be closed by the
        # garbage collector inside a locked section of its own thread, where it must not wait for the lock.
        self._to_abort: deque[int] = deque()

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.engine.eos_token_ids = set(ids)

    def _encode(self, prompts, add_special_tokens: bool = True) -> tuple[list[list[int]], bool]:
        """(token id lists, single?) from a str, list of str, list of ids, list of id lists or a tensor.
        add_special_tokens applies to text (the tokenizer's BOS, if it adds one); token ids are taken as given."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str):
            return [self.tokenizer(prompts, add_special_tokens=add_special_tokens).input_ids], True
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str, token ids or a list of token id lists; "
                            f"got {type(prompts).__name__}.")
        if prompts and all(isinstance(p, int) for p in prompts):
            return [list(prompts)], True
        if all(isinstance(p, str) for p in prompts):
            return [self.tokenizer(p, add_special_tokens=add_special_tokens).input_ids for p in prompts], False
        if all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
            return [list(p) for p in prompts], False
        raise TypeError("prompts must be a str, a list of str, token ids or a list of token id lists; "
                        "got a list mixing these.")

    def _check(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Every request is checked (Engine.check_request) before any is queued, so a bad one costs no work."""
        for i, p in enumerate(prompts):
            self.engine.check_request(p, config, name=f"prompt {i}")

    def generate(self, prompts, config: GenerationConfig | None = None, *, stream: bool = False,
                 return_dict: bool = False, progress: bool | None = None, **options):
        """Generate from prompts (str, list of str, token ids or list of token id lists), any number of them.

        options are GenerationConfig fields (max_new_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, stop (a str or a list is taken too), seed, min_tokens, ignore_eos,
        stop_token_ids (a list is taken too), presence_penalty, frequency_penalty, logit_bias (a dict),
        top_logprobs, json_schema, regex, choice (a list is taken too)). Returns
        the text (a str for a single prompt, a list in input order otherwise) or a GenerationOutput with return_dict=True. stream=True returns an iterator of
        text pieces as they become final: str pieces for a single prompt, (index, piece) for a list.
        progress: a tqdm bar over requests (default: when there are more than 8 prompts).
        A request that fails in the engine raises RuntimeError with its error (a stream: when reached).
        Tensor parallel: None on ranks other than 0.
        """
        stop = options.get("stop")
        if isinstance(stop, (str, list)):
            options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if isinstance(options.get("stop_token_ids"), list):
            options["stop_token_ids"] = tuple(options["stop_token_ids"])
        if isinstance(options.get("choice"), list):
            options["choice"] = tuple(options["choice"])
        config = replace(config or GenerationConfig(), **options)
        encoded, single = self._encode(prompts)
        if stream and return_dict:
            raise ValueError("stream=True yields text pieces; it cannot also return_dict. Use one of them.")
        self._check(encoded, config)
        if stream:
            pieces = self._stream(encoded, config, single)
            if self.rank != 0:  # keep step with rank 0, which streams lazily: collectives pair up step by step
                for _ in pieces:
                    pass
                return iter(())
            return pieces
        if not encoded:
            return GenerationOutput([], [], [], [], [], 0.0) if return_dict else []
        out = self._run(encoded, config, len(encoded) > 8 if progress is None else progress)
        if self.rank != 0:
            return None
        if return_dict:
            return out
        return out.text[0] if single else out.text

    def _requests(self, prompts: list[list[int]], config: GenerationConfig, stream: bool) -> Iterator:
        """Queue the prompts and yield (prompt index, RequestOutput) for each output of theirs, in step
        order, stepping the engine when none is waiting; on any exit (an error, Ctrl-C, a stream closed
        early) the unfinished ones are aborted. A request that failed raises RuntimeError."""
        inbox: deque = deque()
        with self._lock:
            self._apply_aborts()
            ids = []
            try:
                for p in prompts:
                    ids.append(self.engine.add_request(p, config, stream=stream))
                    self._routes[ids[-1]] = inbox
            except BaseException:
                for rid in ids:
                    self._routes.pop(rid, None)
                    self.engine.abort(rid)
                raise
        index = {rid: i for i, rid in enumerate(ids)}
        pending = set(ids)
        try:
            while pending:
                if not inbox:
                    self._step(inbox)
                    continue
                out = inbox.popleft()
                if out.finished:
                    pending.discard(out.request_id)
                    self._routes.pop(out.request_id, None)
                if out.finish_reason == "error":
                    raise RuntimeError(f"prompt {index[out.request_id]} failed in the engine: {out.error}")
                yield index[out.request_id], out
        finally:
            self._release(pending)

    def _step(self, inbox: deque) -> None:
        """Step the engine once and route its outputs to their callers' inboxes, unless another caller's
        step filled `inbox` while this one waited for the lock."""
        with self._lock:
            if inbox:
                return
            self._apply_aborts()
            for out in self.engine.step():
                route = self._routes.get(out.request_id)
                if route is not None:  # None: its caller is gone (aborted) or it was added to the engine directly
                    route.append(out)

    def _release(self, request_ids) -> None:
        """A caller is done with these (unfinished) requests: drop their routes and abort them, now when
        the lock is free, else by the next lock holder (never wait here: see _to_abort)."""
        for rid in request_ids:
            self._routes.pop(rid, None)
            self._to_abort.append(rid)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self._lock.release()

    def _apply_aborts(self) -> None:
        """Abort the requests of closed callers; call with the lock held."""
        while self._to_abort:
            self.engine.abort(self._to_abort.popleft())

    def _run(self, prompts: list[list[int]], config: GenerationConfig, progress: bool) -> GenerationOutput:
        from tritonq.progress import progress_bar
        start = time.perf_counter()
        requests = [None] * len(prompts)
        with progress_bar(total=len(prompts), desc="Generating", unit="prompt",
                          enabled=progress and self.rank == 0) as bar:
            for i, out in self._requests(prompts, config, stream=False):
                if out.finished:
                    requests[i] = out.request
                    bar.update(1)
        firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
        decoded = sum(max(len(r.token_ids) - 1, 0) for r in requests)
        span = max(r.finish_s for r in requests) - min(firsts) if firsts else 0.0
        speculation = SpeculativeStats()
        for r in requests:
            speculation.proposed += r.speculation.proposed
            speculation.accepted += r.speculation.accepted
            speculation.verifications += r.speculation.verifications
        return GenerationOutput(
            acceptance_rate=speculation.acceptance_rate, mean_accepted_length=speculation.mean_accepted_length,
            text=[r.text for r in requests], token_ids=[r.token_ids for r in requests],
            logprobs=[r.logprobs for r in requests], finish_reasons=[r.finish_reason for r in requests],
            time_to_first_token_s=[(r.first_token_s or start) - start for r in requests],
            decode_tokens_per_s=decoded / span if decoded and span > 0 else 0.0,
            top_logprobs=[r.top_logprobs for r in requests])

    def _stream(self, prompts: list[list[int]], config: GenerationConfig, single: bool) -> Iterator:
        for i, out in self._requests(prompts, config, stream=True):
            if out.text:
                yield out.text if single else (i, out.text)

    def score(self, prompts, *, add_special_tokens: bool = True, return_dict: bool = False,
              progress: bool | None = None, top_logprobs: int = 0):
        """Log-probability of every given token under the model, given the tokens before it (prompt logprobs).

        prompts: a str, list of str, token ids or list of token id lists. Text is encoded like generate()
        does: with the tokenizer's special tokens (its BOS, if it adds one) unless add_special_tokens=False.
        Returns per prompt, in input order, a list aligned with its tokens: entry 0 is None (the first token
        has no context to be predicted from), entry t is log p(token t | tokens < t) from the raw logits
        (float32 log_softmax). A single prompt gives one list, a list of prompts a list of them;
        return_dict=True gives a ScoreOutput (token ids, logprobs, greedy flags) instead.
        Prompts run together through the engine's prefill (steps of max_num_batched_tokens tokens, longer
        prompts split over steps), so many prompts take few steps. A prompt may have at most max_seq_len + 1
        tokens (the last one is only a target). progress: tqdm bar over prompts (default: more than 8).
        top_logprobs: 0..20; with return_dict, also the log-probabilities of that many most likely tokens at
        each position (ScoreOutput.top_logprobs).
        """
        _check_int("top_logprobs", top_logprobs, 0)
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={top_logprobs}; expected an int in [0, {MAX_TOP_LOGPROBS}].")
        if top_logprobs and not return_dict:
            raise ValueError("top_logprobs is returned in ScoreOutput.top_logprobs: pass return_dict=True too.")
        encoded, single = self._encode(prompts, add_special_tokens)
        scored = self._score_ids(encoded, len(encoded) > 8 if progress is None else progress, "Scoring", "prompt",
                                 top_logprobs)
        logprobs = [[None] + lp.tolist() for lp, _, _ in scored]
        if return_dict:
            tops = [[None] + top_dicts(top) if top is not None else [] for _, _, top in scored]
            return ScoreOutput(encoded, logprobs, [[None] + g.tolist() for _, g, _ in scored], tops)
        return logprobs[0] if single else logprobs

    def _score_ids(self, prompts: list[list[int]], progress: bool, desc: str, unit: str,
                   top_logprobs: int = 0) -> list:
        """Engine.score with a progress bar: per prompt (logprobs [T-1] float32, greedy [T-1] bool, top or None;
        see Engine.score). Holds the lock throughout (score runs its own prefills between steps, on free
        blocks only)."""
        from tritonq.progress import progress_bar
        with self._lock, progress_bar(total=len(prompts), desc=desc, unit=unit,
                                      enabled=progress and self.rank == 0) as bar:
            self._apply_aborts()
            return self.engine.score(prompts, on_done=lambda i: bar.update(1), top_logprobs=top_logprobs)

    def perplexity(self, texts, *, context: int | None = None, stride: int | None = None,
                   add_special_tokens: bool = True, return_dict: bool = False, progress: bool | None = None):
        """Perplexity of texts by the sliding-window method of the transformers perplexity guide.

        Each text (str, or token ids) is encoded whole (with BOS when the tokenizer adds one, as score()).
        Windows of `context` tokens (default: max_seq_len) start every `stride` tokens (default: context // 2);
        each window scores only the tokens the previous one did not reach, with the rest of the window as
        their context; a text's first token is never scored. ppl = exp(mean negative log-likelihood over
        every scored token of every text). All windows run batched through score(); progress: a tqdm bar
        over windows (default: more than 8). Returns a float, or a PerplexityOutput with return_dict=True.
        """
        from tritonq.eval.perplexity import perplexity
        return perplexity(self, texts, context=context, stride=stride, add_special_tokens=add_special_tokens,
                          return_dict=return_dict, progress=progress)

    def chat(self, messages: list[dict], **options):
        """Generate the assistant reply to messages [{"role": ..., "content": ...}] via the chat template.

        content is a str or a list of OpenAI content parts; text parts ({"type": "text", "text": ...}) are
        joined with newlines (as vLLM does), any other part type is refused (this model takes text only).
        options: as generate()."""
        text = self.tokenizer.apply_chat_template([text_message(i, m) for i, m in enumerate(messages)],
                                                  add_generation_prompt=True, tokenize=False)
        return self.generate(self.tokenizer(text, add_special_tokens=False).input_ids, **options)


def top_dicts(top: tuple[torch.Tensor, torch.Tensor]) -> list[dict[int, float]]:
    """Engine.score's (ids [T-1, N], logprobs [T-1, N]) as one {token id: log-probability} per position."""
    ids, values = top
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def text_message(i: int, message: dict) -> dict:
    """message with its content as one str: a list of OpenAI content parts has its text parts joined with
    newlines (as vLLM does); other part types are refused. Model.chat and the server's chat route both use it."""
    if not isinstance(message, dict):
        raise TypeError(f"message {i} is a {type(message).__name__}; expected a dict with 'role' and 'content'.")
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"message {i} content part {j} has type {kind!r}; only 'text' parts are supported "
                             "(this model takes text only): send the text, or drop the other parts.")
        if not isinstance(part.get("text"), str):
            raise TypeError(f"message {i} content part {j} is a text part whose 'text' is "
                            f"{type(part.get('text')).__name__}; expected a str.")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
