"""Sampling: a step's logits -> each row's next token, its log-probability and its top alternatives.

`step_rows` lays out a step's sampling rows (a sequence with proposals has one per proposal + 1);
`Sampler.sample` draws every row's next token in one batched pass (`SamplingTensors`: per-row EOS / stop-id
mask below min_tokens, logit bias, repetition / frequency / presence penalties, each structured-output
row's grammar bitmask, temperature, min-p, top-k, top-p as tensors); only the sampled ids, their
log-probabilities (and the top-N alternatives a request asked for) and whether each row's logits were
finite come back to the host, in one transfer per step. A row's random numbers are a hash of (its request's
seed, its sequence length, vocabulary index) computed with torch integer ops (`sampling_noise`), so a seeded
request draws the same tokens from the same logits whatever else shares its batch, without a torch.Generator per
request; greedy (temperature 0) is argmax. (The logits themselves are the same whatever the batch only in the
batch-invariant mode: outside it bf16 / fp16 ones can change with the batch, docs/batch_invariance.md.)
Tensor parallel: every rank samples; rank 0's tokens are broadcast, so all ranks append the same tokens
even where their sampling would differ.
"""
from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tritonq.config import GenerationConfig
from tritonq.distributed import broadcast_from_rank0
from tritonq.kernels import threads_for
from tritonq.kernels.cpu import native as cpu_native
from tritonq.engine.scheduler import ScheduledStep, StepKind
from tritonq.engine.structured import apply_token_bitmask, token_bitmask

if TYPE_CHECKING:
    from tritonq.engine.sequence import Sequence
    from tritonq.engine.structured import GrammarState

MASK32 = 0xFFFFFFFF
# rows x vocabulary of a step from which its sampling ops run on torch's threads; below it on one: each small op's
# parallel region wakes and waits for the other threads (the null-model bench's 256-row steps over 512 tokens took
# twice their wall time in CPU time on two threads before)
PARALLEL_WORK = 1 << 21


_sampling_keys = itertools.count(1)


@dataclass
class SamplingParams:
    """One request's sampling settings (a GenerationConfig), the seed of its random numbers and its
    prompt length (tokens past it are "generated": what presence / frequency penalties count).
    seed: config.seed, or for an unseeded request one drawn once from torch's global generator when the
    request is created (so torch.manual_seed still makes a run repeatable). The flags below are read
    from the config once, so a step tests each row with an attribute read; key names the request in
    the runner's SeenTokens."""
    config: GenerationConfig
    seed: int | None = None
    num_prompt_tokens: int = 0

    def __post_init__(self):
        if self.seed is None:
            seed = self.config.seed
            self.seed = int(torch.randint(0, 2 ** 62, ())) if seed is None else int(seed)
        c = self.config
        self.key = next(_sampling_keys)
        self.seed_halves = (self.seed % 2 ** 64 & MASK32, self.seed % 2 ** 64 >> 32)
        self.sampled = c.temperature > 0
        self.repetition = c.repetition_penalty != 1.0
        self.counted = bool(c.presence_penalty or c.frequency_penalty)
        self.penalized = self.repetition or self.counted  # has a SeenTokens row
        self.logit_bias = c.logit_bias
        self.stop_token_ids = c.stop_token_ids
        self.top_logprobs = c.top_logprobs
        self.filtered = self.sampled and bool(c.top_k or c.top_p < 1.0)
        self.uses_min_p = self.sampled and c.min_p > 0


