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

import dataclasses
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

    def row_index(self, params: list[SamplingParams], token_ids: list[list[int]]) -> torch.Tensor:
        """The rows [R] int64 (device) of `mask` / `counts` holding these requests with these tokens (row 0, empty,
        for rows without a penalty), their tokens recorded first."""
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
        return torch.tensor(index).to(device)

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

    bias: (rows, ids, values [B] float32) added to the logits: logit_bias, and -inf for EOS and
        stop_token_ids of rows below min_tokens (an added -inf bans a token whatever else is added to it).
    repetition_penalty [R] float32 (1: off) with seen [R, V] bool (prompt + generated tokens).
    frequency_penalty, presence_penalty [R] float32 (0: off) with counts [R, V] int32 (generated tokens).
    temperature [R] float32 (0: greedy), top_k [R] int64 (0: off), top_p [R] float32 (1: off),
    min_p [R] float32 (0: off), seeds [2, R] int64 and steps [R] int64 (`sampling_noise`'s inputs; `sample_rows`
    turns them into noise [R, V] float32): all None when every row is greedy. filters: some row uses top-k or
    top-p.
    allowed: int32 [R, ceil(V / 32)] bitmask of the tokens each row's grammar allows (structured outputs,
    tritonq.engine.structured; unconstrained rows all ones).
    """
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
    seeds: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    filters: bool = False
    allowed: torch.Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """No row masks, biases, penalises, constrains or samples: every row takes its argmax of the raw logits."""
        return (self.bias is None and self.repetition_penalty is None and self.counts is None
                and self.seeds is None and self.noise is None and self.allowed is None)


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits [R, V] float32 every row samples from, before temperature: its masks, logit bias and
    penalties applied, each one tensor op over the batch (a new per-row mask or bias goes here).
    Order, as vLLM: the min_tokens mask and logit_bias, then the repetition, frequency and presence penalties,
    then the grammar bitmask."""
    if t.bias is not None:  # OpenAI logit_bias (and -inf: min_tokens) added to the logit of each named token
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


def sample_rows(logits: torch.Tensor, t: SamplingTensors, top: int, world: int = 1) -> torch.Tensor:
    """The device part of a step's sampling, one function for the eager and the static (graphed) step: logits
    [R, V] float32 -> [R, 2 + 2 * top] float64: per row its token (-1: the row's logits are not all finite), the
    token's log-probability under the raw logits, and the ids and log-probabilities of the `top` most likely
    tokens. The noise of sampled rows is made here from t.seeds / t.steps. world > 1: rank 0's tokens are
    broadcast (eager steps only: no collective is captured). No host read on CUDA: a CUDA graph can hold it. On
    the CPU, rows that all take the argmax of their raw logits with no top-N run one C loop instead
    (kernels/cpu/native.py), where built."""
    if t.argmax_only and not top and world == 1 and logits.is_cpu:
        greedy = cpu_native.greedy_rows(logits)
        if greedy is not None:  # id -1: the row's logits are not all finite
            return torch.tensor(greedy, dtype=torch.float64).T.reshape(-1, 2)
    if t.seeds is not None:
        assert t.steps is not None  # set with seeds
        t = dataclasses.replace(t, noise=sampling_noise(t.seeds, t.steps, logits.shape[1]))
    tokens = sample_logits(logits, t)
    # -1 marks a row with non-finite logits; set before the broadcast so every rank agrees on it
    tokens = torch.where(finite_rows(logits), tokens, -1)
    if world > 1:
        tokens = broadcast_from_rank0(tokens)
    log_normalizer = logits.logsumexp(-1, keepdim=True)  # [R, 1]: no [R, V] log_softmax unless top-N is asked
    columns = [tokens.double()[:, None], (logits.gather(1, tokens.clamp(min=0)[:, None]) - log_normalizer).double()]
    if top:
        top_values, top_ids = logits.topk(top, dim=-1)
        columns += [top_ids.double(), (top_values - log_normalizer).double()]
    return torch.cat(columns, 1)


