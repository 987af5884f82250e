"""Runs one scheduled step on the model: the paged KV cache, the step's tensors, the forward.

prepare() packs the new tokens of a step's sequences into a StepContext (see
tritonq.models.common): sequence i computes token_ids[c_i : c_i + n_i] (c_i its
num_computed_tokens) at positions c_i.., writes their K/V to slot page * block_size + row of its
block table, and attends over c_i + n_i tokens. With static decode on (`use_static_decode`, on
CUDA at load), a decode step of B sequences fills the first rows of buffers allocated once and
runs as the smallest batch bucket holding B (tritonq.engine.cuda_graphs): fixed shapes, no device
value read on the host, and, with CUDA graphs captured, a replay instead of ~10 launches per layer.
With mixed steps on (`use_static_decode(mixed_tokens=...)`), a prefill-attention step (prompt chunks, beside decodes
or alone) runs the same way at a token bucket (StaticMixedInputs). Scoring steps, uneven verification steps,
decode batches above the largest bucket, and prefill steps of models that cannot run them at fixed shapes run
eagerly on tensors built per step.

A hybrid model's cache also holds its recurrent-state pool (tritonq.engine.state_cache): the step names each
sequence's slot (its `state_slot`; a sequence driven by hand without one uses its row in the step), and a
sequence computing from position 0 has its slot zeroed first.

Sampling is tritonq.engine.sampler's (a static step's runs inside the step: run_sampled), KV cache sizing
tritonq.engine.kv_sizing's.
"""
from __future__ import annotations

import dataclasses
import logging
from itertools import chain
from types import SimpleNamespace

import numpy as np
import torch