class SeenTokens:
    """The tokens each penalized request has produced so far, kept across steps as rows of two [rows, V]
    tensors: `mask` bool (prompt + generated: the repetition penalty's set) and `counts` int32 (generated
    tokens only: what presence / frequency penalties count, as OpenAI and vLLM define them). A step adds
    only the tokens appended since that request's last step (usually one) instead of rebuilding every
    token of every sequence on the host. Row 0 stays empty (rows without a penalty). release() frees a
    finished request's row."""

    def __init__(self, vocab: int, device: torch.device):
        self.mask = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(1, vocab, dtype=torch.int32, device=device)
        self.rows: dict[int, list[int]] = {}  # SamplingParams.key -> [its row, tokens recorded in it]
        self.free: list[int] = []

    def gather(self, params: list[SamplingParams], token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [R, V] bool, counts [R, V] int32) for rows of these requests with these tokens (rows
        without a penalty empty)."""
        index, new_rows, new_tokens, counted_rows, counted_tokens = [], [], [], [], []
        for p, ids in zip(params, token_ids):
            if not p.penalized:
                index.append(0)
                continue
            entry = self.rows.get(p.key)
            if entry is None:
                entry = self.rows[p.key] = [self._take_row(), 0]
            if entry[1] < len(ids):  # token_ids only grow (a preempted request keeps its tokens)
                new_rows += [entry[0]] * (len(ids) - entry[1])
                new_tokens += ids[entry[1]:]
                generated = ids[max(entry[1], p.num_prompt_tokens):]
                counted_rows += [entry[0]] * len(generated)
                counted_tokens += generated
                entry[1] = len(ids)
            index.append(entry[0])
        device = self.mask.device
        if new_rows:
            self.mask[torch.tensor(new_rows).to(device), torch.tensor(new_tokens).to(device)] = True
        if counted_rows:
            self.counts.index_put_((torch.tensor(counted_rows).to(device), torch.tensor(counted_tokens).to(device)),
                                   torch.ones(len(counted_rows), dtype=torch.int32, device=device), accumulate=True)
        rows = torch.tensor(index).to(device)
        return self.mask[rows], self.counts[rows]

    def release(self, params: SamplingParams) -> None:
        """Forget a finished request (a no-op for one that never sampled with a penalty)."""
        entry = self.rows.pop(params.key, None)
        if entry is not None:
            self.mask[entry[0]] = False
            self.counts[entry[0]] = 0
            self.free.append(entry[0])

    def _take_row(self) -> int:
        if not self.free:  # double the rows: amortized, and at most twice the requests ever penalized at once
            n = self.mask.shape[0]
            self.mask = torch.cat([self.mask, torch.zeros_like(self.mask)])
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply rounds) of x int64 in [0, 2^32). The
    multipliers are < 2^30, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & MASK32
    return x ^ (x >> 15)


def sampling_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [R, vocab] float32, a pure function of (seed, step, vocabulary index) per row.

    seeds [2, R] int64: the low and high 32 bits of each row's seed; steps [R] int64 (the sequence's
    length when it samples). Counter-based: uniforms from a hash of the three, then -log(-log u);
    argmax(logits + noise) is a sample of softmax(logits) (the Gumbel-max trick)."""
    row = _mix32((_mix32(_mix32(seeds[0]) ^ seeds[1]) + steps) & MASK32)  # [R]
    index = torch.arange(vocab, device=steps.device, dtype=torch.int64)
    bits = _mix32(_mix32(row[:, None] ^ index[None, :]))  # [R, vocab] in [0, 2^32)
    return -torch.log(-torch.log(open_unit_uniform(bits)))


