"""Generation: static KV cache, batched prefill + decode loop, sampling, streaming.

The cache [max_batch, max_seq_len, Hkv, D] per layer is allocated once when the Model is built
and never grown; a request that does not fit raises a ValueError saying what to change.
Batched prompts are right-padded and carry per-sequence lengths (see models/llama.py): each
sequence decodes at its own position, so no pad token is ever attended and positions need no
left-padding offsets. Each sequence stops on its own at EOS, a stop string or max_new_tokens.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from tritonq.detokenize import Detokenizer
from tritonq.distributed import broadcast_from_rank0


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
    """Per prompt: generated text, generated token ids (EOS included if hit), and the log-probability
    of each generated token under the model (raw logits, before sampling filters). Timing covers
    the whole batch: prefill seconds and decode tokens per second (all sequences, after the first token)."""
    text: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    prefill_s: float
    decode_tokens_per_s: float


def sample(logits: torch.Tensor, seen: torch.Tensor, config: GenerationConfig,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] int64 from logits [B, V] float32; seen [B, V] bool marks prompt + generated tokens."""
    if config.repetition_penalty != 1.0:  # CTRL-style penalty, as transformers applies it
        penalized = torch.where(logits > 0, logits / config.repetition_penalty, logits * config.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if config.temperature == 0:
        return logits.argmax(-1)
    logits = logits / config.temperature
    if config.top_k:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= config.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def generate_tokens(model, cache, prompts: list[list[int]], config: GenerationConfig, eos_ids: set[int],
                    is_stopped=None, world: int = 1) -> Iterator[list[tuple[int, float] | None]]:
    """Yields one list per step: (token, logprob) for each sequence still running, None for finished ones.

    is_stopped(b, generated_ids) -> bool is asked after each token, EOS included (stop strings; it also
    lets the caller detokenize as it goes); EOS ends a sequence too.
    world > 1 (tensor parallel): every rank runs this loop; rank 0's sampled tokens are broadcast, so all
    ranks feed the same tokens and stop at the same step even if sampling differed.
    """
    if config.max_new_tokens == 0:
        return
    B, longest = len(prompts), max(len(p) for p in prompts)
    device = model.device
    ids = torch.zeros(B, longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    ids = ids.to(device)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=device)
    seen.scatter_(1, ids, True)
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    running = [True] * B
    generated: list[list[int]] = [[] for _ in range(B)]
    logits = model(ids, lens, cache, torch.zeros(B, dtype=torch.int32, device=device), last_only=True)
    for step_index in range(config.max_new_tokens):
        logits = logits.float()
        tokens = sample(logits, seen, config, generator)
        if world > 1:
            tokens = broadcast_from_rank0(tokens)
        logprobs = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        seen.scatter_(1, tokens[:, None], True)
        step = []
        for b, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            if not running[b]:
                step.append(None)
                continue
            generated[b].append(token)
            step.append((token, logprob))
            stopped = is_stopped is not None and is_stopped(b, generated[b])
            if stopped or token in eos_ids:
                running[b] = False
        yield step
        if not any(running) or step_index == config.max_new_tokens - 1:
            return
        logits = model(tokens[:, None], torch.ones(B, dtype=torch.int32, device=device), cache, lens, last_only=True)
        lens = lens + 1


class Model:
    """A loaded model with its tokenizer and its static KV cache; built by tritonq.load().

    Tensor parallel (world > 1): every rank must call generate / chat with the same arguments (they run
    in lockstep); only rank 0 returns the result, the others return None (stream=True: they run the
    whole generation inside the call and return an empty iterator).
    """

    def __init__(self, model, tokenizer, max_batch: int, max_seq_len: int, eos_token_ids: set[int],
                 rank: int = 0, world: int = 1):
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, set(eos_token_ids)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.rank, self.world = rank, world
        self.cache = model.new_cache(max_batch, max_seq_len)

    def _encode(self, prompts) -> tuple[list[list[int]], bool]:
        """(token id lists, single?) from a str, list of str, list of ids, list of id lists or a tensor."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str):
            return [self.tokenizer(prompts).input_ids], True
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str, token ids or a list of token id lists; "
                            f"got {type(prompts).__name__}.")
        if prompts and all(isinstance(p, int) for p in prompts):
            return [list(prompts)], True
        if all(isinstance(p, str) for p in prompts):
            return [self.tokenizer(p).input_ids for p in prompts], False
        if all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
            return [list(p) for p in prompts], False
        raise TypeError("prompts must be a str, a list of str, token ids or a list of token id lists; "
                        "got a list mixing these.")

    def _check_fits(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts exceed max_batch={self.max_batch}; pass fewer prompts or "
                             "load with a larger max_batch.")
        vocab_size = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} has no tokens; give at least one token.")
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (vocab_size={vocab_size}:"
                                 f" ids 0..{vocab_size - 1}); encode prompts with this model's tokenizer.")
            if len(p) + config.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens + max_new_tokens={config.max_new_tokens} > "
                                 f"max_seq_len={self.max_seq_len} (the KV cache length); shorten the prompt, lower "
                                 "max_new_tokens or load with a larger max_seq_len.")

    def generate(self, prompts, config: GenerationConfig | None = None, *, stream: bool = False,
                 return_dict: bool = False, **options):
        """Generate from prompts (str, list of str, token ids or list of token id lists).

        options are GenerationConfig fields (max_new_tokens, temperature, top_k, top_p,
        repetition_penalty, stop, seed). Returns the text (a str for a single prompt, a list for a
        batch), a GenerationOutput with return_dict=True, or with stream=True an iterator of text
        pieces (single prompt only) as they are decoded. Tensor parallel: None on ranks other than 0.
        """
        if "stop" in options:
            options["stop"] = (options["stop"],) if isinstance(options["stop"], str) else tuple(options["stop"])
        config = replace(config or GenerationConfig(), **options)
        encoded, single = self._encode(prompts)
        if stream:
            if return_dict:
                raise ValueError("stream=True yields text pieces; it cannot also return_dict. Use one of them.")
            if len(encoded) != 1:
                raise ValueError(f"stream=True takes a single prompt; got {len(encoded)}.")
            self._check_fits(encoded, config)
            if self.rank != 0:  # keep step with rank 0, which streams lazily: collectives pair up step by step
                for _ in self._stream(encoded[0], config):
                    pass
                return iter(())
            return self._stream(encoded[0], config)
        if not encoded:
            return GenerationOutput([], [], [], 0.0, 0.0) if return_dict else []
        self._check_fits(encoded, config)
        out = self._run(encoded, config)
        if self.rank != 0:
            return None
        if return_dict:
            return out
        return out.text[0] if single else out.text

    def _run(self, prompts: list[list[int]], config: GenerationConfig) -> GenerationOutput:
        token_ids = [[] for _ in prompts]
        logprobs = [[] for _ in prompts]
        start = time.perf_counter()
        prefill_s, steps = 0.0, 0
        detokenizers = [Detokenizer(self.tokenizer, config.stop) for _ in prompts]

        def is_stopped(b: int, ids: list[int]) -> bool:
            detokenizers[b].add(ids[-1])
            return detokenizers[b].stopped

        for step in generate_tokens(self.model, self.cache, prompts, config, self.eos_token_ids,
                                    is_stopped, self.world):
            if steps == 0:
                prefill_s = time.perf_counter() - start
            steps += 1
            for b, item in enumerate(step):
                if item is not None:
                    token_ids[b].append(item[0])
                    logprobs[b].append(item[1])
        decode_s = time.perf_counter() - start - prefill_s
        decoded = sum(len(t) for t in token_ids) - sum(1 for t in token_ids if t)
        for d in detokenizers:
            d.flush()
        return GenerationOutput(text=[d.text for d in detokenizers], token_ids=token_ids,
                                logprobs=logprobs, prefill_s=prefill_s,
                                decode_tokens_per_s=decoded / decode_s if decoded else 0.0)

    def _stream(self, prompt: list[int], config: GenerationConfig) -> Iterator[str]:
        detokenizer, pieces = Detokenizer(self.tokenizer, config.stop), []

        def is_stopped(b: int, ids: list[int]) -> bool:
            pieces.append(detokenizer.add(ids[-1]))
            return detokenizer.stopped

        for _ in generate_tokens(self.model, self.cache, [prompt], config, self.eos_token_ids, is_stopped,
                                 self.world):
            if pieces[-1]:
                yield pieces[-1]
        if tail := detokenizer.flush():
            yield tail

    def chat(self, messages: list[dict], **options):
        """Generate the assistant reply to messages [{"role": ..., "content": ...}] via the chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate(self.tokenizer(text, add_special_tokens=False).input_ids, **options)