def read_rows(picked: torch.Tensor, params: list[SamplingParams], top: int
              ) -> tuple[list[int | None], list[float | None], list[dict[int, float] | None]]:
    """`sample_rows`' output for these rows (its first len(params)) as host lists, in the step's one device read:
    tokens, log-probabilities and top-N dicts (a row's own top_logprobs of them); None for a non-finite row."""
    out_tokens, out_logprobs, out_top = [], [], []
    for p, row in zip(params, picked[:len(params)].tolist()):
        ok = row[0] >= 0
        out_tokens.append(int(row[0]) if ok else None)
        out_logprobs.append(row[1] if ok else None)
        n = min(p.top_logprobs, top)
        out_top.append(dict(zip(map(int, row[2:2 + n]), row[2 + top:2 + top + n])) if ok and n else None)
    return out_tokens, out_logprobs, out_top


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


@dataclass
class RowSettings:
    """The host values of a step's sampling rows, made once for the eager tensors and the static buffers alike:
    bias (rows, ids, values) entries (logit_bias; -inf for the EOS / stop ids of rows below min_tokens), whether
    any row is penalized / sampled / filtered / uses min_p, and top (the largest top_logprobs, at most V)."""
    bias: list[tuple[int, int, float]]
    penalized: bool
    sampled: bool
    filters: bool
    min_p: bool
    top: int


def row_settings(params: list[SamplingParams], mask_eos: list[bool] | None, eos_token_ids: AbstractSet[int],
                 V: int) -> RowSettings:
    bias = []
    if mask_eos is not None and any(mask_eos):
        eos = sorted(i for i in eos_token_ids if 0 <= i < V)
        bias = [(r, i, float("-inf")) for r, (m, p) in enumerate(zip(mask_eos, params)) if m
                for i in eos + list(p.stop_token_ids)]
    bias += [(r, i, b) for r, p in enumerate(params) for i, b in p.logit_bias]
    return RowSettings(bias, any(p.penalized for p in params), any(p.sampled for p in params),
                       any(p.filtered for p in params), any(p.uses_min_p for p in params),
                       min(max(p.top_logprobs for p in params), V) if params else 0)