def open_unit_uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1), never 0 or 1, from bits int64 in [0, 2^32): the top 23 bits + 0.5, over
    2^23. (With 24 bits, 2^24 - 0.5 rounds up to 2^24 in float32: u = 1 and the noise is +inf, which beats
    a -inf (masked) logit: inf + -inf is NaN, and argmax takes NaN.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0 ** -23


@dataclass
class SamplingTensors:
    """One step's per-row sampling settings as tensors over its R rows; a field is None when no row of
    the step uses it (that stage is skipped). Sparse per-row entries are (rows [B], ids [B]) int64 pairs.

    banned: (rows, ids) set to -inf (EOS and stop_token_ids of rows below min_tokens).
    bias: (rows, ids, values [B] float32) added to the logits (logit_bias).
    repetition_penalty [R] float32 (1: off) with seen [R, V] bool (prompt + generated tokens).
    frequency_penalty, presence_penalty [R] float32 (0: off) with counts [R, V] int32 (generated tokens).
    temperature [R] float32 (0: greedy), top_k [R] int64 (0: off), top_p [R] float32 (1: off),
    min_p [R] float32 (0: off), noise [R, V] float32 from `sampling_noise`: all None when every row is
    greedy. filters: some row uses top-k or top-p.
    allowed: int32 [R, ceil(V / 32)] bitmask of the tokens each row's grammar allows (structured outputs,
    tritonq.engine.structured; unconstrained rows all ones).
    """
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    repetition_penalty: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    filters: bool = False
    allowed: torch.Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """No row masks, biases, penalises, constrains or samples: every row takes its argmax of the raw logits."""
        return (self.banned is None and self.bias is None and self.repetition_penalty is None and self.counts is None
                and self.noise is None and self.allowed is None)


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits [R, V] float32 every row samples from, before temperature: its masks, logit bias and
    penalties applied, each one tensor op over the batch (a new per-row mask or bias goes here).
    Order, as vLLM: the min_tokens mask, logit_bias, then the repetition, frequency and presence penalties,
    then the grammar bitmask."""
    if t.banned is not None:
        logits = logits.index_put(t.banned, torch.tensor(float("-inf"), device=logits.device))
    if t.bias is not None:  # OpenAI logit_bias: added to the logit of each named token
        logits = logits.index_put(t.bias[:2], t.bias[2], accumulate=True)
    if t.repetition_penalty is not None:  # CTRL-style penalty, as transformers applies it
        assert t.seen is not None  # set with repetition_penalty
        penalty = t.repetition_penalty[:, None]
        logits = torch.where(t.seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if t.counts is not None:  # OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty
        assert t.frequency_penalty is not None and t.presence_penalty is not None  # set with counts
        counts = t.counts.to(logits.dtype)
        logits = logits - counts * t.frequency_penalty[:, None] - (counts > 0) * t.presence_penalty[:, None]
    if t.allowed is not None:  # structured outputs: only what each row's grammar allows (last: nothing revives it)
        logits = apply_token_bitmask(logits, t.allowed)
    return logits


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R] int64, the first index of each row's largest value (NaN counts as largest), as
    x.argmax(-1): torch.max's reduction, measured 3x faster than argmax's on CPU (256 x 512 fp32, one thread)."""
    return x.max(-1).indices


SMALL_LOGITS = 4096  # elements below which finite_rows checks each logit (measured faster there, 1 x 512)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] bool: every logit of the row is finite. A row's largest and smallest logit are finite
    iff all are (NaN propagates through both reductions), and those two vectorized reductions took 1/25 of
    isfinite(logits).all(-1)'s time at 256 x 512 and 1/4 at 1 x 32000; below SMALL_LOGITS elements the plain check
    is the faster (6 vs 11 us at 1 x 512)."""
    if logits.numel() < SMALL_LOGITS:
        return torch.isfinite(logits).all(-1)
    return torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1))


def sample_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Next tokens [R] int64 from logits [R, V] float32 with the step's settings t: `process_logits`,
    then greedy rows take the argmax and sampled rows, as vLLM: temperature, min_p (relative to the most
    likely token after temperature), then top-k and top-p over what min_p kept, and a Gumbel-max draw."""
    logits = process_logits(logits, t)
    greedy = argmax_rows(logits)
    if t.noise is None:
        return greedy
    temperature, noise = t.temperature, t.noise
    assert temperature is not None  # set with noise
    x = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if t.min_p is not None:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p) (log 0 = -inf keeps every token)
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + t.min_p.log()[:, None], float("-inf"))
    if t.filters:  # in descending order: top-k keeps values >= the k-th, top-p the smallest prefix reaching p
        assert t.top_k is not None and t.top_p is not None  # set with filters
        V = x.shape[-1]
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        k = torch.where(t.top_k > 0, t.top_k, V).clamp(max=V)
        sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(1, (k - 1)[:, None]), float("-inf"))
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs >= t.top_p[:, None]) & (t.top_p < 1.0)[:, None]
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.where(temperature > 0, argmax_rows(x + noise), greedy)


class SamplingState(Protocol):
    """What the sampler reads of a sequence's request (`Sequence.extra`: the engine's Request)."""
    sampling: SamplingParams
    config: GenerationConfig
    grammar: GrammarState | None


@dataclass
class StepRows:
    """A step's sampling rows: per row its sequence, params, tokens before it and whether EOS / stop ids are
    masked (min_tokens not reached; mask_eos None when no row's request has min_tokens)."""
    seqs: list[Sequence[SamplingState]]
    params: list[SamplingParams]
    token_ids: list[list[int]]
    mask_eos: list[bool] | None

    def bitmask(self, vocab_size: int) -> torch.Tensor | None:
        """The structured-output bitmask int32 [R, ceil(V / 32)] (CPU) over the rows: each constrained row
        filled by its grammar, the others all allowed; None when no row is constrained."""
        grammars = [_state(seq).grammar for seq in self.seqs]
        constrained = [(r, grammar) for r, grammar in enumerate(grammars) if grammar is not None]
        if not constrained:
            return None
        bitmask = token_bitmask(len(self.seqs), vocab_size)
        for r, grammar in constrained:
            grammar.fill(bitmask, r)
        return bitmask


def _state(seq: Sequence[SamplingState]) -> SamplingState:
    """A sampled sequence's request (the engine makes every sampled sequence with one)."""
    assert seq.extra is not None
    return seq.extra


