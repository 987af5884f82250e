"""Model: generate / stream / chat on top of the continuous-batching engine (tritonq.engine).

generate() queues every prompt as a request of one Engine (one paged KV cache per Model) and
steps it until they are all done: new requests join the running batch as others finish, so any
number of prompts runs with the memory the cache has. Each request stops on its own at EOS, a
stop string or max_new_tokens; results come back in input order.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from tritonq.engine.engine import Engine

@dataclass(frozen=True)
class GenerationConfig:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed makes sampling repeatable."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        checks = [(self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
                  (self.temperature >= 0, "temperature must be >= 0 (0 means greedy)"),
                  (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1.0 disables it)"),
                  (all(isinstance(s, str) and s for s in self.stop),
                   "stop strings must be non-empty str (an empty one would stop before any text)")]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}; got {self}.")


@dataclass(frozen=True)
class GenerationOutput:
    """Per prompt, in input order: generated text, generated token ids (EOS included if hit), the
    log-probability of each generated token under the model (raw logits, before sampling filters),
    why it finished ("eos", "stop" or "length") and its time to first token (seconds since generate
    was called). decode_tokens_per_s: tokens generated after each request's first, over all requests,
    per second of the time from the first first token to the end."""
    text: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    time_to_first_token_s: list[float]
    decode_tokens_per_s: float


@dataclass(frozen=True)
class ScoreOutput:
    """Per prompt, in input order: its token ids (BOS included when the tokenizer added it), each token's
    log-probability given the tokens before it, and whether it is the model's greedy (argmax) choice there.
    Entry 0 of logprobs and greedy is None: the first token has no context to be predicted from."""
    token_ids: list[list[int]]
    logprobs: list[list[float | None]]
    greedy: list[list[bool | None]]


class Model:
    """A loaded model with its tokenizer and its engine (paged KV cache); built by tritonq.load().

    Tensor parallel (world > 1): every rank must call generate / chat with the same arguments (they run
    in lockstep); only rank 0 returns the result, the others return None (stream=True: they run the
    whole generation inside the call and return an empty iterator).
    """

    def __init__(self, model, tokenizer, engine: Engine, max_seq_len: int, rank: int = 0, world: int = 1):
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.max_seq_len, self.rank, self.world = max_seq_len, rank, world

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

    def _check_vocab(self, prompts: list[list[int]]) -> None:
        vocab_size = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (vocab_size={vocab_size}:"
                                 f" ids 0..{vocab_size - 1}); encode prompts with this model's tokenizer.")

    def _check_fits(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Every request is checked before any runs, so a bad one costs no work."""
        self._check_vocab(prompts)
        for i, p in enumerate(prompts):
            try:
                self.engine.check_request(len(p), config.max_new_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

    def generate(self, prompts, config: GenerationConfig | None = None, *, stream: bool = False,
                 return_dict: bool = False, progress: bool | None = None, **options):
        """Generate from prompts (str, list of str, token ids or list of token id lists), any number of them.

        options are GenerationConfig fields (max_new_tokens, temperature, top_k, top_p,
        repetition_penalty, stop, seed). Returns the text (a str for a single prompt, a list in input
        order otherwise) or a GenerationOutput with return_dict=True. stream=True returns an iterator of
        text pieces as they become final: str pieces for a single prompt, (index, piece) for a list.
        progress: a tqdm bar over requests (default: when there are more than 8 prompts).
        Tensor parallel: None on ranks other than 0.
        """
        if "stop" in options:
            options["stop"] = (options["stop"],) if isinstance(options["stop"], str) else tuple(options["stop"])
        config = replace(config or GenerationConfig(), **options)
        encoded, single = self._encode(prompts)
        if stream and return_dict:
            raise ValueError("stream=True yields text pieces; it cannot also return_dict. Use one of them.")
        self._check_fits(encoded, config)
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

    def _requests(self, prompts: list[list[int]], config: GenerationConfig) -> Iterator:
        """Queue the prompts and step the engine until they are done, yielding every RequestOutput of
        theirs; on any exit (an error, Ctrl-C, a stream closed early) the unfinished ones are aborted."""
        ids = [self.engine.add_request(p, config) for p in prompts]
        index = {rid: i for i, rid in enumerate(ids)}
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in index:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield index[out.request_id], out
        finally:
            for rid in pending:
                self.engine.abort(rid)

    def _run(self, prompts: list[list[int]], config: GenerationConfig, progress: bool) -> GenerationOutput:
        from tqdm.auto import tqdm
        start = time.perf_counter()
        requests = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", unit="prompt", disable=not progress or self.rank != 0,
                  leave=False) as bar:
            for i, out in self._requests(prompts, config):
                if out.finished:
                    requests[i] = out.request
                    bar.update(1)
        firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
        decoded = sum(max(len(r.token_ids) - 1, 0) for r in requests)
        span = max(r.finish_s for r in requests) - min(firsts) if firsts else 0.0
        return GenerationOutput(
            text=[r.text for r in requests], token_ids=[r.token_ids for r in requests],
            logprobs=[r.logprobs for r in requests], finish_reasons=[r.finish_reason for r in requests],
            time_to_first_token_s=[(r.first_token_s or start) - start for r in requests],
            decode_tokens_per_s=decoded / span if decoded and span > 0 else 0.0)

    def _stream(self, prompts: list[list[int]], config: GenerationConfig, single: bool) -> Iterator:
        for i, out in self._requests(prompts, config):
            if out.text:
                yield out.text if single else (i, out.text)

    def score(self, prompts, *, add_special_tokens: bool = True, return_dict: bool = False,
              progress: bool | None = None):
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
        """
        encoded, single = self._encode(prompts, add_special_tokens)
        self._check_vocab(encoded)
        scored = self._score_ids(encoded, len(encoded) > 8 if progress is None else progress, "Scoring", "prompt")
        logprobs = [[None] + lp.tolist() for lp, _ in scored]
        if return_dict:
            return ScoreOutput(encoded, logprobs, [[None] + g.tolist() for _, g in scored])
        return logprobs[0] if single else logprobs

    def _score_ids(self, prompts: list[list[int]], progress: bool, desc: str, unit: str) -> list:
        """Engine.score with a tqdm bar: per prompt (logprobs [T-1] float32, greedy [T-1] bool)."""
        from tqdm.auto import tqdm
        with tqdm(total=len(prompts), desc=desc, unit=unit, disable=not progress or self.rank != 0, leave=False) as bar:
            return self.engine.score(prompts, on_done=lambda i: bar.update(1))

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
        """Generate the assistant reply to messages [{"role": ..., "content": ...}] via the chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate(self.tokenizer(text, add_special_tokens=False).input_ids, **options)