from tritonq.engine.compiled import CompiledDecode
from tritonq.engine.cuda_graphs import DecodeGraphs, StaticDecodeInputs, StaticMixedInputs, decode_buckets, mixed_buckets
from tritonq.engine.sampler import PARALLEL_WORK, StaticSample, sample_rows
from tritonq.engine.state_cache import allocate_states
from tritonq.kernels import threads_for
from tritonq.models.common import StepContext

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the KV pages of a model (num_blocks blocks of block_size tokens per layer) and, for a hybrid model,
    the recurrent state of num_state_slots sequences."""

    def __init__(self, model, num_blocks: int, block_size: int, max_seq_len: int | None = None,
                 num_state_slots: int = 1):
        self.model, self.device = model, model.device
        self.block_size, self.max_seq_len = block_size, max_seq_len
        # On CUDA the block table always has the width of max_seq_len: the decode kernel's launch config
        # (chosen from the table's capacity) then never changes as sequences grow, so it never recompiles.
        # On CPU the torch reference gathers every page in the table, so there it is as narrow as the step.
        self.table_width = -(-max_seq_len // block_size) if max_seq_len and self.device.type == "cuda" else 0
        self.cache = model.kv_layout.allocate(num_blocks, block_size, model.dtype, model.device)
        self.states = allocate_states(model, num_state_slots)  # None without recurrent state
        if self.states is not None:
            self.cache = dataclasses.replace(self.cache, state=self.states)
        self.static: StaticDecodeInputs | None = None  # see use_static_decode
        self.verify: StaticDecodeInputs | None = None  # speculative verification steps (k + 1 queries each)
        self.buckets: list[int] = []
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.mixed: StaticMixedInputs | None = None  # mixed steps at token buckets (use_static_decode's mixed_tokens)
        self.mixed_buckets: list[int] = []
        self.mixed_graphs: DecodeGraphs | None = None
        self.compiled: CompiledDecode | None = None
        self.replay_graphs = True  # False: run captured buckets eagerly (benchmarks, checks)

    def use_static_decode(self, max_num_seqs: int, cuda_graphs: bool = False, compile: bool = False,
                          verify_tokens: int | None = None, mixed_tokens: int | None = None) -> None:
        """Run decode steps of up to max_num_seqs sequences as fixed-shape batch buckets (see
        tritonq.engine.cuda_graphs) and, with cuda_graphs (CUDA only), capture one graph per bucket now;
        with compile (CPU only), torch.compile each bucket's step on its first use (tritonq.engine.compiled).
        verify_tokens: k + 1 for speculative decoding with k proposals: verification steps in which every
        sequence scores its last token and k proposals get buckets (and graphs) of their own; other ones run
        eagerly. mixed_tokens: max_num_batched_tokens, for mixed steps (prompt chunks with or without decodes) of up
        to that many tokens at token buckets (and graphs). Both need a model that allows it (`static_prefill`);
        mixed steps also one without recurrent state."""
        if self.max_seq_len is None:
            raise ValueError("static decode needs the runner's max_seq_len (its buffers are sized by it).")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; the model is on {self.device}. "
                             "Pass cuda_graphs=False (CPU runs eagerly).")
        if compile and self.device.type != "cpu":
            raise ValueError(f"compile=True compiles the CPU decode step; the model is on {self.device} "
                             "(CUDA decode runs as CUDA graphs: cuda_graphs=True).")
        for name, value in (("verify_tokens", verify_tokens), ("mixed_tokens", mixed_tokens)):
            if value is not None and not getattr(self.model, "static_prefill", False):
                raise ValueError(f"{type(self.model).__name__} runs no fixed-shape prefill-attention step (its prefill "
                                 f"step reads host counts of the context); leave {name} unset.")
        if mixed_tokens is not None and self.states is not None:
            raise ValueError(f"{type(self.model).__name__} keeps recurrent state, which its prefill chunks update per "
                             "sequence: it runs no fixed-shape mixed step; leave mixed_tokens unset.")
        self.buckets = decode_buckets(max_num_seqs)
        scratch = None if self.states is None else self.states.num_slots - 1  # padding rows' state slot
        self.static = StaticDecodeInputs(self.buckets[-1], self.max_seq_len, self.block_size, self.device, scratch)
        if verify_tokens is not None:
            self.verify = StaticDecodeInputs(self.buckets[-1], self.max_seq_len, self.block_size, self.device,
                                             scratch, queries=verify_tokens)
        if mixed_tokens is not None:
            self.mixed_buckets = mixed_buckets(mixed_tokens)
            self.mixed = StaticMixedInputs(self.mixed_buckets[-1], max_num_seqs, self.max_seq_len, self.block_size,
                                           self.device)
        if cuda_graphs:
            self.graphs = DecodeGraphs(lambda ctx: self.model(ctx, self.cache), self.static, self.buckets)
            self.graphs.capture()
            log.info("CUDA graphs: captured %d decode steps (batch buckets %s) in %.1f s", len(self.buckets),
                     ",".join(map(str, self.buckets)), self.graphs.capture_s)
            if self.verify is not None:
                self.verify_graphs = DecodeGraphs(lambda ctx: self.model(ctx, self.cache), self.verify, self.buckets)
                self.verify_graphs.capture()
                log.info("CUDA graphs: captured %d verification steps of %d queries in %.1f s", len(self.buckets),
                         verify_tokens, self.verify_graphs.capture_s)
            if self.mixed is not None:
                self.mixed_graphs = DecodeGraphs(lambda ctx: self.model(ctx, self.cache), self.mixed, self.mixed_buckets)
                self.mixed_graphs.capture()
                log.info("CUDA graphs: captured %d mixed steps (token buckets %s) in %.1f s", len(self.mixed_buckets),
                         ",".join(map(str, self.mixed_buckets)), self.mixed_graphs.capture_s)
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
        state_slots = None if self.states is None else self._state_slots(seqs, first)
        if (self.static is not None and not is_prefill and B <= self.buckets[-1]
                and (logits_for is None or all(logits_for))):
            bucket = next(b for b in self.buckets if b >= B)
            return self.static.fill(bucket, ids, positions.tolist(), slots.tolist(), context.tolist(), tables,
                                    state_slots)
        q = self.verify.queries if self.verify is not None else 0
        if (self.verify is not None and proposals is not None and start is None and B <= self.buckets[-1] and logits_for is not None
                and all(m == q for m in logits_for) and all(n == q for n in num_new_tokens)):
            # a verification step: every sequence scores its last token and q - 1 proposals
            bucket = next(b for b in self.buckets if b >= B)
            return self.verify.fill(bucket, ids, positions.tolist(), slots.tolist(), context.tolist(), tables,
                                    state_slots)
        T = int(cu[-1])
        if (self.mixed is not None and is_prefill and proposals is None and start is None and logits_for is not None
                and all(m in (0, 1) for m in logits_for) and T <= self.mixed_buckets[-1] and B <= self.mixed.max_seqs):
            # a mixed step: prompt chunks (and decodes), at most one logits row a sequence, its last
            bucket = next(b for b in self.mixed_buckets if b >= T)
            wanted = (cu[1:] - 1)[np.flatnonzero(np.array(logits_for, dtype=bool))]
            return self.mixed.fill(bucket, ids, positions.tolist(), slots.tolist(), cu.tolist(), context.tolist(),
                                   tables, wanted.tolist())
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
                           num_context_blocks=int((-(-context // bs)).sum()),
                           state_slots=None if state_slots is None else torch.tensor(state_slots).to(self.device))

    def run_sampled(self, ctx: StepContext, sample: StaticSample) -> torch.Tensor:
        """A static step (decode, verification or mixed) with its sampling inside the step: `sample_rows`' output
        [rows, 2 + 2 * top] for its real rows (still on the device), over the bucket's logits and the static
        sampling buffers (Sampler.static_step). With CUDA graphs, the bucket's model graph then its sampler graph
        for sample.key (DecodeGraphs.replay_sampler), no host work between; otherwise the same two functions
        eagerly."""
        graphs, bucket = self._static_graphs(ctx)
        logits = self._static_logits(ctx)

        def sample_step(logits: torch.Tensor) -> torch.Tensor:
            return sample_rows(logits.float(), sample.tensors, sample.top)
        if graphs is not None and self.replay_graphs:
            picked = graphs.replay_sampler(bucket, sample.key, sample_step)
        else:
            with threads_for(logits.numel(), PARALLEL_WORK):
                picked = sample_step(logits)
        return picked[:len(sample.params)]

    def _static_graphs(self, ctx: StepContext) -> tuple[DecodeGraphs | None, int]:
        """A static step's graphs (None: not captured) and its bucket in them: a mixed step's token count, else the
        batch."""
        if ctx.num_logits is not None:
            return self.mixed_graphs, ctx.input_ids.shape[0]
        assert ctx.num_seqs is not None, "a static step: decode, verification (is_prefill) or mixed (num_logits)"
        return self.verify_graphs if ctx.is_prefill else self.graphs, ctx.context_lens.shape[0]

    def _static_logits(self, ctx: StepContext) -> torch.Tensor:
        """A static step's logits over its whole bucket (padding rows included): its graph replayed, or the step run
        eagerly (compiled, for a CPU decode step with compile on)."""
        graphs, bucket = self._static_graphs(ctx)
        if graphs is not None and self.replay_graphs:
            return graphs.replay(bucket)
        if self.compiled is not None and not ctx.is_prefill:
            return self.compiled(ctx, self.cache)
        return self.model(ctx, self.cache)

    def _state_slots(self, seqs, first: np.ndarray) -> list[int]:
        """Each sequence's recurrent-state slot (its state_slot, or its row for a sequence driven by hand without
        one); the slots of sequences computing from position 0 are zeroed here: they start from no state."""
        slots = [getattr(seq, "state_slot", i) for i, seq in enumerate(seqs)]
        usable = self.states.num_slots - 1  # the last one is the padding rows' scratch
        bad = next((i for i, s in enumerate(slots) if s is None or not 0 <= s < usable), None)
        if bad is not None:
            raise RuntimeError(f"{seqs[bad]}: recurrent-state slot {slots[bad]} is not one of the pool's {usable}; "
                               "the scheduler must allocate one first.")
        fresh = [s for s, c in zip(slots, first.tolist()) if c == 0]
        if fresh:
            self.states.zero(torch.tensor(fresh, device=self.device))
        return slots

    def run(self, ctx: StepContext) -> torch.Tensor | None:
        """Logits [R, V] float32 at ctx.logit_rows (every row when None; a padded decode step's real rows), or
        None when ctx.logit_rows is empty (only prompt chunks short of their end: their KV is written)."""
        if ctx.num_logits is not None:  # a padded mixed step: its wanted rows come first
            logits = self._static_logits(ctx)
            return logits[:ctx.num_logits].float() if ctx.num_logits else None
        if ctx.num_seqs is not None:  # a padded decode or verification step: its real sequences come first
            rows_per_seq = self.verify.queries if ctx.is_prefill and self.verify is not None else 1
            return self._static_logits(ctx)[:ctx.num_seqs * rows_per_seq].float()
        if ctx.logit_rows is not None and ctx.logit_rows.numel() == 0:  # only unfinished prompt chunks
            last = torch.full((1,), ctx.input_ids.shape[0] - 1, dtype=torch.int64, device=self.device)
            self.model(StepContext(**{**ctx.__dict__, "logit_rows": last}), self.cache)  # models take >= 1 row
            return None
        return self.model(ctx, self.cache).float()


def prefill_logits(model, token_ids: list[int], block_size: int = 16, last_only: bool = False) -> torch.Tensor:
    """Logits [T, V] (or [1, V] at the last token) of one prefill of token_ids over a throwaway paged
    cache just large enough: a standalone model without an engine (checks, warm-up)."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    seq = SimpleNamespace(token_ids=list(token_ids), num_computed_tokens=0, block_table=list(range(num_blocks)))
    logits = runner.run(runner.prepare([seq], [len(token_ids)], True, logits_for=[True] if last_only else None))
    assert logits is not None  # every prefill here asks for logits
    return logits