def step_rows(step: ScheduledStep, rows: list[int]) -> StepRows:
    """The sampling rows of a step, rows[i] of sequence i. Row j of a sequence with proposals samples the token
    after its tokens + proposals[:j], as a plain decode step at that length would (same noise counter, same
    min_tokens mask)."""
    if StepKind.VERIFY not in step.kind:  # one row per sampling sequence (all of a decode step): no per-row work
        seqs = step.seqs if all(rows) else [seq for seq, m in zip(step.seqs, rows) if m]
        params = [_state(seq).sampling for seq in seqs]
        mask_eos = None
        if any(p.config.min_tokens for p in params):
            mask_eos = [seq.num_generated < p.config.min_tokens for seq, p in zip(seqs, params)]
        return StepRows(seqs, params, [seq.token_ids for seq in seqs], mask_eos)
    seqs, params, token_ids, mask_eos = [], [], [], []
    for seq, m, p in zip(step.seqs, rows, step.proposals or itertools.repeat([])):
        for j in range(m):
            seqs.append(seq)
            params.append(_state(seq).sampling)
            token_ids.append(seq.token_ids + p[:j] if j else seq.token_ids)
            mask_eos.append(seq.num_generated + j < _state(seq).config.min_tokens)
    return StepRows(seqs, params, token_ids, mask_eos)


