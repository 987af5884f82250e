"""Runs one scheduled step on the model: the paged KV cache, the step's tensors, sampling.

prepare() packs the new tokens of a step's sequences into a StepContext (see
tritonq.models.common): sequence i computes token_ids[c_i : c_i + n_i] (c_i its
num_computed_tokens) at positions c_i.., writes their K/V to slot page * block_size + row of its
block table, and attends over c_i + n_i tokens. With static decode on (`use_static_decode`, on
CUDA at load), a decode step of B sequences fills the first rows of buffers allocated once and
runs as the smallest batch bucket holding B (tritonq.engine.cuda_graphs): fixed shapes, no device
value read on the host, and, with CUDA graphs captured, a replay instead of ~10 launches per layer.
Prefill, and decode batches above the largest bucket, run eagerly on tensors built per step.

sample() draws every row's next token in one batched pass (`SamplingTensors`: per-row EOS / stop-id
mask below min_tokens, logit bias, repetition / frequency / presence penalties, each structured-output
row's grammar bitmask, temperature, min-p, top-k, top-p as tensors); only the sampled ids, their
log-probabilities (and the top-N alternatives a request asked for) and whether each row's logits were
finite come back to the host, in one transfer per step. A row's random numbers are a hash of (its request's seed, its
sequence length, vocabulary index) computed with torch integer ops (`sampling_noise`), so a seeded
request draws the same tokens whatever else shares its batch, without a torch.Generator per
request; greedy (temperature 0) is argmax.
Tensor parallel: every rank runs the same steps; rank 0's sampled tokens are broadcast, so all
ranks append the same tokens even where their sampling would differ.
"""
from __future__ import annotations

import itertools
import logging
import dataclasses
from dataclasses import dataclass
from itertools import chain
from types import SimpleNamespace

import numpy as np
import torch

from tritonq.config import MAX_TOP_LOGPROBS, GenerationConfig
from tritonq.distributed import broadcast_from_rank0
from tritonq.engine.compiled import CompiledDecode
from tritonq.engine.cuda_graphs import DecodeGraphs, StaticDecodeInputs, decode_buckets
from tritonq.models.common import StepContext
from tritonq.structured import apply_token_bitmask

