"""Model: generate / stream / chat on top of the continuous-batching engine (tritonq.engine).

generate() queues every prompt as a request of one Engine (one paged KV cache per Model) and
steps it until they are all done: new requests join the running batch as others finish, so any
number of prompts runs with the memory the cache has. Each request stops on its own at EOS, a
stop string or max_new_tokens; results come back in input order.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from tritonq.config import MAX_TOP_LOGPROBS, GenerationConfig, check_int
from tritonq.engine.engine import CheckedRequest, Engine, Request, top_dicts
from tritonq.engine.multiplexer import Multiplexer
from tritonq.engine.speculative import SpeculativeStats


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

    Tensor parallel (world > 1): every rank must call generate / stream / chat with the same arguments (they
    run in lockstep); only rank 0 gets results (`_on_this_rank`: the one place that says what the others get).

    Many callers: generate / stream / chat / score may be called concurrently on one Model, from several
    threads or as interleaved generators of one thread; each gets exactly its own outputs. They share the
    engine through `multiplexer` (tritonq.engine.multiplexer, which the server's engine thread uses too):
    whoever needs outputs and has none waiting steps the engine once, and every output goes to the inbox (a
    deque) of the caller whose request it is. A closed or abandoned stream releases its unfinished requests.
    A request that fails in the engine (finish_reason "error") raises RuntimeError in its caller.
    """

    def __init__(self, model, tokenizer, engine: Engine, max_seq_len: int, rank: int = 0, world: int = 1):
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len, self.rank, self.world = max_seq_len, rank, world
        self.multiplexer = Multiplexer(engine)

    @property
    def engine(self) -> Engine:
        return self.multiplexer.engine

    @engine.setter
    def engine(self, engine) -> None:  # the server wraps it for tensor parallelism (serve.ranks.LeaderEngine)
        self.multiplexer.engine = engine

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

    def _check(self, prompts: list[list[int]], config: GenerationConfig) -> list[CheckedRequest]:
        """Every request validated (Engine.check_request, once) before any is queued, so a bad one costs no work."""
        return [self.engine.check_request(p, config, name=f"prompt {i}") for i, p in enumerate(prompts)]

    def _config(self, config: GenerationConfig | None, options: dict) -> GenerationConfig:
        """config (default: GenerationConfig()) with options replacing fields; a str / list for stop, a list
        for stop_token_ids and choice are taken too."""
        if "stream" in options:
            raise TypeError("generate() returns whole texts; for pieces as they are generated call "
                            "Model.stream(prompts, ...) (Model.stream_chat(messages, ...) for a chat).")
        stop = options.get("stop")
        if isinstance(stop, (str, list)):
            options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if isinstance(options.get("stop_token_ids"), list):
            options["stop_token_ids"] = tuple(options["stop_token_ids"])
        if isinstance(options.get("choice"), list):
            options["choice"] = tuple(options["choice"])
        return replace(config or GenerationConfig(), **options)

    def _on_this_rank(self, result):
        """What a generate / stream call returns on this rank. Rank 0 (and a single process): result. Other
        tensor-parallel ranks ran the same requests in lockstep and return None from generate; a stream,
        which rank 0 consumes lazily, is run to its end here (collectives pair up step by step) and an empty
        iterator returned."""
        if self.rank == 0:
            return result
        if isinstance(result, Iterator):
            for _ in result:
                pass
            return iter(())
        return None

    def generate(self, prompts, config: GenerationConfig | None = None, *, return_dict: bool = False,
                 progress: bool | None = None, **options):
        """Generate from prompts (str, list of str, token ids or list of token id lists), any number of them.

        options are GenerationConfig fields (max_new_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, stop (a str or a list is taken too), seed, min_tokens, ignore_eos,
        stop_token_ids (a list is taken too), presence_penalty, frequency_penalty, logit_bias (a dict),
        top_logprobs, json_schema, regex, choice (a list is taken too)).
        Returns the texts shaped like the prompts: a str for a single prompt (a str or one token id list), a
        list in input order for a list of them; return_dict=True: a GenerationOutput (per-prompt lists in input
        order) instead. Pieces as they are generated: `stream`.
        progress: a tqdm bar over requests, with the tokens generated per second so far (default: when there
        are more than 8 prompts).
        A request that fails in the engine raises RuntimeError with its error.
        Tensor parallel: None on ranks other than 0 (`_on_this_rank`).
        """
        config = self._config(config, options)
        encoded, single = self._encode(prompts)
        checked = self._check(encoded, config)
        if not encoded:
            return GenerationOutput([], [], [], [], [], 0.0) if return_dict else []
        out = self._run(checked, len(encoded) > 8 if progress is None else progress)
        return self._on_this_rank(out if return_dict else out.text[0] if single else out.text)

    def stream(self, prompts, config: GenerationConfig | None = None, **options) -> Iterator:
        """generate(), as an iterator of text pieces as they become final: str pieces for a single prompt,
        (prompt index, piece) for a list of prompts. options: as generate(). A request that fails in the engine
        raises RuntimeError when its output is reached. Closing the iterator early aborts the unfinished
        requests. Tensor parallel: an empty iterator on ranks other than 0, returned once they have run their
        part (`_on_this_rank`)."""
        config = self._config(config, options)
        encoded, single = self._encode(prompts)
        return self._on_this_rank(self._stream(self._check(encoded, config), single))

    def _requests(self, checked: list[CheckedRequest], stream: bool) -> Iterator:
        """Queue the checked requests and yield (prompt index, RequestOutput) for each output of theirs, in step
        order, stepping the engine when none is waiting; on any exit (an error, Ctrl-C, a stream closed
        early) the unfinished ones are aborted. A request that failed raises RuntimeError."""
        inbox: deque = deque()
        ids = self.multiplexer.add(checked, inbox.append, stream=stream)
        index = {rid: i for i, rid in enumerate(ids)}
        pending = set(ids)
        try:
            while pending:
                if not inbox:  # step, unless another caller's step filled the inbox while this one waited
                    self.multiplexer.step(unless=lambda: bool(inbox))
                    continue
                out = inbox.popleft()
                if out.finished:
                    pending.discard(out.request_id)
                if out.finish_reason == "error":
                    raise RuntimeError(f"prompt {index[out.request_id]} failed in the engine: {out.error}")
                yield index[out.request_id], out
        finally:
            self.multiplexer.release(pending)

    def _run(self, checked: list[CheckedRequest], progress: bool) -> GenerationOutput:
        from tritonq.progress import progress_bar
        start = time.perf_counter()
        finished: dict[int, Request] = {}  # prompt index -> its finished request, its end time and reason
        finish_s: dict[int, float] = {}
        reasons: dict[int, str] = {}
        with progress_bar(total=len(checked), desc="Generating", unit="prompt",
                          enabled=progress and self.rank == 0) as bar:
            generated = 0
            for i, out in self._requests(checked, stream=False):
                if out.finished:
                    request = out.request
                    # generation requests (scoring ones are Engine.score's), finished: their end is set
                    assert isinstance(request, Request) and request.finish_s is not None
                    assert request.finish_reason is not None
                    finished[i], finish_s[i], reasons[i] = request, request.finish_s, request.finish_reason
                    generated += len(request.token_ids)
                    bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tokens/s", refresh=False)
                    bar.update(1)
        requests = [finished[i] for i in range(len(checked))]
        firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
        decoded = sum(max(len(r.token_ids) - 1, 0) for r in requests)
        span = max(finish_s.values()) - min(firsts) if firsts else 0.0
        speculation = SpeculativeStats()
        for r in requests:
            speculation.proposed += r.speculation.proposed
            speculation.accepted += r.speculation.accepted
            speculation.verifications += r.speculation.verifications
        return GenerationOutput(
            acceptance_rate=speculation.acceptance_rate, mean_accepted_length=speculation.mean_accepted_length,
            text=[r.text for r in requests], token_ids=[r.token_ids for r in requests],
            logprobs=[r.logprobs for r in requests], finish_reasons=[reasons[i] for i in range(len(checked))],
            time_to_first_token_s=[(r.first_token_s or start) - start for r in requests],
            decode_tokens_per_s=decoded / span if decoded and span > 0 else 0.0,
            top_logprobs=[r.top_logprobs for r in requests])

    def _stream(self, checked: list[CheckedRequest], single: bool) -> Iterator:
        for i, out in self._requests(checked, stream=True):
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
        prompts split over steps), so many prompts take few steps; other callers' requests go on in those steps,
        and scoring waits for the KV blocks they hold. A prompt may have at most max_seq_len + 1
        tokens (the last one is only a target). progress: tqdm bar over prompts (default: more than 8).
        top_logprobs: 0..20; with return_dict, also the log-probabilities of that many most likely tokens at
        each position (ScoreOutput.top_logprobs).
        """
        check_int("top_logprobs", top_logprobs, 0)
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
        see Engine.score). Holds the engine throughout (Multiplexer.exclusive): Engine.score steps it, other
        callers' requests going on in those steps (their outputs reach them from the next step), so it waits for
        blocks they hold."""
        from tritonq.progress import progress_bar
        with self.multiplexer.exclusive() as engine, progress_bar(total=len(prompts), desc=desc, unit=unit,
                                                                  enabled=progress and self.rank == 0) as bar:
            return engine.score(prompts, on_done=lambda i: bar.update(1), top_logprobs=top_logprobs)

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

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, **options):
        """Generate the assistant reply (a str) to messages [{"role": ..., "content": ...}] via the chat template.

        content is a str or a list of OpenAI content parts; text parts ({"type": "text", "text": ...}) are
        joined with newlines (as vLLM does), any other part type is refused (this model takes text only).
        tools: OpenAI function tools the template renders into the prompt (see chat_prompt).
        options: as generate()."""
        return self.generate(self.chat_prompt(messages, tools=tools), **options)

    def stream_chat(self, messages: list[dict], *, tools: list[dict] | None = None, **options) -> Iterator[str]:
        """chat(), as an iterator of str pieces of the reply as they become final (see stream)."""
        return self.stream(self.chat_prompt(messages, tools=tools), **options)

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        """The prompt token ids of messages under the chat template, ending with the assistant's turn (chat,
        stream_chat and the server's chat route all template through here).

        tools: OpenAI function tools ([{"type": "function", "function": {"name", "parameters", ...}}]) passed
        to the template (Hermes / Qwen style templates list them in a system turn). Raises ValueError starting
        "tools:" when the template does not render them (the model would never see them), and whatever the
        template raises (TypeError / ValueError / jinja errors) for messages it cannot take."""
        messages = [text_message(i, m) for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **({"tools": tools} if tools else {}))
        # A template without a tools block renders them as nothing: refuse rather than silently drop them.
        if tools and text == self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False):
            raise ValueError("tools: this model's chat template does not render tools, so the model would never "
                             "see them; leave tools out (or serve a model whose template takes tools, e.g. "
                             "Hermes / Qwen style)")
        # the template wrote the special tokens (BOS, turn markers) itself: the tokenizer must not add more
        return self.tokenizer(text, add_special_tokens=False).input_ids


def text_message(i: int, message: dict) -> dict:
    """message with its content as one str: a list of OpenAI content parts has its text parts joined with
    newlines (as vLLM does); other part types are refused. Model.chat_prompt uses it."""
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