class Sampler:
    """Samples the engine's steps; keeps the penalties' seen-token rows (`SeenTokens`) across steps.
    world: tensor-parallel ranks (rank 0's tokens are broadcast to the others)."""

    def __init__(self, world: int = 1):
        self.world = world
        self.seen: SeenTokens | None = None  # made at the first step with a penalty

    def sample_step(self, logits: torch.Tensor, step: ScheduledStep, rows: list[int], eos_token_ids: set[int]
                    ) -> tuple[list[int | None], list[float | None], list[dict[int, float] | None]]:
        """`sample` over a step's sampling rows: rows[i] logits rows of sequence i (its last ones; 0: none),
        whose request (`SamplingState`, the sequence's extra) gives each row's params; the rows' token lists,
        min_tokens masks and structured-output bitmask are made here (`step_rows`)."""
        sampling = step_rows(step, rows)
        if not sampling.seqs:
            return [], [], []
        return self.sample(logits, sampling.params, sampling.token_ids, mask_eos=sampling.mask_eos,
                           eos_token_ids=eos_token_ids, token_bitmask=sampling.bitmask(logits.shape[1]))

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
               mask_eos: list[bool] | None = None, eos_token_ids: AbstractSet[int] = frozenset(),
               token_bitmask: torch.Tensor | None = None
               ) -> tuple[list[int | None], list[float | None], list[dict[int, float] | None]]:
        """Each row's next token, its log-probability and its top alternatives, all under the raw logits
        (before any mask, bias, penalty or filter, as vLLM's default).

        logits [R, V] float32; params[r] the row's request settings; token_ids[r] its prompt + generated
        tokens (the penalties' "seen" sets, kept in `self.seen` across steps; its length numbers the row's
        random draws); mask_eos[r]: row r may not sample an EOS id (eos_token_ids) nor one of its
        stop_token_ids this step (min_tokens not reached); token_bitmask: int32 [R, ceil(V / 32)] on the CPU,
        the tokens each row's grammar allows (structured outputs; None: no row is constrained). All rows are
        sampled at once (`sample_logits`).
        The third list holds, for rows whose request asks for top_logprobs = N > 0, a dict of the N most
        likely token ids -> log-probability (most likely first), else None. A row whose logits hold NaN or
        inf anywhere gets token, logprob and top None: its distribution is meaningless. Everything comes
        back to the host in one transfer. Call release() when a request finishes. A step below
        PARALLEL_WORK (rows x vocabulary) samples on one intra-op thread. A CPU step whose rows all take the
        argmax of their raw logits with no top logprobs runs one C loop instead (kernels/cpu/native.py)."""
        with threads_for(logits.numel(), PARALLEL_WORK):
            return self._sample(logits, params, token_ids, mask_eos, eos_token_ids, token_bitmask)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                mask_eos: list[bool] | None, eos_token_ids: AbstractSet[int], token_bitmask: torch.Tensor | None
                ) -> tuple[list[int | None], list[float | None], list[dict[int, float] | None]]:
        R, V = logits.shape
        tensors = self.sampling_tensors(params, token_ids, mask_eos, eos_token_ids, V, logits.device)
        if token_bitmask is not None:
            tensors.allowed = token_bitmask.to(logits.device, non_blocking=True)
        top = min(max(p.top_logprobs for p in params), V) if params else 0
        if tensors.argmax_only and not top and self.world == 1:  # the C loop (kernels/cpu/native.py), where built
            greedy = cpu_native.greedy_rows(logits)
            if greedy is not None:
                ids, logprobs = greedy  # id -1: the row's logits are not all finite
                return ([t if t >= 0 else None for t in ids],
                        [lp if t >= 0 else None for t, lp in zip(ids, logprobs)], [None] * R)
        tokens = sample_logits(logits, tensors)
        # -1 marks a row with non-finite logits; set before the broadcast so every rank agrees on it
        tokens = torch.where(finite_rows(logits), tokens, -1)
        if self.world > 1:
            tokens = broadcast_from_rank0(tokens)
        log_normalizer = logits.logsumexp(-1, keepdim=True)  # [R, 1]: no [R, V] log_softmax unless top-N is asked
        columns = [tokens.double()[:, None], (logits.gather(1, tokens.clamp(min=0)[:, None]) - log_normalizer).double()]
        if top:
            top_values, top_ids = logits.topk(top, dim=-1)
            columns += [top_ids.double(), (top_values - log_normalizer).double()]
        picked = torch.cat(columns, 1).tolist()  # the step's one device read: [R, 2 + 2 * top]
        out_tokens, out_logprobs, out_top = [], [], []
        for p, row in zip(params, picked):
            ok = row[0] >= 0
            out_tokens.append(int(row[0]) if ok else None)
            out_logprobs.append(row[1] if ok else None)
            n = min(p.top_logprobs, top)
            out_top.append(dict(zip(map(int, row[2:2 + n]), row[2 + top:2 + top + n])) if ok and n else None)
        return out_tokens, out_logprobs, out_top

    def sampling_tensors(self, params: list[SamplingParams], token_ids: list[list[int]], mask_eos: list[bool] | None,
                          eos_token_ids: AbstractSet[int], V: int, device: torch.device) -> SamplingTensors:
        """The SamplingTensors of these rows; a stage no row uses stays None (greedy steps without
        penalties or biases build nothing but the argmax)."""
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
        t = SamplingTensors()
        if mask_eos is not None and any(mask_eos):
            eos = sorted(i for i in eos_token_ids if 0 <= i < V)
            pairs = [(r, i) for r, (m, p) in enumerate(zip(mask_eos, params)) if m
                     for i in eos + list(p.stop_token_ids)]
            if pairs:
                rows, ids = zip(*pairs)
                t.banned = (tensor(rows, torch.int64), tensor(ids, torch.int64))
        if any(p.logit_bias for p in params):
            entries = [(r, i, b) for r, p in enumerate(params) for i, b in p.logit_bias]
            rows, ids, values = zip(*entries)
            t.bias = (tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32))
        if any(p.penalized for p in params):
            if self.seen is None or self.seen.mask.shape[1] != V:
                self.seen = SeenTokens(V, device)
            seen, counts = self.seen.gather(params, token_ids)
            configs = [p.config for p in params]
            if any(p.repetition for p in params):
                t.repetition_penalty = tensor([c.repetition_penalty for c in configs], torch.float32)
                t.seen = seen
            if any(p.counted for p in params):
                t.frequency_penalty = tensor([c.frequency_penalty for c in configs], torch.float32)
                t.presence_penalty = tensor([c.presence_penalty for c in configs], torch.float32)
                t.counts = counts
        if any(p.sampled for p in params):  # all-greedy steps need none of this: argmax
            configs = [p.config for p in params]
            t.noise = sampling_noise(tensor(list(zip(*(p.seed_halves for p in params))), torch.int64),
                                     tensor([len(ids) for ids in token_ids], torch.int64), V)
            t.temperature = tensor([c.temperature for c in configs], torch.float32)
            t.top_k = tensor([c.top_k or 0 for c in configs], torch.int64)
            t.top_p = tensor([c.top_p for c in configs], torch.float32)
            if any(p.uses_min_p for p in params):
                t.min_p = tensor([c.min_p for c in configs], torch.float32)
            t.filters = any(p.filtered for p in params)
        return t

    def release(self, params: SamplingParams) -> None:
        """A request finished: drop what the runner keeps for it (its SeenTokens row)."""
        if self.seen is not None:
            self.seen.release(params)