log = logging.getLogger(__name__)
CPU_KV_CACHE_GB = 4.0  # the CPU default budget (capped by what max_num_seqs sequences of max_seq_len use)
MASK32 = 0xFFFFFFFF


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
    tritonq.structured; unconstrained rows all ones).
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
        penalty = t.repetition_penalty[:, None]
        logits = torch.where(t.seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if t.counts is not None:  # OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty
        counts = t.counts.to(logits.dtype)
        logits = logits - counts * t.frequency_penalty[:, None] - (counts > 0) * t.presence_penalty[:, None]
    if t.allowed is not None:  # structured outputs: only what each row's grammar allows (last: nothing revives it)
        logits = apply_token_bitmask(logits, t.allowed)
    return logits


def sample_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Next tokens [R] int64 from logits [R, V] float32 with the step's settings t: `process_logits`,
    then greedy rows take the argmax and sampled rows, as vLLM: temperature, min_p (relative to the most
    likely token after temperature), then top-k and top-p over what min_p kept, and a Gumbel-max draw."""
    logits = process_logits(logits, t)
    greedy = logits.argmax(-1)
    if t.noise is None:
        return greedy
    temperature = t.temperature
    x = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if t.min_p is not None:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p) (log 0 = -inf keeps every token)
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + t.min_p.log()[:, None], float("-inf"))
    if t.filters:  # in descending order: top-k keeps values >= the k-th, top-p the smallest prefix reaching p
        V = x.shape[-1]
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        k = torch.where(t.top_k > 0, t.top_k, V).clamp(max=V)
        sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(1, (k - 1)[:, None]), float("-inf"))
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs >= t.top_p[:, None]) & (t.top_p < 1.0)[:, None]
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.where(temperature > 0, (x + t.noise).argmax(-1), greedy)


class ModelRunner:
    """Owns the KV pages of a model (num_blocks blocks of block_size tokens per layer)."""

    def __init__(self, model, num_blocks: int, block_size: int, world: int = 1, max_seq_len: int | None = None):
        self.model, self.device, self.world = model, model.device, world
        self.block_size, self.max_seq_len = block_size, max_seq_len
        # On CUDA the block table always has the width of max_seq_len: the decode kernel's launch config
        # (chosen from the table's capacity) then never changes as sequences grow, so it never recompiles.
        # On CPU the torch reference gathers every page in the table, so there it is as narrow as the step.
        self.table_width = -(-max_seq_len // block_size) if max_seq_len and self.device.type == "cuda" else 0
        self.cache = model.kv_layout.allocate(num_blocks, block_size, model.dtype, model.device)
        self.static: StaticDecodeInputs | None = None  # see use_static_decode
        self.buckets: list[int] = []
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledDecode | None = None
        self.replay_graphs = True  # False: run captured buckets eagerly (benchmarks, checks)
        self.seen: SeenTokens | None = None  # made at the first step with a penalty

    def use_static_decode(self, max_num_seqs: int, cuda_graphs: bool = False, compile: bool = False) -> None:
        """Run decode steps of up to max_num_seqs sequences as fixed-shape batch buckets (see
        tritonq.engine.cuda_graphs) and, with cuda_graphs (CUDA only), capture one graph per bucket now;
        with compile (CPU only), torch.compile each bucket's step on its first use (tritonq.engine.compiled)."""
        if self.max_seq_len is None:
            raise ValueError("static decode needs the runner's max_seq_len (its buffers are sized by it).")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; the model is on {self.device}. "
                             "Pass cuda_graphs=False (CPU runs eagerly).")
        if compile and self.device.type != "cpu":
            raise ValueError(f"compile=True compiles the CPU decode step; the model is on {self.device} "
                             "(CUDA decode runs as CUDA graphs: cuda_graphs=True).")
        self.buckets = decode_buckets(max_num_seqs)
        self.static = StaticDecodeInputs(self.buckets[-1], self.max_seq_len, self.block_size, self.device)
        if cuda_graphs:
            self.graphs = DecodeGraphs(lambda ctx: self.model(ctx, self.cache), self.static, self.buckets)
            self.graphs.capture()
            log.info("CUDA graphs: captured %d decode steps (batch buckets %s) in %.1f s", len(self.buckets),
                     ",".join(map(str, self.buckets)), self.graphs.capture_s)
        if compile:
            self.compiled = CompiledDecode(lambda ctx, cache: self.model(ctx, cache), self.buckets)
            log.info("torch.compile: the decode step compiles once per batch bucket (%s) on its first use",
                     ",".join(map(str, self.buckets)))

    def prepare(self, seqs, num_new_tokens: list[int], is_prefill: bool, logits_for: list[bool | int] | None = None,
                start: list[int] | None = None, proposals: list[list[int]] | None = None) -> StepContext:
        """The StepContext of one step. logits_for[i]: sequence i's last new token gets logits, or an int: its
        last logits_for[i] new tokens do (None: every row of every sequence gets logits). proposals[i]:
        speculative tokens computed after sequence i's token_ids (counted in num_new_tokens[i]; they get
        slots in its reserved lookahead blocks). start[i] (default num_computed_tokens): first position to
        compute; positions below num_computed_tokens are recomputed but not written (their blocks hold them).
        Positions, slots and the block table are computed as numpy arrays over the whole step (no loop
        over tokens or table entries in Python): host time grows slowly with the batch."""
        bs, B = self.block_size, len(seqs)
        tables = [seq.block_table for seq in seqs]
        counts = np.array(num_new_tokens, dtype=np.int64)
        first = np.array([seq.num_computed_tokens for seq in seqs] if start is None else start, dtype=np.int64)
        context = first + counts
        num_blocks = np.fromiter(map(len, tables), dtype=np.int64, count=B)
        short = np.flatnonzero(context > num_blocks * bs)
        if short.size:
            i = int(short[0])
            raise RuntimeError(f"{seqs[i]}: positions up to {context[i] - 1} need more than its {num_blocks[i]} "
                               f"blocks of {bs}; the scheduler must allocate them first.")
        if proposals is not None:
            ids = list(chain.from_iterable(seq.token_ids[c:c + n - len(p)] + p for seq, c, n, p in
                                           zip(seqs, first.tolist(), num_new_tokens, proposals)))
        elif is_prefill:
            ids = list(chain.from_iterable(seq.token_ids[c:c + n] for seq, c, n in
                                           zip(seqs, first.tolist(), num_new_tokens)))
        else:  # one token each, the last one
            ids = [seq.token_ids[c] for seq, c in zip(seqs, first.tolist())]
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        row_of_token = np.repeat(np.arange(B), counts)
        positions = np.arange(cu[-1]) + (first - cu[:-1])[row_of_token]
        width = max(self.table_width, int(num_blocks.max()))
        table = np.full((B, width), -1, dtype=np.int64)
        entries = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(num_blocks.sum()))
        block_start = np.cumsum(num_blocks) - num_blocks
        table_rows = np.repeat(np.arange(B), num_blocks)
        table[table_rows, np.arange(entries.size) - block_start[table_rows]] = entries
        slots = table[row_of_token, positions // bs] * bs + positions % bs
        if start is not None:  # recomputed positions: their KV is in the cache already
            computed = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
            slots[positions < computed[row_of_token]] = -1
        # The step's values, checked once here on the host (models pass them to the kernels unchecked: a
        # per-layer check would cost device reductions and asserts in every layer). cu_seqlens_q rising and
        # q_len <= context_len <= the block table's tokens hold by construction (checked just above).
        capacity = self.cache.num_blocks * bs
        if slots.size and int(slots.max()) >= capacity:
            raise RuntimeError(f"slot {int(slots.max())} is past the KV cache's {self.cache.num_blocks} blocks x "
                               f"{bs} = {capacity} slots: a block table names a block the cache does not have.")
        if (self.static is not None and not is_prefill and B <= self.buckets[-1]
                and (logits_for is None or all(logits_for))):
            bucket = next(b for b in self.buckets if b >= B)
            return self.static.fill(bucket, ids, positions.tolist(), slots.tolist(), context.tolist(), tables)
        rows = None
        if logits_for is not None:  # the last m_i rows of sequence i, in order
            m = np.array(logits_for, dtype=np.int64)
            rows = np.arange(int(m.sum())) + np.repeat(cu[1:] - m - (np.cumsum(m) - m), m)

        def tensor(values, dtype):
            return torch.from_numpy(values).to(device=self.device, dtype=dtype, non_blocking=True)
        return StepContext(input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
                           positions=tensor(positions, torch.int64), slot_mapping=tensor(slots, torch.int64),
                           cu_seqlens_q=tensor(cu, torch.int32), context_lens=tensor(context, torch.int32),
                           block_table=tensor(table, torch.int32),
                           logit_rows=None if rows is None else tensor(rows, torch.int64),
                           is_prefill=is_prefill, max_position=int(context.max()) - 1,
                           num_context_tokens=int(context.sum()),
                           num_context_blocks=int((-(-context // bs)).sum()))

    def run(self, ctx: StepContext) -> torch.Tensor:
        """Logits [R, V] float32 at ctx.logit_rows (every row when None; a padded decode step's real rows)."""
        if ctx.num_seqs is not None:  # a static decode step: replay its bucket's graph, or run it eagerly
            bucket = ctx.input_ids.shape[0]
            if self.graphs is not None and self.replay_graphs:
                logits = self.graphs.replay(bucket)
            elif self.compiled is not None:
                logits = self.compiled(ctx, self.cache)
            else:
                logits = self.model(ctx, self.cache)
            return logits[:ctx.num_seqs].float()
        if ctx.logit_rows is not None and ctx.logit_rows.numel() == 0:  # only unfinished prompt chunks
            last = torch.full((1,), ctx.input_ids.shape[0] - 1, dtype=torch.int64, device=self.device)
            return self.model(StepContext(**{**ctx.__dict__, "logit_rows": last}), self.cache).float()[:0]
        return self.model(ctx, self.cache).float()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
               mask_eos: list[bool] | None = None, eos_token_ids: set[int] = frozenset(),
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
        back to the host in one transfer. Call release() when a request finishes."""
        R, V = logits.shape
        tensors = self.sampling_tensors(params, token_ids, mask_eos, eos_token_ids, V, logits.device)
        if token_bitmask is not None:
            tensors.allowed = token_bitmask.to(logits.device, non_blocking=True)
        tokens = sample_logits(logits, tensors)
        # -1 marks a row with non-finite logits; set before the broadcast so every rank agrees on it
        tokens = torch.where(torch.isfinite(logits).all(-1), tokens, -1)
        if self.world > 1:
            tokens = broadcast_from_rank0(tokens)
        top = min(max(p.top_logprobs for p in params), V) if params else 0
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
                          eos_token_ids: set[int], V: int, device: torch.device) -> SamplingTensors:
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


def prefill_logits(model, token_ids: list[int], block_size: int = 16, last_only: bool = False) -> torch.Tensor:
    """Logits [T, V] (or [1, V] at the last token) of one prefill of token_ids over a throwaway paged
    cache just large enough: a standalone model without an engine (checks, warm-up)."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    seq = SimpleNamespace(token_ids=list(token_ids), num_computed_tokens=0, block_table=list(range(num_blocks)))
    return runner.run(runner.prepare([seq], [len(token_ids)], True, logits_for=[True] if last_only else None))


def kv_cache_blocks(model, *, block_size: int, max_seq_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                    kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.9, world: int = 1,
                    cuda_graphs: bool = False, extra_bytes_per_token: int = 0) -> int:
    """How many KV blocks the cache gets, from memory (see tritonq.load), and a log line saying what they hold.
    extra_bytes_per_token: per-token bytes of a second cache with as many blocks (a speculative draft model's),
    paid from the same budget.

    kv_cache_gb: a byte budget (GiB). Otherwise on CUDA: gpu_memory_utilization x the GPU's memory, less
    what is in use (weights, other processes), the peak of the largest steps (`_free_gpu_bytes`) and, with
    cuda_graphs, the graph pool; on CPU: CPU_KV_CACHE_GB. Both are capped by what max_num_seqs sequences of
    max_seq_len tokens use (more would only hold prefix-cached blocks, at the cost of millions of host-side
    block objects on a large GPU). Ranks agree on the smallest count (identical schedules)."""
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise ValueError(f"kv_cache_gb={kv_cache_gb}; expected a positive number of GiB (or None for the default).")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}; expected a fraction in (0, 1].")
    per_token = model.kv_layout.bytes_per_token(model.dtype) + extra_bytes_per_token
    block_bytes = per_token * block_size
    blocks_per_seq = -(-max_seq_len // block_size)
    needed = max_num_seqs * blocks_per_seq * block_bytes
    cap = f"capped by max_num_seqs={max_num_seqs} x max_seq_len"
    if kv_cache_gb is not None:
        budget, source = kv_cache_gb * 2 ** 30, f"kv_cache_gb={kv_cache_gb}"
        memory = budget  # before the max_num_seqs cap
    elif model.device.type == "cuda":
        free = _free_gpu_bytes(model, block_size, max_seq_len, max_num_seqs, max_num_batched_tokens,
                               gpu_memory_utilization, cuda_graphs)
        budget, memory = min(free, needed), free
        source = f"gpu_memory_utilization={gpu_memory_utilization}: {free / 2 ** 30:.2f} GiB free, {cap}"
    else:
        memory = CPU_KV_CACHE_GB * 2 ** 30
        budget = min(memory, needed)
        source = f"CPU default: {CPU_KV_CACHE_GB:g} GiB at most, {cap}"
    blocks = int(budget // block_bytes)
    if world > 1:
        count = torch.tensor([blocks], device=model.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
        blocks = int(count.item())
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({source}: {budget / 2 ** 30:.3f} GiB for blocks of "
                         f"{block_bytes} bytes = {block_size} tokens x {per_token} bytes); raise "
                         "gpu_memory_utilization / kv_cache_gb or use a smaller model or dtype.")
    log.info("KV cache: %d blocks of %d tokens = %d tokens (%.3f GiB, %s); %.1f sequences of max_seq_len=%d at once",
             blocks, block_size, blocks * block_size, blocks * block_bytes / 2 ** 30, source,
             blocks / blocks_per_seq, max_seq_len)
    layout = model.kv_layout
    if layout.cache_dtype != "auto":  # what the smaller pages buy, before the max_num_seqs cap
        wide = dataclasses.replace(layout, cache_dtype="auto").bytes_per_token(model.dtype) + extra_bytes_per_token
        log.info("KV cache dtype %s: %d bytes per token (%d in %s); the memory holds %.1f sequences of "
                 "max_seq_len=%d, %.1f in %s", layout.cache_dtype, per_token, wide, model.dtype,
                 memory / (blocks_per_seq * block_bytes), max_seq_len,
                 memory / (blocks_per_seq * wide * block_size), model.dtype)
    if blocks < blocks_per_seq:
        log.warning("the KV cache holds %d tokens, fewer than max_seq_len=%d: longer requests will be refused",
                    blocks * block_size, max_seq_len)
    return blocks


def warmup_prompt_lengths(max_num_batched_tokens: int, max_seq_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the largest prefill step the scheduler can build: max_num_batched_tokens tokens in
    prompts of at most max_seq_len tokens (several when max_seq_len is the smaller), at most max_num_seqs."""
    count = min(-(-max_num_batched_tokens // max_seq_len), max_num_seqs)
    tokens = min(max_num_batched_tokens, count * max_seq_len)
    return [tokens // count + (i < tokens % count) for i in range(count)]


# The most expensive sampling a step can ask for (every filter, a penalty): the warm-up measures its memory.
WORST_SAMPLING = SimpleNamespace(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=0,
                                 presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((0, 1.0),),
                                 stop_token_ids=(), top_logprobs=MAX_TOP_LOGPROBS)


def _warmup_peaks(model, block_size: int, max_seq_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> dict[str, int]:
    """Peak bytes allocated above the current use (CUDA's peak counter) by the largest steps, each run once
    over a throwaway cache: "prefill" (`warmup_prompt_lengths` prompts, then their logits sampled),
    "decode" (max_num_seqs sequences through the static decode buckets, forward only: what a captured graph
    keeps in its pool) and "decode sampling" (those logits sampled with every filter and a penalty)."""
    device = model.device
    peaks = {}

    def measure(name, step):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = step()
        torch.cuda.synchronize(device)
        peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated(device) - before)
        return out

    def step(name: str, lengths: list[int], computed: int, static: bool) -> None:
        """One step of len(lengths) sequences of lengths[i] tokens, the first `computed` of them cached."""
        per_seq = -(-max(lengths) // block_size)
        seqs = [SimpleNamespace(token_ids=[0] * n, num_computed_tokens=computed,
                                block_table=list(range(i * per_seq, (i + 1) * per_seq))) for i, n in enumerate(lengths)]
        runner = ModelRunner(model, len(seqs) * per_seq, block_size, max_seq_len=max_seq_len)
        if static:
            runner.use_static_decode(max_num_seqs)  # no graphs: the eager step of the largest bucket
        ctx = runner.prepare(seqs, [n - computed for n in lengths], not static, logits_for=[True] * len(seqs))
        logits = measure(name, lambda: runner.run(ctx))
        # sampling runs while the logits are held: its peak counts them (measured relative to before they existed)
        measure(f"{name} sampling", lambda: runner.sample(logits, [SamplingParams(WORST_SAMPLING)] * len(seqs),
                                                          [seq.token_ids for seq in seqs]))
        peaks[f"{name} sampling"] += logits.numel() * logits.element_size()

    step("prefill", warmup_prompt_lengths(max_num_batched_tokens, max_seq_len, max_num_seqs), 0, static=False)
    step("decode", [2] * max_num_seqs, 1, static=True)
    return peaks


def _free_gpu_bytes(model, block_size: int, max_seq_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                    utilization: float, cuda_graphs: bool) -> float:
    """Bytes for the KV cache: utilization x total memory, less what is used now, the peak of the largest
    step (prefill, or decode with its sampling; measured by `_warmup_peaks`, not guessed) and, with
    cuda_graphs, what the captured graphs keep: their pool holds the largest decode step's intermediates
    and each bucket's logits."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    peaks = _warmup_peaks(model, block_size, max_seq_len, max_num_seqs, max_num_batched_tokens)
    torch.cuda.empty_cache()
    graph_pool = 0
    if cuda_graphs:
        logits_bytes = model.config.vocab_size * torch.empty((), dtype=model.dtype).element_size()
        graph_pool = peaks["decode"] + sum(decode_buckets(max_num_seqs)) * logits_bytes
    free, total = torch.cuda.mem_get_info(device)
    largest = max(peaks.values())
    log.info("KV sizing: the largest step peaks at %.2f GiB (%s); CUDA-graph pool ~%.2f GiB", largest / 2 ** 30,
             ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in peaks.items()), graph_pool / 2 ** 30)
    return total * utilization - (total - free) - largest - graph_pool
