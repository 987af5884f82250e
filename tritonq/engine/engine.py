"""The engine: requests in, one step at a time, tokens and text out.

    engine = Engine(model, tokenizer, EngineConfig(max_seq_len=...), eos_token_ids=..., num_blocks=...)
    rid = engine.add_request(prompt_ids, GenerationConfig(max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():     # a RequestOutput per token a request got this step
            ...                       # out.token_id, out.text (new final text), out.finished

Each step is a pipeline: the scheduler picks the sequences and says what the step holds (`StepKind`: every
running decode, then chunked prefills of new prompts in what is left of the token budget, preempting when
blocks run out), the proposer fills a VERIFY step's lookahead, the runner computes the step over the paged KV
cache (logits, or None when no row needs them), a SCORE step's rows are scored, the sampler lays out and
samples the other rows (`Sampler.sample_step`; a static decode, verification or mixed step samples inside the
step instead, `Sampler.static_step` + `ModelRunner.run_sampled`), a verification keeps the accepted proposals
(`speculative.verify`), and the engine finishes a request on EOS (unless
ignore_eos, or before min_tokens), a stop token (stop_token_ids, not before min_tokens), a stop string or
max_new_tokens, freeing its blocks.
With speculative decoding (`use_speculation`, tritonq.engine.speculative), a decoding sequence's step
also scores up to k proposed tokens and may emit several tokens: one RequestOutput each, in order
(tokens verified after an EOS, a stop token or a stop string are dropped).
Scoring (`add_score`, `score`: prompt logprobs) is a request too: queued in the same scheduler, it waits for
blocks and is prefilled in the steps' budget with logits at every position, between other requests' decodes.
Tensor parallel note: a step failing on one rank only would leave the ranks out of step; only
failures every rank sees alike (and rank 0's non-finite rows, broadcast with the tokens) are safe.
Tensor parallel: every rank holds an Engine and calls it with the same requests in the same
order; the schedule is deterministic and the sampled tokens come from rank 0.

Failures: `check_request` refuses a request that could never run before anything is queued (the
one validation of a request: add_request runs it; Model and the server run it off the engine thread and queue
its CheckedRequest with add_checked). A step that raises fails the
requests in it (finish_reason "error", the exception in `error`) and the engine serves the rest;
rows whose logits are NaN / inf fail the same way without a token. A device error (CUDA error,
device-side assert) leaves the device unusable: step() raises EngineDeadError, then every later
step / add_request / score does too (the server reports unhealthy and exits so it is restarted).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tritonq.config import EngineConfig, GenerationConfig
from tritonq.engine.detokenize import Detokenizer
from tritonq.engine.block_manager import BlockManager
from tritonq.engine.runner import ModelRunner
from tritonq.engine.sampler import Sampler, SamplingParams, read_rows
from tritonq.engine.scheduler import ScheduledStep, Scheduler, StepKind
from tritonq.engine.sequence import Sequence, check_fits
from tritonq.engine.speculative import Proposer, SpeculativeStats, verify
from tritonq.engine.state_cache import StateSlots, is_hybrid
from tritonq.engine.structured import Grammars, GrammarState, constraint_of


@dataclass(frozen=True)
class CheckedRequest:
    """A request Engine.check_request validated (made only there): its prompt, its config and its output
    constraint (compiled); Engine.add_checked queues it without checking it again."""
    prompt_ids: list[int]
    config: GenerationConfig
    constraint: tuple[str, str] | None


@dataclass
class Request:
    """The engine's state of one request (kept in its Sequence's `extra`)."""
    request_id: int
    prompt_ids: list[int]
    config: GenerationConfig
    sampling: SamplingParams
    detokenizer: Detokenizer
    stream: bool = True  # its text is read as it grows (False and no stop strings: detokenized when it ends)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with config.top_logprobs > 0
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "eos", "stop", "length", "abort", "error"
    error: str | None = None  # with finish_reason "error": "<ExceptionType>: <message>"
    speculation: SpeculativeStats = field(default_factory=SpeculativeStats)  # its verified proposals
    grammar: GrammarState | None = None  # structured outputs: where its output is in its grammar

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_s or self.arrival_s) - self.arrival_s

    @property
    def text(self) -> str:
        return self.detokenizer.text


@dataclass
class ScoreRequest:
    """The engine's state of one scoring request (`Engine.add_score`; kept in its Sequence's `extra`)."""
    request_id: int
    prompt_ids: list[int]
    top_logprobs: int
    parts: list[tuple] = field(default_factory=list)  # per computed chunk: (logprobs, greedy, top or None)
    finish_s: float | None = None
    finish_reason: str | None = None  # "scored", "abort", "error"
    error: str | None = None

    def result(self, vocab_size: int) -> tuple:
        """(logprobs [T-1] float32, greedy [T-1] bool, top or None) on CPU: see Engine.score."""
        top_n = min(self.top_logprobs, vocab_size)
        if not self.parts:  # a one-token prompt: nothing to predict
            return (torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.bool),
                    (torch.empty(0, top_n, dtype=torch.int64), torch.empty(0, top_n)) if top_n else None)
        return (torch.cat([p[0] for p in self.parts]), torch.cat([p[1] for p in self.parts]),
                (torch.cat([p[2][0] for p in self.parts]), torch.cat([p[2][1] for p in self.parts]))
                if top_n else None)


def top_dicts(top: tuple[torch.Tensor, torch.Tensor]) -> list[dict[int, float]]:
    """Engine.score's (ids [T-1, N], logprobs [T-1, N]) as one {token id: log-probability} per position."""
    ids, values = top
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for one request: the token it sampled (None when it finished without one:
    max_new_tokens=0, or an error), its log-probability, the text that became final, whether it is
    done and why. error: with finish_reason "error", what went wrong ("<ExceptionType>: <message>").
    top_logprobs: {token id: log-probability} of the config.top_logprobs most likely tokens at this
    position (None when not asked for or no token). A scoring request (add_score) has one output, when it
    ends: finish_reason "scored" with its result in `scores` (see Engine.score), or "error"."""
    request_id: int
    token_id: int | None
    logprob: float | None
    text: str
    finished: bool
    finish_reason: str | None
    request: Request | ScoreRequest
    error: str | None = None
    top_logprobs: dict[int, float] | None = None
    scores: tuple | None = None


class EngineDeadError(RuntimeError):
    """The engine cannot continue (a device error); every later call raises it. Restart the process."""


# Phrases of exceptions after which the device (and so the engine) is unusable: a CUDA context that
# hit an error or a device-side assert fails every later launch, so failing one step would not help.
_DEVICE_ERRORS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "cudaError", "illegal memory access")


def _is_device_error(exc: BaseException) -> bool:
    accelerator = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    return (isinstance(exc, EngineDeadError) or (accelerator is not None and isinstance(exc, accelerator))
            or any(p in str(exc) for p in _DEVICE_ERRORS))


NONFINITE_ERROR = ("ValueError: the model produced non-finite logits (NaN or inf) for this request; the weights "
                   "likely hold NaN/inf values or an activation overflowed the dtype (try float32 or bfloat16, "
                   "or check the checkpoint).")


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(self, model, tokenizer, config: EngineConfig, *, eos_token_ids: set[int], num_blocks: int,
                 world: int = 1):
        """config: the EngineConfig load made (checked there), its max_seq_len resolved; num_blocks: the KV
        cache's blocks (kv_cache_blocks)."""
        assert config.max_seq_len is not None, "load resolves max_seq_len before the engine is made"
        self.config = config
        self.proposer: Proposer | None = None  # see use_speculation
        self.num_speculative_tokens = 0
        self.speculation = SpeculativeStats()  # every verification since start (the server's metrics)
        self.tokenizer, self.eos_token_ids = tokenizer, set(eos_token_ids)
        self.max_seq_len = config.max_seq_len
        enable_prefix_caching = config.enable_prefix_caching
        if is_hybrid(model) and enable_prefix_caching:
            logging.getLogger(__name__).info("prefix caching is off for model_type %r: its linear-attention layers' "
                                             "recurrent state is not kept at block boundaries",
                                             model.config.model_type)
            enable_prefix_caching = False
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching)
        # A scored token's full row of logits costs vocab * 4 bytes (twice, with log_softmax): ~512 MiB a step.
        scored = max(1, min(config.max_num_batched_tokens, (512 << 20) // (8 * model.config.vocab_size)))
        self.state_slots = StateSlots(config.max_num_seqs) if is_hybrid(model) else None  # one per running sequence
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, scored,
                                   self.state_slots)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_seq_len,
                                  num_state_slots=config.max_num_seqs)
        self.sampler = Sampler(world)
        self.requests: dict[int, Request] = {}  # unfinished requests
        self.scores: dict[int, ScoreRequest] = {}  # unfinished scoring requests (add_score)
        # outputs to report at the next step(): requests finished without a step (max_new_tokens=0, one-token
        # scores) and other requests' outputs of the steps score() ran
        self._done: list[RequestOutput] = []
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None  # set by a device error: see step()
        self._grammars: Grammars | None = None  # made at the first structured-output request (see grammars)

    @property
    def grammars(self) -> Grammars:
        """The structured-output grammar compiler and cache over this tokenizer (made on first use; made
        again if eos_token_ids changed, since they are the grammars' stop tokens). Raises
        ModuleNotFoundError naming the extra when xgrammar is not installed."""
        grammars = self._grammars
        if grammars is None or grammars.stop_token_ids != sorted(self.eos_token_ids):
            grammars = self._grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size,
                                                 self.eos_token_ids)
        return grammars

    def use_speculation(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        """Speculative decoding from now on: proposer (tritonq.engine.speculative: NgramProposer /
        DraftProposer) proposes up to num_speculative_tokens >= 1 tokens per decoding sequence and step,
        verified in the step (see `step`). Requests added before keep decoding without it."""
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r}; expected an int >= 1.")
        if self.state_slots is not None:
            raise ValueError(f"speculative decoding is not supported for model_type "
                             f"{self.runner.model.config.model_type!r}: its recurrent state would keep the updates "
                             "of rejected proposals; load it without speculative.")
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens

    def check_token_ids(self, prompt_ids, *, name: str = "the prompt") -> None:
        """TypeError unless prompt_ids is a list / tuple of int (bool refused: True is no token id);
        ValueError naming the first id outside [0, vocab_size). name: how messages call the prompt."""
        if not isinstance(prompt_ids, (list, tuple)):
            raise TypeError(f"{name} is a {type(prompt_ids).__name__}; expected a list of int token ids.")
        vocab_size = self.runner.model.config.vocab_size
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"{name} has token id {t!r} ({type(t).__name__}); token ids must be int.")
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name} has token id {t} outside the vocabulary (vocab_size={vocab_size}: ids "
                                 f"0..{vocab_size - 1}); encode prompts with this model's tokenizer.")

    def _check_length(self, num_prompt_tokens: int, max_new_tokens: int, name: str) -> None:
        bm = self.block_manager
        check_fits(name, num_prompt_tokens, max_new_tokens, num_blocks=bm.num_blocks, block_size=bm.block_size,
                   max_seq_len=self.max_seq_len)

    def check_request(self, prompt_ids: list[int], config: GenerationConfig, *,
                      name: str = "the prompt") -> CheckedRequest:
        """The one validation of a request, where it enters the engine (add_request runs it; Model and the server
        run it first, off the engine thread, and queue its result with add_checked): the prompt is non-empty,
        every id an int in [0, vocab_size) (the prompt's, stop_token_ids' and logit_bias's), prompt +
        max_new_tokens fits max_seq_len and the KV cache, and its structured-output constraint compiles (compiled
        here, once per distinct constraint: a bad schema is refused before anything is queued). config: a
        GenerationConfig (its own fields were checked when it was made). Raises TypeError for a wrong type,
        ValueError naming the numbers (RequestTooLong for the fit) or the grammar error otherwise. Reads constants
        and the thread-safe grammar cache only: safe to call from any thread."""
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config is a {type(config).__name__}; expected a tritonq.GenerationConfig.")
        self.check_token_ids(prompt_ids, name=name)
        vocab_size = self.runner.model.config.vocab_size
        for field_name, ids in (("stop_token_ids", config.stop_token_ids),
                                ("logit_bias", [t for t, _ in config.logit_bias])):
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(f"{field_name} has token id {outside[0]} outside the vocabulary (vocab_size="
                                 f"{vocab_size}: ids 0..{vocab_size - 1}); use ids of this model's tokenizer.")
        self._check_length(len(prompt_ids), config.max_new_tokens, name)
        constraint = constraint_of(config)
        if constraint is not None:
            self.grammars.compile(constraint)
        return CheckedRequest(list(prompt_ids), config, constraint)

    def add_request(self, prompt_ids: list[int], config: GenerationConfig, *, stream: bool = True) -> int:
        """Queue a request (config: a GenerationConfig); returns its id. It waits until blocks are free.
        Raises (check_request) before queueing if it could never run. stream=False: the caller reads the
        text only when the request finishes, so unless it has stop strings (checked on the text as it
        grows) it is detokenized once at the end and its outputs before then carry text ""."""
        return self.add_checked(self.check_request(prompt_ids, config), stream=stream)

    def add_checked(self, checked: CheckedRequest, *, stream: bool = True) -> int:
        """add_request of a request check_request has validated (not validated again); returns its id."""
        self._check_alive()
        prompt_ids, config, constraint = checked.prompt_ids, checked.config, checked.constraint
        rid = next(self._ids)
        request = Request(rid, prompt_ids, config, SamplingParams(config, num_prompt_tokens=len(prompt_ids)),
                          Detokenizer(self.tokenizer, config.stop, min_tokens=config.min_tokens),
                          stream=stream or bool(config.stop), arrival_s=time.perf_counter())
        if constraint is not None:
            request.grammar = self.grammars.matcher(constraint)
        if config.max_new_tokens == 0:
            self._finish(request, "length")
            return rid
        seq = Sequence(rid, prompt_ids, config.max_new_tokens, extra=request)
        # The penalties' (repetition, presence, frequency) seen tokens are kept incrementally per request
        # (tritonq.engine.sampler.SeenTokens), and so is a structured output's grammar state, which rows carrying unverified
        # proposals would corrupt: no speculation for them.
        if not request.sampling.penalized and request.grammar is None:
            seq.num_speculative_tokens = self.num_speculative_tokens
        self.scheduler.add(seq)
        self.requests[rid] = request
        return rid

    def check_score(self, prompt_ids: list[int], *, name: str = "the prompt") -> None:
        """add_score's checks (safe from any thread): token ids as check_token_ids, at least one, and the
        tokens the model runs over (all but the last, which is only a target) fit max_seq_len and the cache."""
        self.check_token_ids(prompt_ids, name=name)
        if len(prompt_ids) == 0:
            raise ValueError(f"{name} has no tokens; give at least one token.")
        if len(prompt_ids) > 1:
            self._check_length(len(prompt_ids) - 1, 0, f"{name} (scored: its first {len(prompt_ids) - 1} tokens run)")

    def add_score(self, prompt_ids: list[int], top_logprobs: int = 0) -> int:
        """Queue a scoring request (prompt logprobs); returns its id. It waits for blocks and runs in the
        steps' budget like a prompt (in chunks of at most max_num_scored_tokens tokens a step, so other
        requests keep decoding); its one output (finish_reason "scored") carries Engine.score's result for
        it in `scores`. Raises (check_score) before queueing if it could never run."""
        self._check_alive()
        self.check_score(prompt_ids)
        rid = next(self._ids)
        request = ScoreRequest(rid, list(prompt_ids), top_logprobs)
        if len(prompt_ids) == 1:  # nothing to predict: no context for the only token
            self._done.append(self._scored(request))
            return rid
        # the last token is only a target: the model runs over the others
        self.scheduler.add(Sequence(rid, request.prompt_ids[:-1], 0, extra=request, scoring=True))
        self.scores[rid] = request
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is; its blocks are freed. Unknown or finished ids are ignored."""
        score = self.scores.pop(request_id, None)
        if score is not None:
            self.scheduler.abort(request_id)
            score.finish_s, score.finish_reason = time.perf_counter(), "abort"
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            self._release(request)
            request.finish_s, request.finish_reason = time.perf_counter(), "abort"  # the caller knows: no output

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.scores or self._done)

    def step(self) -> list[RequestOutput]:
        """Run one model step; outputs for the requests that sampled a token or finished.

        An exception while the step runs (prepare / run / sample) fails every request in the step
        (finish_reason "error", blocks freed) and the rest go on in later steps; a device error raises
        EngineDeadError instead. Rows with non-finite logits fail their requests alone."""
        self._check_alive()
        outputs, self._done = self._done, []
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        try:
            if StepKind.VERIFY in step.kind:  # decoding sequences get proposals in their reserved slots
                assert self.proposer is not None and step.lookahead is not None  # VERIFY: speculation is on
                step = step.with_proposals(self.proposer.propose(step.seqs, step.lookahead))
            rows = step.logits_for()  # 1 + its proposals where a sequence samples, 0 for a chunk short of its end
            ctx = self.runner.prepare(step.seqs, step.num_new_tokens, step.is_prefill, logits_for=rows,
                                      proposals=step.proposals, start=step.start)
            static = None
            if ctx.num_seqs is not None or ctx.num_logits is not None:  # a static step: sampling inside it
                if ctx.num_logits is not None:  # a mixed step: a logits row per sequence slot
                    mixed = self.runner.mixed
                    assert mixed is not None  # it made the step
                    capacity, bucket_rows = mixed.capacity(mixed.max_tokens), ctx.context_lens.shape[0]
                else:
                    per_seq = ctx.input_ids.shape[0] // ctx.context_lens.shape[0]  # k + 1 rows a sequence to verify
                    capacity, bucket_rows = self.runner.buckets[-1] * per_seq, ctx.input_ids.shape[0]
                static = self.sampler.static_step(step, rows, self.eos_token_ids, capacity, bucket_rows,
                                                  self.runner.model.config.vocab_size, self.runner.device)
            tokens: list[int | None] = []
            logprobs: list[float | None] = []
            tops: list[dict[int, float] | None] = []
            if static is not None:
                tokens, logprobs, tops = read_rows(self.runner.run_sampled(ctx, static), static.params, static.top)
            elif (logits := self.runner.run(ctx)) is not None:  # None: only prompt chunks short of their end
                if StepKind.SCORE in step.kind:  # the scoring sequences' rows are scored, the rest sampled
                    logits, rows = self._score_rows(step, rows, logits)
                tokens, logprobs, tops = self.sampler.sample_step(logits, step, rows, self.eos_token_ids)
        except Exception as exc:
            if _is_device_error(exc):
                self._dead = EngineDeadError(f"the engine cannot continue after a device error: "
                                             f"{type(exc).__name__}: {exc}; restart the process.")
                raise self._dead from exc
            error = f"{type(exc).__name__}: {exc}"
            return outputs + [self._fail(seq, error) for seq in step.seqs if not seq.is_finished]
        picks = self._picks(step, rows, tokens, logprobs, tops, outputs)
        finished = self.scheduler.postprocess(step, [  # skips the failed (finished)
            None if pick is None else [t for t, _, _ in pick] if p else pick[0][0]
            for pick, p in zip(picks, step.proposals or itertools.repeat(None))])
        for seq in finished:
            if seq.scoring and self.scores.pop(seq.seq_id, None) is not None:
                assert seq.extra is not None  # the engine's sequences all carry their request
                outputs.append(self._scored(seq.extra))
        now = time.perf_counter()
        eos_ids, requests = self.eos_token_ids, self.requests
        for seq, pick in zip(step.seqs, picks):
            if pick is None or seq.seq_id not in requests:
                continue  # a chunk short of its last token, a failed row, or aborted meanwhile
            request = seq.extra
            assert request is not None
            detokenizer, config = request.detokenizer, request.config
            for j, (token, logprob, top) in enumerate(pick):
                if request.grammar is not None and not request.grammar.accept(token):  # (never speculated)
                    outputs.append(self._fail(seq, f"RuntimeError: token {token} is not allowed by the request's "
                                                   "grammar (structured output): the sampler broke its constraint."))
                    break
                request.token_ids.append(token)
                request.logprobs.append(logprob)
                if top is not None:
                    request.top_logprobs.append(top)
                if request.first_token_s is None:
                    request.first_token_s = now
                text = detokenizer.add(token) if request.stream else ""  # others: detokenized once, at the end
                may_stop = len(request.token_ids) >= config.min_tokens
                eos = token in eos_ids and not config.ignore_eos and may_stop
                stop_token = may_stop and token in config.stop_token_ids
                reason = ("eos" if eos else "stop" if stop_token or detokenizer.stopped
                          else "length" if j == len(pick) - 1 and seq.is_finished else None)
                if reason is not None:  # tokens verified after it are dropped
                    self.scheduler.finish(seq)  # no-op when postprocess already finished it (length)
                    self._release(request)
                    del requests[request.request_id]
                    if not request.stream:
                        text = detokenizer.add_many(request.token_ids)
                    text += detokenizer.flush()
                    request.finish_s, request.finish_reason = now, reason
                outputs.append(RequestOutput(request.request_id, token, logprob, text, reason is not None, reason,
                                             request, top_logprobs=top))
                if reason is not None:
                    break
        return outputs

    def _score_rows(self, step: ScheduledStep, rows: list[int], logits: torch.Tensor
                    ) -> tuple[torch.Tensor, list[int]]:
        """Score the scoring sequences' rows of a step's logits (each one's chunk appended to its request's
        parts); returns the other rows' logits and the rows per sequence left to sample (0 for scoring ones)."""
        keep: list[int] = []
        at = 0
        for seq, n in zip(step.seqs, rows):
            if not seq.scoring:
                keep.extend(range(at, at + n))
            elif n:
                request, first = seq.extra, seq.num_scored  # the first position whose logits these rows are
                assert request is not None
                chunk = logits[at:at + n]
                targets = torch.tensor(request.prompt_ids[first + 1:first + 1 + n], dtype=torch.int64,
                                       device=chunk.device)
                log_probs = chunk.float().log_softmax(-1)
                top_n = min(request.top_logprobs, log_probs.shape[1])
                top = log_probs.topk(top_n, dim=-1) if top_n else None
                request.parts.append((log_probs.gather(1, targets[:, None])[:, 0].cpu(),
                                      (chunk.argmax(-1) == targets).cpu(),
                                      None if top is None else (top.indices.cpu(), top.values.cpu())))
            at += n
        return logits[keep], [0 if seq.scoring else n for seq, n in zip(step.seqs, rows)]

    def _scored(self, request: ScoreRequest) -> RequestOutput:
        """A scoring request has every position's logprob: its output."""
        request.finish_s, request.finish_reason = time.perf_counter(), "scored"
        return RequestOutput(request.request_id, None, None, "", True, "scored", request,
                             scores=request.result(self.runner.model.config.vocab_size))

    def _picks(self, step: ScheduledStep, rows: list[int], tokens: list, logprobs: list, tops: list,
               outputs: list[RequestOutput]) -> list[list[tuple] | None]:
        """Per sequence of the step: the (token, logprob, top logprobs) it emits, in order (None: a chunk short of
        its end, or a failed row, whose failure output is appended to outputs). With proposals, the tokens its
        verification accepted (tritonq.engine.speculative.verify), then the target's own."""
        picks: list[list[tuple] | None] = []
        proposals: Iterable[list[int]] = step.proposals or itertools.repeat([])
        drawn_rows = iter(zip(tokens, logprobs, tops))
        for seq, m, p in zip(step.seqs, rows, proposals):
            if not m:
                picks.append(None)
                continue
            drawn = [next(drawn_rows)] if m == 1 else list(itertools.islice(drawn_rows, m))
            if drawn[0][0] is None or m > 1 and any(t is None for t, _, _ in drawn):  # non-finite logits: no token
                picks.append(None)
                if not seq.is_finished:
                    outputs.append(self._fail(seq, NONFINITE_ERROR))
            elif not p:
                picks.append(drawn)
            else:
                assert seq.extra is not None
                picks.append(verify(p, drawn, (self.speculation, seq.extra.speculation)))
        return picks

    def _release(self, request: Request) -> None:
        """A request ended: drop what the runner (and a draft proposer) keep for it."""
        self.sampler.release(request.sampling)
        if self.proposer is not None:
            self.proposer.release(request.request_id)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _fail(self, seq: Sequence[Request | ScoreRequest], error: str) -> RequestOutput:
        """Finish a request of a failed step (or row) with finish_reason "error"; its blocks are freed."""
        self.scheduler.finish(seq)
        if seq.scoring:
            request: Request | ScoreRequest = self.scores.pop(seq.seq_id)
        else:
            request = self.requests.pop(seq.seq_id)
            self._release(request)
        request.finish_s, request.finish_reason, request.error = time.perf_counter(), "error", error
        return RequestOutput(request.request_id, None, None, "", True, "error", request, error)

    def _finish(self, request: Request, reason: str) -> None:
        """A request that ends without a step (max_new_tokens=0): reported by the next step()."""
        request.finish_s, request.finish_reason = time.perf_counter(), reason
        self._done.append(RequestOutput(request.request_id, None, None, "", True, reason, request))

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] float32 at every position of token_ids, in one prefill over the paged cache (no
        sampling, nothing kept: for scoring and tests). Needs the blocks for T tokens free now; blocks
        already prefix-cached are read, not written."""
        self._check_alive()
        self.check_token_ids(token_ids)
        self._check_length(len(token_ids), 0, "the prompt")
        seq: Sequence[None] = Sequence(-1, list(token_ids), 1)
        bm = self.block_manager
        if not bm.can_allocate(seq):
            raise RuntimeError(f"prompt_logits: {len(token_ids)} tokens need {bm.blocks_needed(len(token_ids))} "
                               f"free KV blocks; {bm.num_free_blocks} are free while other requests run.")
        if self.state_slots is not None and not self.state_slots.num_free:
            raise RuntimeError("prompt_logits: every recurrent-state slot is held by a running request.")
        bm.allocate(seq)
        if self.state_slots is not None:
            self.state_slots.allocate(seq)
        try:
            ctx = self.runner.prepare([seq], [seq.num_tokens], True, start=[0])
            logits = self.runner.run(ctx)
            assert logits is not None  # no logits_for: every row has logits
            return logits
        finally:
            bm.free(seq)
            if self.state_slots is not None:
                self.state_slots.free(seq)

    def score(self, prompts: list[list[int]], on_done=None, top_logprobs: int = 0) -> list[tuple]:
        """Per prompt (T >= 1 token ids): (logprobs [T-1] float32, greedy [T-1] bool, top) on CPU, in input
        order; top is None, or with top_logprobs = N > 0 (ids [T-1, N] int64, logprobs [T-1, N] float32)
        of the N most likely tokens at each position, most likely first.

        logprobs[i] = log p(token i+1 | tokens 0..i) under the raw logits; greedy[i] says whether token i+1
        is the argmax there. The model runs over tokens 0..T-2 only (the last one is a target, never an
        input), as prefills over the paged cache with logits for every row: each prompt is a scoring request
        (add_score) and steps run until all are done, packed into the steps' budget and split over steps
        (chunked prefill), so many prompts cost few steps. Other requests in the engine go on in the same
        steps (their outputs are reported by the next step()), so scoring waits for blocks they hold instead
        of failing, and prefix-cache hits are read, not recomputed into the cache. Every prompt is checked
        before any is queued. on_done(i) is called as prompt i finishes (progress bars). A scoring request the
        engine failed raises RuntimeError; on any exit the unfinished ones are aborted.
        """
        self._check_alive()
        for i, p in enumerate(prompts):  # every prompt checked before any runs
            self.check_score(p, name=f"prompt {i}")
        others: list[RequestOutput] = []
        index: dict[int, int] = {}  # request id -> prompt
        results: dict[int, tuple] = {}  # prompt -> its scores
        try:
            for i, p in enumerate(prompts):
                index[self.add_score(p, top_logprobs)] = i
            while len(results) < len(prompts):
                for out in self.step():
                    at = index.get(out.request_id)
                    if at is None:
                        others.append(out)
                    elif out.finish_reason != "scored":
                        raise RuntimeError(f"scoring prompt {at} failed in the engine: {out.error}")
                    else:
                        assert out.scores is not None  # a "scored" output carries them
                        results[at] = out.scores
                        if on_done:
                            on_done(at)
        finally:  # an error or Ctrl-C: give back the blocks of unfinished prompts; the others' outputs wait
            for rid in index:
                self.abort(rid)
            self._done = others + self._done
        return [results[i] for i in range(len(prompts))]
