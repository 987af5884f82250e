"""The engine: requests in, one step at a time, tokens and text out.

    engine = Engine(model, tokenizer, eos_token_ids, num_blocks=..., block_size=16, ...)
    rid = engine.add_request(prompt_ids, GenerationConfig(max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():     # one RequestOutput per request that advanced this step
            ...                       # out.token_id, out.text (new final text), out.finished

Each step the scheduler picks the sequences (prefill-first, chunked, preempting when blocks run
out), the runner computes them over the paged KV cache and samples each one's next token, and
the engine finishes a request on EOS, a stop string or max_new_tokens, freeing its blocks.
Tensor parallel: every rank holds an Engine and calls it with the same requests in the same
order; the schedule is deterministic and the sampled tokens come from rank 0.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tritonq.detokenize import Detokenizer
from tritonq.engine.block_manager import BlockManager
from tritonq.engine.runner import ModelRunner, SamplingParams
from tritonq.engine.scheduler import Scheduler
from tritonq.engine.sequence import Sequence


@dataclass
class Request:
    """The engine's state of one request (kept in its Sequence's `extra`)."""
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "eos", "stop", "length", "abort"

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_s or self.arrival_s) - self.arrival_s

    @property
    def text(self) -> str:
        return self.detokenizer.text


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for one request: the token it sampled (None when it finished without one:
    max_new_tokens=0), its log-probability, the text that became final, whether it is done."""
    request_id: int
    token_id: int | None
    logprob: float | None
    text: str
    finished: bool
    finish_reason: str | None
    request: Request


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(self, model, tokenizer, eos_token_ids: set[int], *, num_blocks: int, block_size: int = 16,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 max_seq_len: int | None = None, world: int = 1):
        self.tokenizer, self.eos_token_ids = tokenizer, set(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, block_size, world, max_seq_len)
        self.requests: dict[int, Request] = {}  # unfinished requests
        self._done: list[RequestOutput] = []  # finished without a step (max_new_tokens=0): reported next
        self._ids = itertools.count()

    def check_request(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """ValueError, naming the numbers, if a request could never run; see add_request."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt has no tokens; give at least one token.")
        total = num_prompt_tokens + max_new_tokens
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens + max_new_tokens={max_new_tokens} = "
                             f"{total} > max_seq_len={self.max_seq_len}; shorten the prompt, lower max_new_tokens "
                             "or load with a larger max_seq_len.")
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens + max_new_tokens={max_new_tokens} = "
                             f"{total} tokens, which need {bm.blocks_needed(total)} KV blocks of {bm.block_size}, "
                             f"but the cache has {bm.num_blocks} ({bm.num_blocks * bm.block_size} tokens); shorten "
                             "the request or give the KV cache more memory (kv_cache_gb / gpu_memory_utilization).")

    def add_request(self, prompt_ids: list[int], config) -> int:
        """Queue a request (config: a GenerationConfig); returns its id. It waits until blocks are free.
        Raises ValueError before queueing if it can never fit (max_seq_len, or more blocks than exist)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(len(prompt_ids), config.max_new_tokens)
        rid = next(self._ids)
        request = Request(rid, prompt_ids, SamplingParams(config), Detokenizer(self.tokenizer, config.stop),
                          arrival_s=time.perf_counter())
        if config.max_new_tokens == 0:
            self._finish(request, "length")
            return rid
        self.scheduler.add(Sequence(rid, prompt_ids, config.max_new_tokens, extra=request))
        self.requests[rid] = request
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is; its blocks are freed. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            request.finish_s, request.finish_reason = time.perf_counter(), "abort"  # the caller knows: no output

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._done)

    def step(self) -> list[RequestOutput]:
        """Run one model step; outputs for the requests that sampled a token or finished."""
        outputs, self._done = self._done, []
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        samples = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(step.seqs, step.num_new_tokens)]
        ctx = self.runner.prepare(step.seqs, step.num_new_tokens, step.is_prefill, logits_for=samples)
        logits = self.runner.run(ctx)
        sampling = [seq for seq, s in zip(step.seqs, samples) if s]
        tokens, logprobs = self.runner.sample(logits, [seq.extra.sampling for seq in sampling],
                                              [seq.token_ids for seq in sampling])
        sampled = iter(zip(tokens, logprobs))
        picks = [next(sampled) if s else None for s in samples]
        self.scheduler.postprocess(step, [p[0] if p else None for p in picks])
        now = time.perf_counter()
        for seq, pick in zip(step.seqs, picks):
            if pick is None:
                continue
            request, (token, logprob) = seq.extra, pick
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            request.first_token_s = request.first_token_s or now
            text = request.detokenizer.add(token)
            reason = ("eos" if token in self.eos_token_ids else "stop" if request.detokenizer.stopped
                      else "length" if seq.is_finished else None)
            if reason is not None:
                self.scheduler.finish(seq)  # no-op when postprocess already finished it (length)
                del self.requests[request.request_id]
                text += request.detokenizer.flush()
                request.finish_s, request.finish_reason = now, reason
            outputs.append(RequestOutput(request.request_id, token, logprob, text, reason is not None, reason, request))
        return outputs

    def _finish(self, request: Request, reason: str) -> None:
        """A request that ends without a step (max_new_tokens=0): reported by the next step()."""
        request.finish_s, request.finish_reason = time.perf_counter(), reason
        self._done.append(RequestOutput(request.request_id, None, None, "", True, reason, request))

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] float32 at every position of token_ids, in one prefill over the paged cache (no
        sampling, nothing kept: for scoring and tests). Needs the blocks for T tokens free now; blocks
        already prefix-cached are read, not written."""
        seq = Sequence(-1, list(token_ids), 1)
        self.check_request(seq.num_tokens, 0)
        bm = self.block_manager
        if not bm.can_allocate(seq):
            raise RuntimeError(f"prompt_logits: {len(token_ids)} tokens need {bm.blocks_needed(len(token_ids))} "
                               f"free KV blocks; {bm.num_free_blocks} are free while other requests run.")
        bm.allocate(seq)
        try:
            ctx = self.runner.prepare([seq], [seq.num_tokens], True, start=[0])
            return self.runner.run(ctx)
        finally:
            bm.free(seq)

    def score(self, prompts: list[list[int]], on_done=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per prompt (T >= 1 token ids): (logprobs [T-1] float32, greedy [T-1] bool) on CPU, in input order.

        logprobs[i] = log p(token i+1 | tokens 0..i) under the raw logits; greedy[i] says whether token i+1
        is the argmax there. The model runs over tokens 0..T-2 only (the last one is a target, never an
        input), as prefills over the paged cache with logits for every row: prompts are packed into steps of
        at most max_num_batched_tokens tokens and max_num_seqs sequences, a longer one split over steps
        (chunked prefill), so many prompts cost few steps. Blocks come from the same cache as generation
        (free ones only) and prefix-cache hits are read, not recomputed into the cache. on_done(i) is
        called as prompt i finishes (progress bars). Not concurrent with step(): call it between steps.
        """
        bm, sched = self.block_manager, self.scheduler
        for i, p in enumerate(prompts):  # every prompt checked before any runs
            if len(p) == 0:
                raise ValueError(f"prompt {i} has no tokens; give at least one token.")
            if len(p) > 1:
                try:
                    self.check_request(len(p) - 1, 0)
                except ValueError as e:
                    raise ValueError(f"prompt {i} (scored: its first {len(p) - 1} tokens run): {e}") from None
        results: list = [None] * len(prompts)
        empty = torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.bool)
        waiting = deque()
        for i, p in enumerate(prompts):
            if len(p) == 1:  # nothing to predict: no context for the only token
                results[i] = empty
                if on_done:
                    on_done(i)
            else:
                waiting.append(i)
        # Full-row logits cost rows * vocab * 4 bytes (twice, with log_softmax): cap a step at ~512 MiB of them.
        vocab = self.runner.model.config.vocab_size
        budget = max(1, min(sched.max_num_batched_tokens, (512 << 20) // (8 * vocab)))
        running: list[tuple[int, Sequence, int]] = []  # (prompt index, sequence of its inputs, next position)
        parts: dict[int, list] = {}
        try:
            while waiting or running:
                pending = sum(seq.num_tokens - pos for _, seq, pos in running)
                while waiting and len(running) < sched.max_num_seqs and pending < budget:
                    i = waiting[0]
                    seq = Sequence(-1 - i, [int(t) for t in prompts[i][:-1]], 1)
                    if not bm.can_allocate(seq):
                        break
                    waiting.popleft()
                    bm.allocate(seq)
                    running.append((i, seq, 0))
                    pending += seq.num_tokens
                if not running:
                    need = bm.blocks_needed(len(prompts[waiting[0]]) - 1)
                    raise RuntimeError(f"score: prompt {waiting[0]} needs {need} free KV blocks; {bm.num_free_blocks} "
                                       "are free while other requests hold the rest. Finish or abort them first.")
                seqs, counts, starts, left = [], [], [], budget
                for i, seq, pos in running:
                    if left == 0:
                        break
                    n = min(seq.num_tokens - pos, left)
                    seqs.append(seq)
                    counts.append(n)
                    starts.append(pos)
                    left -= n
                # start=pos recomputes rows below num_computed_tokens (prefix-cache hits) without writing them
                logits = self.runner.run(self.runner.prepare(seqs, counts, True, start=starts))
                row, still = 0, []
                for k, (i, seq, pos) in enumerate(running):
                    if k >= len(seqs):
                        still.append((i, seq, pos))
                        continue
                    n = counts[k]
                    rows = logits[row:row + n]
                    row += n
                    targets = torch.tensor(prompts[i][pos + 1:pos + 1 + n], device=rows.device)
                    logprobs = rows.log_softmax(-1).gather(1, targets[:, None])[:, 0]
                    parts.setdefault(i, []).append((logprobs.cpu(), (rows.argmax(-1) == targets).cpu()))
                    seq.num_computed_tokens = max(seq.num_computed_tokens, pos + n)
                    bm.mark_computed(seq)  # full blocks become prefix-cache entries, as after a generation prefill
                    if pos + n < seq.num_tokens:
                        still.append((i, seq, pos + n))
                        continue
                    bm.free(seq)
                    chunks = parts.pop(i)
                    results[i] = (torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]))
                    if on_done:
                        on_done(i)
                running = still
        finally:  # an error or Ctrl-C: give back the blocks of unfinished prompts
            for _, seq, _ in running:
                bm.free(seq)
        return results