class StaticSampling:
    """A static step's sampling inputs in buffers allocated once for max_rows rows (a decode bucket's capacity), so
    that `sample_rows` over them has fixed shapes and addresses and a CUDA graph can hold it (runner.run_sampled).

    fill() writes a step's rows in at most four host-to-device copies, only those its stages read (the float
    settings, the int ones, the bias entries' values and their rows / ids; padding rows greedy, unbiased,
    unpenalized) and, for a step with penalties, gathers its rows' seen / counts from SeenTokens into
    [max_rows, V] buffers on the device (made at the first such step). A step's stages (`key`: bias entries, penalties, sampling, top-k / top-p,
    top N) are fixed per captured graph: a stage off for the step is skipped, as in the eager path, and a stage on
    runs over the padding rows' neutral values (bias 0, penalty 1, temperature 0 ...), which change nothing.
    Steps that fall back to the eager sampler over the step's logits (`Sampler.static_step` returns None): a row
    with a structured-output grammar (its bitmask is filled on the host by xgrammar after the previous step's
    token), more bias entries than max_bias, tensor parallel (the token broadcast is a collective)."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device, max_bias: int):
        self.max_rows, self.vocab, self.max_bias = max_rows, vocab, max_bias
        # temperature, top_p, min_p, repetition, frequency, presence [max_rows]; bias values [max_bias]
        self.floats = torch.zeros(6 * max_rows + max_bias, dtype=torch.float32, device=device)
        # seed low, seed high, steps, top_k [max_rows]; bias rows, bias ids [max_bias]
        self.ints = torch.zeros(4 * max_rows + 2 * max_bias, dtype=torch.int64, device=device)
        self.device = device
        self.seen: torch.Tensor | None = None  # [max_rows, V] bool and int32, made at the first penalized step
        self.counts: torch.Tensor | None = None

    def fill(self, rows: int, params: list[SamplingParams], token_ids: list[list[int]], s: RowSettings,
             seen: SeenTokens | None) -> tuple[SamplingTensors, tuple]:
        """The SamplingTensors over the first `rows` rows (len(params) real, the rest padding) and the step's key."""
        R, pad, n = self.max_rows, rows - len(params), self.max_bias
        configs = [p.config for p in params]
        f, i = self.floats, self.ints
        fv, iv = f[:6 * R].view(6, R)[:, :rows], i[:4 * R].view(4, R)[:, :rows]
        t = SamplingTensors()
        if s.sampled or s.penalized:
            fv.copy_(torch.tensor([[c.temperature for c in configs] + [0.0] * pad,
                                   [c.top_p for c in configs] + [1.0] * pad, [c.min_p for c in configs] + [0.0] * pad,
                                   [c.repetition_penalty for c in configs] + [1.0] * pad,
                                   [c.frequency_penalty for c in configs] + [0.0] * pad,
                                   [c.presence_penalty for c in configs] + [0.0] * pad], dtype=torch.float32),
                     non_blocking=True)
        if s.bias:  # padding entries add 0 to logit (0, 0)
            bias = s.bias + [(0, 0, 0.0)] * (n - len(s.bias))
            f[6 * R:].copy_(torch.tensor([b for _, _, b in bias], dtype=torch.float32), non_blocking=True)
            i[4 * R:].view(2, n).copy_(torch.tensor([[r for r, _, _ in bias], [t for _, t, _ in bias]]),
                                       non_blocking=True)
            t.bias = (i[4 * R:4 * R + n], i[4 * R + n:], f[6 * R:])
        if s.penalized:
            assert seen is not None  # made by the step's sampler
            index = seen.row_index(params, token_ids)
            if pad:
                index = torch.cat([index, index.new_zeros(pad)])
            if self.seen is None or self.counts is None:
                self.seen = torch.zeros(R, self.vocab, dtype=torch.bool, device=self.device)
                self.counts = torch.zeros(R, self.vocab, dtype=torch.int32, device=self.device)
            torch.index_select(seen.mask, 0, index, out=self.seen[:rows])
            torch.index_select(seen.counts, 0, index, out=self.counts[:rows])
            t.repetition_penalty, t.seen = fv[3], self.seen[:rows]
            t.frequency_penalty, t.presence_penalty, t.counts = fv[4], fv[5], self.counts[:rows]
        if s.sampled:
            iv.copy_(torch.tensor([[p.seed_halves[0] for p in params] + [0] * pad,
                                   [p.seed_halves[1] for p in params] + [0] * pad,
                                   [len(ids) for ids in token_ids] + [0] * pad,
                                   [c.top_k or 0 for c in configs] + [0] * pad], dtype=torch.int64), non_blocking=True)
            t.temperature, t.top_p, t.min_p, t.seeds, t.steps, t.top_k = fv[0], fv[1], fv[2], iv[:2], iv[2], iv[3]
            t.filters = s.filters
        return t, (bool(s.bias), s.penalized, s.sampled, s.filters, s.top)


@dataclass
class StaticSample:
    """A static step's sampling, ready to run inside the step (runner.run_sampled): its rows' params, the tensors
    over the bucket's rows, the stages' key (one captured graph per bucket and key) and top."""
    params: list[SamplingParams]
    tensors: SamplingTensors
    key: tuple
    top: int


