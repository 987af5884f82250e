"""The decode step at fixed shapes: batch buckets, static input buffers, one CUDA graph per bucket.

A decode step of B sequences runs as the smallest bucket b >= B (`decode_buckets`): its inputs are
the first b rows of buffers allocated once (`StaticDecodeInputs`), filled in place from the host
lists the runner builds, and rows B..b-1 are padding (token 0 at position 0, slot -1: write_kv_slots
skips it, context length 0: decode attention gives it zeros). Every tensor then has a shape fixed by
(b, max_seq_len), launch configs follow that capacity, and the step reads no device value on the
host, so on CUDA it can be captured once per bucket and replayed (`DecodeGraphs`).

Buckets 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs: small batches (latency-bound
decode, where a padded row costs a real fraction of the step's attention and MoE work) get a close
fit; above 8, padding wastes fewer than 8 rows (< 50% at 16, < 12% from 64 up) while the number of
graphs, and with it capture time, stays linear in max_num_seqs (17 graphs for 128) and all of them
share one memory pool, captured largest first so the smaller ones reuse its blocks.

A speculative verification step repeats the same way: every sequence scores its last token and k proposals,
k + 1 query rows each (`StaticDecodeInputs(queries=k + 1)`: fixed cu_seqlens, the varlen prefill attention,
padding sequences of k + 1 rows with context 0, which attend to nothing and write nothing), so it has buckets and
graphs of its own beside the decode step's.

A decode step's sampling runs inside the step too (`DecodeGraphs.replay_sampler`): one more graph per bucket and
sampling stages (tritonq.engine.sampler.StaticSampling), captured at its first use over the bucket's static logits
and the sampler's static buffers, and replayed right after the model's graph: a step is two graph launches and one
read of the sampled rows; a verification step's sampling the same way, with graphs of its own.

A mixed step (prompt chunks beside decodes, or chunks alone) is a static-shape step too, not a piecewise one: its
attention is the varlen prefill kernel, whose grid (query blocks <= T / BLOCK_M + B) and config follow the shapes
alone and whose per-program work table is computed on the device, so the whole step can be captured once its shapes
are fixed. Its total tokens are padded to a token bucket (`mixed_buckets`) and its sequences to that bucket's
sequence capacity, in buffers allocated once (`StaticMixedInputs`): cu_seqlens and context lengths are values
there, not shapes; the padding tokens form one sequence of context 0 (it attends to nothing and writes nothing).
Logits come at one row per sequence slot, the wanted rows first, and the step samples them inside it as a decode
step does (a sampler graph per token bucket and sampling stages; padding rows neutral). It applies to the models
whose prefill reads no host count of the context (CausalLM.static_prefill; not MLA) and have no recurrent state,
to steps of at most the largest bucket's tokens with at most one logits row a sequence (no scoring, no proposals);
any other prefill step runs eagerly.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from tritonq.models.common import StepContext

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a static decode step: 1, 2, 4, 8, 16, 24, ... (multiples of 8), and max_num_seqs
    itself when it is none of these, so that every batch of at most max_num_seqs sequences has one."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r}; expected a positive int.")
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not buckets or buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return buckets


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts with a static mixed step: 8, 16, 32, ... 1024 (powers of two), then every multiple of 1024, and
    max_tokens itself when it is none of these: padding wastes < 50% of the rows (< 12.5% from 8192 up) while the
    graphs, each holding its bucket's logits in the pool, stay few (9 for the default 2048 tokens)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}; expected a positive int (max_num_batched_tokens).")
    buckets = [b for b in (8, 16, 32, 64, 128, 256, 512) if b < max_tokens] + list(range(1024, max_tokens + 1, 1024))
    if not buckets or buckets[-1] != max_tokens:
        buckets.append(max_tokens)
    return buckets


class StaticBlockTable:
    """A block table of `rows` sequences, each table_width pages wide, on the device, and its host copy; a row's host
    copy is rewritten only when its sequence's block list changed, so a step costs one host-to-device copy."""

    def __init__(self, rows: int, table_width: int, device: torch.device):
        self.device_table = torch.full((rows, table_width), -1, dtype=torch.int32, device=device)
        self._host_table = torch.full((rows, table_width), -1, dtype=torch.int32)
        self._host_rows: list[list[int] | None] = [None] * rows  # a copy of the table each host row holds

    def fill(self, tables: list[list[int]], rows: int) -> torch.Tensor:
        """Row i <- tables[i]; rows past len(tables) keep stale pages (their sequences have context 0: none is read).
        Copies the first `rows` rows to the device and returns their view."""
        width = self.device_table.shape[1]
        longest = max(range(len(tables)), key=lambda i: len(tables[i]))
        if len(tables[longest]) > width:
            raise ValueError(f"row {longest} has {len(tables[longest])} blocks; the static block table holds "
                             f"{width} (max_seq_len / block_size).")
        for i, table in enumerate(tables):
            if self._host_rows[i] != table:  # compared by value (a C loop): rewritten only when it changed
                self._host_table[i, len(table):] = -1
                self._host_table[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
                self._host_rows[i] = list(table)
        # A pageable source: copy_ returns once the rows are staged, so the next step may rewrite them.
        self.device_table[:rows].copy_(self._host_table[:rows], non_blocking=True)
        return self.device_table[:rows]


class StaticDecodeInputs:
    """Decode inputs of up to max_batch sequences in buffers allocated once (shapes in StepContext).

    fill() copies one step's host lists into the first `bucket` sequences' rows in place (padding the rest)
    and returns the StepContext of views of those rows. The block table is always table_width =
    ceil(max_seq_len / block_size) pages wide and its host copy is only rewritten for rows whose
    block list changed, so a step costs a few small host-to-device copies. scratch_slot: a hybrid model's
    recurrent-state slot for padding rows (tritonq.engine.state_cache); the step then carries state_slots.
    queries: query rows per sequence, 1 for decode, k + 1 for a speculative verification step (then the step is
    a prefill-attention step whose cu_seqlens are fixed: sequence i's rows are i * queries .. (i + 1) * queries - 1)."""

    def __init__(self, max_batch: int, max_seq_len: int, block_size: int, device: torch.device,
                 scratch_slot: int | None = None, queries: int = 1):
        if not isinstance(queries, int) or queries < 1:
            raise ValueError(f"queries={queries!r}; expected a positive int (1 for decode, k + 1 to verify k "
                             "proposals).")
        self.max_batch, self.max_seq_len, self.device, self.queries = max_batch, max_seq_len, device, queries
        self.scratch_slot = scratch_slot
        self.state_slots = (None if scratch_slot is None else
                            torch.full((max_batch,), scratch_slot, dtype=torch.int64, device=device))
        self.table = StaticBlockTable(max_batch, -(-max_seq_len // block_size), device)
        self.block_table = self.table.device_table
        # input_ids, positions, slots
        self.tokens = torch.zeros(3, max_batch * queries, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # queries rows each: fixed
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * queries

    def context(self, bucket: int, num_seqs: int) -> StepContext:
        """The StepContext of the first `bucket` sequences (num_seqs of them real). max_position is the capacity's
        last position: the rope tables are then sized once, and never rebuilt inside a captured graph. Every row
        gets logits; a model whose prefill step needs num_context_tokens (MLA's expansion) runs no verification
        step here (CausalLM.static_prefill)."""
        rows = bucket * self.queries
        return StepContext(input_ids=self.tokens[0, :rows], positions=self.tokens[1, :rows],
                           slot_mapping=self.tokens[2, :rows], cu_seqlens_q=self.cu_seqlens_q[:bucket + 1],
                           context_lens=self.context_lens[:bucket], block_table=self.block_table[:bucket],
                           logit_rows=None, is_prefill=self.queries > 1, max_position=self.max_seq_len - 1,
                           num_context_tokens=0, num_context_blocks=0, num_seqs=num_seqs,
                           state_slots=None if self.state_slots is None else self.state_slots[:bucket])

    def fill(self, bucket: int, ids: list[int], positions: list[int], slots: list[int], context: list[int],
             tables: list[list[int]], state_slots: list[int] | None = None) -> StepContext:
        """Copy a step's B <= bucket sequences (host ints: queries rows each in ids / positions / slots, one
        entry each in context / tables) into the buffers; sequences B..bucket-1 become padding.
        state_slots: each sequence's recurrent-state slot (hybrid models; padding gets the scratch slot)."""
        B, q = len(context), self.queries
        pad = (bucket - B) * q
        if not 0 < B <= bucket <= self.max_batch:
            raise ValueError(f"a decode step of {B} sequences in a bucket of {bucket}; expected "
                             f"1 <= sequences <= bucket <= {self.max_batch}.")
        if len(ids) != B * q:
            raise ValueError(f"{len(ids)} query rows for {B} sequences; expected {q} each.")
        if max(context) > self.max_seq_len:
            raise ValueError(f"a sequence reaches {max(context)} tokens, past max_seq_len={self.max_seq_len} "
                             "that the static decode buffers were sized for.")
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.int64)
        self.tokens[:, :bucket * q].copy_(host, non_blocking=True)
        self.context_lens[:bucket].copy_(torch.tensor(context + [0] * (bucket - B), dtype=torch.int32),
                                         non_blocking=True)
        if self.state_slots is not None:
            assert state_slots is not None, "a hybrid model's decode step names each row's state slot"
            self.state_slots[:bucket].copy_(torch.tensor(state_slots + [self.scratch_slot] * (bucket - B)),
                                            non_blocking=True)
        self.table.fill(tables, bucket)
        return self.context(bucket, B)

    def padding(self, bucket: int) -> StepContext:
        """The bucket's step with every row padding (what DecodeGraphs warms up and captures: it writes no KV)."""
        self.tokens[:, :bucket * self.queries] = torch.tensor([[0], [0], [-1]], device=self.device)
        self.context_lens[:bucket] = 0
        if self.state_slots is not None and self.scratch_slot is not None:  # both or neither (hybrid models)
            self.state_slots[:bucket] = self.scratch_slot  # the warm-up and captured steps update only the scratch state
        return self.context(bucket, bucket)


class StaticMixedInputs:
    """The inputs of a prefill-attention step (a mixed step: prompt chunks, with or without decodes) of up to
    max_tokens tokens and max_seqs sequences, in buffers allocated once (shapes in StepContext).

    A bucket of t tokens holds capacity(t) = min(t, max_seqs + 1) sequences: a step of T < t tokens has at most
    T <= t - 1 sequences, and one more slot takes the t - T padding tokens (token 0, position 0, slot -1) as a
    sequence of context 0, which attends to nothing and writes nothing; the slots after it have no tokens.
    logit_rows: one per slot, the step's wanted rows first (each sequence's last token, if it samples), then the
    bucket's last row; the step's logits are those first rows (StepContext.num_logits)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_seq_len: int, block_size: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_seq_len, self.device = max_tokens, max_seqs, max_seq_len, device
        slots = self.capacity(max_tokens)
        self.table = StaticBlockTable(slots, -(-max_seq_len // block_size), device)
        # input_ids, positions, slots, logit rows (the first capacity(t) entries of a bucket of t)
        self.tokens = torch.zeros(4, max_tokens, dtype=torch.int64, device=device)
        self.lens = torch.zeros(2, slots + 1, dtype=torch.int32, device=device)  # cu_seqlens_q, context_lens

    def capacity(self, bucket: int) -> int:
        """Sequence slots of a bucket of `bucket` tokens."""
        return min(bucket, self.max_seqs + 1)

    def context(self, bucket: int, num_logits: int) -> StepContext:
        """The StepContext of the first `bucket` tokens and capacity(bucket) sequence slots, num_logits of its logits
        rows wanted. max_position is the capacity's last position (the rope tables are sized once)."""
        slots = self.capacity(bucket)
        return StepContext(input_ids=self.tokens[0, :bucket], positions=self.tokens[1, :bucket],
                           slot_mapping=self.tokens[2, :bucket], cu_seqlens_q=self.lens[0, :slots + 1],
                           context_lens=self.lens[1, :slots], block_table=self.table.device_table[:slots],
                           logit_rows=self.tokens[3, :slots], is_prefill=True, max_position=self.max_seq_len - 1,
                           num_context_tokens=0, num_context_blocks=0, num_logits=num_logits)

    def fill(self, bucket: int, ids: list[int], positions: list[int], slots: list[int], cu_seqlens: list[int],
             context: list[int], tables: list[list[int]], logit_rows: list[int]) -> StepContext:
        """Copy a step's T <= bucket tokens of B sequences (host ints: ids / positions / slots per token,
        cu_seqlens [B + 1], context / tables per sequence, logit_rows: the rows whose logits are wanted, in order)
        into the buffers; the rest of the bucket becomes padding."""
        T, B, capacity = len(ids), len(context), self.capacity(bucket)
        if not 0 < T <= bucket <= self.max_tokens or B + (T < bucket) > capacity:
            raise ValueError(f"a step of {T} tokens in {B} sequences in a bucket of {bucket} tokens; expected "
                             f"1 <= tokens <= bucket <= {self.max_tokens} and at most {capacity} sequences with the "
                             "padding one.")
        if max(context) > self.max_seq_len:
            raise ValueError(f"a sequence reaches {max(context)} tokens, past max_seq_len={self.max_seq_len} "
                             "that the static buffers were sized for.")
        pad = bucket - T
        rows = logit_rows + [bucket - 1] * (bucket - len(logit_rows))
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, rows], dtype=torch.int64)
        self.tokens[:, :bucket].copy_(host, non_blocking=True)
        lens = torch.tensor([cu_seqlens + [bucket] * (capacity - B), context + [0] * (capacity + 1 - B)],
                            dtype=torch.int32)
        self.lens[:, :capacity + 1].copy_(lens, non_blocking=True)
        self.table.fill(tables, capacity)
        return self.context(bucket, len(logit_rows))

    def padding(self, bucket: int) -> StepContext:
        """The bucket's step with every token padding, in the first sequence slot (what DecodeGraphs captures)."""
        self.tokens[:, :bucket] = torch.tensor([[0], [0], [-1], [bucket - 1]], device=self.device)
        self.lens[0, 0], self.lens[0, 1:], self.lens[1] = 0, bucket, 0
        return self.context(bucket, 0)


class DecodeGraphs:
    """One CUDA graph per bucket over static inputs (StaticDecodeInputs: decode or verification steps by batch
    bucket; StaticMixedInputs: mixed steps by token bucket), sharing one memory pool.

    capture() runs each bucket's step eagerly on a side stream (Triton compiles and autotunes, the
    allocator settles), then records it; replay(bucket) re-runs the recorded kernels on whatever the
    buffers hold now and returns that bucket's static logits [rows, V] (a decode bucket's sequences, a verification
    bucket's queries, a mixed bucket's sequence slots; overwritten by the next replay of any bucket: read them
    before)."""

    def __init__(self, forward, inputs: StaticDecodeInputs | StaticMixedInputs, buckets: list[int]):
        self.forward, self.inputs, self.buckets = forward, inputs, sorted(buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.samplers: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, key) -> graph, output
        self.pool: _POOL_HANDLE | None = None  # the graphs' memory pool (made by capture)
        self.capture_s = 0.0

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse the pool's blocks). The buffers
        hold padding meanwhile (context 0, slot -1), so the warm-up and captured steps write no KV."""
        device = self.inputs.device
        start = time.perf_counter()
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        for bucket in sorted(self.buckets, reverse=True):
            ctx = self.inputs.padding(bucket)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up off the capture: compiles, first-call allocations
                for _ in range(2):
                    self.forward(ctx)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bucket] = self.forward(ctx)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(device)
        # The side stream's warm-up blocks stay cached for that stream, which never runs again: give them back.
        torch.cuda.empty_cache()
        self.capture_s = time.perf_counter() - start

    def replay_sampler(self, bucket: int, key: tuple, sample) -> torch.Tensor:
        """Replay the sampling graph of (bucket, key) over the bucket's static logits, capturing it first if this is
        its first use (a warm-up run on a side stream, then the capture, in the graphs' pool); sample(logits) is
        the step's sampling over the sampler's static buffers (Sampler.static_step), the same for every step of
        that key. Returns its static output (overwritten by the next replay)."""
        entry = self.samplers.get((bucket, key))
        if entry is None:
            device = self.inputs.device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                sample(self.logits[bucket])
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = sample(self.logits[bucket])
            entry = self.samplers[(bucket, key)] = (graph, out)
        entry[0].replay()
        return entry[1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest captured bucket holding num_seqs sequences (None: more than the largest)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run bucket's graph on the buffers' current contents; its logits [bucket x queries, V] (a static
        tensor)."""
        self.graphs[bucket].replay()
        return self.logits[bucket]
