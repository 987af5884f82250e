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
        self.table_width = -(-max_seq_len // block_size)
        # input_ids, positions, slots
        self.tokens = torch.zeros(3, max_batch * queries, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_table = torch.full((max_batch, self.table_width), -1, dtype=torch.int32, device=device)
        # queries rows each: fixed
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * queries
        self._host_table = torch.full((max_batch, self.table_width), -1, dtype=torch.int32)
        self._host_rows: list[list[int] | None] = [None] * max_batch  # a copy of the table each host row holds

    def context(self, bucket: int, num_seqs: int) -> StepContext:
        """The StepContext of the first `bucket` sequences (num_seqs of them real). max_position is the capacity's
        last position: the rope tables are then sized once, and never rebuilt inside a captured graph. Every row
        gets logits; a model whose prefill step needs num_context_tokens (MLA's expansion) runs no verification
        step here (CausalLM.static_verification)."""
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
        longest = max(range(B), key=lambda i: len(tables[i]))
        if len(tables[longest]) > self.table_width:
            raise ValueError(f"row {longest} has {len(tables[longest])} blocks; the static block table holds "
                             f"{self.table_width} (max_seq_len={self.max_seq_len}).")
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.int64)
        self.tokens[:, :bucket * q].copy_(host, non_blocking=True)
        self.context_lens[:bucket].copy_(torch.tensor(context + [0] * (bucket - B), dtype=torch.int32),
                                         non_blocking=True)
        if self.state_slots is not None:
            assert state_slots is not None, "a hybrid model's decode step names each row's state slot"
            self.state_slots[:bucket].copy_(torch.tensor(state_slots + [self.scratch_slot] * (bucket - B)),
                                            non_blocking=True)
        for i, table in enumerate(tables):  # padding rows keep stale pages: with context 0 none is read
            if self._host_rows[i] != table:  # compared by value (a C loop): rewritten only when it changed
                self._host_table[i, len(table):] = -1
                self._host_table[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
                self._host_rows[i] = list(table)
        # A pageable source: copy_ returns once the rows are staged, so the next step may rewrite them.
        self.block_table[:bucket].copy_(self._host_table[:bucket], non_blocking=True)
        return self.context(bucket, B)


class DecodeGraphs:
    """One CUDA graph per decode bucket over StaticDecodeInputs, sharing one memory pool.

    capture() runs each bucket's step eagerly on a side stream (Triton compiles and autotunes, the
    allocator settles), then records it; replay(bucket) re-runs the recorded kernels on whatever the
    buffers hold now and returns that bucket's static logits [bucket, V] (overwritten by the next
    replay of any bucket: read them before)."""

    def __init__(self, forward, inputs: StaticDecodeInputs, buckets: list[int]):
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
            ctx = self._padding_context(bucket)
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

    def _padding_context(self, bucket: int) -> StepContext:
        buf = self.inputs
        buf.tokens[:, :bucket * buf.queries] = torch.tensor([[0], [0], [-1]], device=buf.device)
        buf.context_lens[:bucket] = 0
        if buf.state_slots is not None and buf.scratch_slot is not None:  # both or neither (hybrid models)
            buf.state_slots[:bucket] = buf.scratch_slot  # the warm-up and captured steps update only the scratch state
        return buf.context(bucket, bucket)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest captured bucket holding num_seqs sequences (None: more than the largest)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run bucket's graph on the buffers' current contents; its logits [bucket x queries, V] (a static
        tensor)."""
        self.graphs[bucket].replay()
        return self.logits[bucket]