class Sampler:
    """Samples the engine's steps; keeps the penalties' seen-token rows (`SeenTokens`) across steps and a static
    step's buffers (`StaticSampling`). world: tensor-parallel ranks (rank 0's tokens are broadcast to the others).
    max_bias: the bias entries (logit_bias + min_tokens bans) a static step holds per row of its capacity."""

    MAX_BIAS_PER_ROW = 32

    def __init__(self, world: int = 1):
        self.world = world
        self.seen: SeenTokens | None = None  # made at the first step with a penalty
        self.static: dict[int, StaticSampling] = {}  # capacity (rows) -> buffers: decode, verification steps

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

    def static_step(self, step: ScheduledStep, rows: list[int], eos_token_ids: set[int], capacity: int,
                    bucket: int, vocab: int, device: torch.device) -> StaticSample | None:
        """A static step's sampling over its bucket's `bucket` rows (capacity: the largest bucket's rows; a
        verification step's k + 1 a sequence), to run inside the step; None when the step falls back to
        `sample_step` over its logits (see StaticSampling for when)."""
        sampling = step_rows(step, rows)
        params = sampling.params
        if self.world > 1 or not params or any(_state(seq).grammar is not None for seq in sampling.seqs):
            return None
        settings = row_settings(params, sampling.mask_eos, eos_token_ids, vocab)
        max_bias = self.MAX_BIAS_PER_ROW * capacity
        if len(settings.bias) > max_bias:
            return None
        static = self.static.get(capacity)
        if static is None or static.vocab != vocab:
            static = self.static[capacity] = StaticSampling(capacity, vocab, device, max_bias)
        if settings.penalized and (self.seen is None or self.seen.mask.shape[1] != vocab):
            self.seen = SeenTokens(vocab, device)
        with threads_for(bucket * vocab, PARALLEL_WORK):
            tensors, key = static.fill(bucket, params, sampling.token_ids, settings, self.seen)
        return StaticSample(params, tensors, key, settings.top)

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
        sampled at once (`sample_rows`, the device part a static step runs inside the step).
        The third list holds, for rows whose request asks for top_logprobs = N > 0, a dict of the N most
        likely token ids -> log-probability (most likely first), else None. A row whose logits hold NaN or
        inf anywhere gets token, logprob and top None: its distribution is meaningless. Everything comes
        back to the host in one transfer. Call release() when a request finishes. A step below
        PARALLEL_WORK (rows x vocabulary) samples on one intra-op thread."""
        with threads_for(logits.numel(), PARALLEL_WORK):
            return self._sample(logits, params, token_ids, mask_eos, eos_token_ids, token_bitmask)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                mask_eos: list[bool] | None, eos_token_ids: AbstractSet[int], token_bitmask: torch.Tensor | None
                ) -> tuple[list[int | None], list[float | None], list[dict[int, float] | None]]:
        V = logits.shape[1]
        settings = row_settings(params, mask_eos, eos_token_ids, V)
        tensors = self.sampling_tensors(params, token_ids, settings, V, logits.device)
        if token_bitmask is not None:
            tensors.allowed = token_bitmask.to(logits.device, non_blocking=True)
        return read_rows(sample_rows(logits, tensors, settings.top, self.world), params, settings.top)

    def sampling_tensors(self, params: list[SamplingParams], token_ids: list[list[int]], s: RowSettings, V: int,
                         device: torch.device) -> SamplingTensors:
        """The SamplingTensors of these rows for an eager step; a stage no row uses stays None (greedy steps
        without penalties or biases build nothing but the argmax)."""
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
        t = SamplingTensors()
        if s.bias:
            rows, ids, values = zip(*s.bias)
            t.bias = (tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32))
        if s.penalized:
            if self.seen is None or self.seen.mask.shape[1] != V:
                self.seen = SeenTokens(V, device)
            index = self.seen.row_index(params, token_ids)
            configs = [p.config for p in params]
            if any(p.repetition for p in params):
                t.repetition_penalty = tensor([c.repetition_penalty for c in configs], torch.float32)
                t.seen = self.seen.mask[index]
            if any(p.counted for p in params):
                t.frequency_penalty = tensor([c.frequency_penalty for c in configs], torch.float32)
                t.presence_penalty = tensor([c.presence_penalty for c in configs], torch.float32)
                t.counts = self.seen.counts[index]
        if s.sampled:  # all-greedy steps need none of this: argmax
            configs = [p.config for p in params]
            t.seeds = tensor(list(zip(*(p.seed_halves for p in params))), torch.int64)
            t.steps = tensor([len(ids) for ids in token_ids], torch.int64)
            t.temperature = tensor([c.temperature for c in configs], torch.float32)
            t.top_k = tensor([c.top_k or 0 for c in configs], torch.int64)
            t.top_p = tensor([c.top_p for c in configs], torch.float32)
            if s.min_p:
                t.min_p = tensor([c.min_p for c in configs], torch.float32)
            t.filters = s.filters
        return t

    def release(self, params: SamplingParams) -> None:
        """A request finished: drop what the runner keeps for it (its SeenTokens row)."""
        if self.seen is not None:
            self.seen.release(params)
