"""Runs one scheduled step on the model: the paged KV cache, the step's tensors, sampling.

prepare() packs the new tokens of a step's sequences into a StepContext (see
tritonq.models.common): sequence i computes token_ids[c_i : c_i + n_i] (c_i its
num_computed_tokens) at positions c_i.., writes their K/V to slot page * block_size + row of its
block table, and attends over c_i + n_i tokens. sample() turns each sequence's logits into its
next token with that request's own settings and torch.Generator, so a seeded request draws the
same tokens whatever else shares its batch; greedy (temperature 0) is argmax.
Tensor parallel: every rank runs the same steps; rank 0's sampled tokens are broadcast, so all
ranks append the same tokens even where their sampling would differ.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tritonq.distributed import broadcast_from_rank0
from tritonq.models.common import StepContext

log = logging.getLogger(__name__)
CPU_KV_CACHE_GB = 4.0  # the CPU default budget (capped by what max_num_seqs sequences of max_seq_len use)


@dataclass
class SamplingParams:
    """One request's sampling settings (a GenerationConfig) and its random generator (None: torch's global one)."""
    config: object
    generator: torch.Generator | None = None


def sample_logits(logits: torch.Tensor, seen: torch.Tensor | None, config, generator: torch.Generator | None
                  ) -> torch.Tensor:
    """Next tokens [B] int64 from logits [B, V] float32; seen [B, V] bool marks prompt + generated tokens
    (needed only with a repetition penalty). config: temperature / top_k / top_p / repetition_penalty."""
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


class ModelRunner:
    """Owns the KV pages of a model (num_blocks blocks of block_size tokens per layer)."""

    def __init__(self, model, num_blocks: int, block_size: int, world: int = 1, max_seq_len: int | None = None):
        self.model, self.device, self.world = model, model.device, world
        self.block_size = block_size
        # On CUDA the block table always has the width of max_seq_len: the decode kernel's launch config
        # (chosen from the table's capacity) then never changes as sequences grow, so it never recompiles.
        # On CPU the torch reference gathers every page in the table, so there it is as narrow as the step.
        self.table_width = -(-max_seq_len // block_size) if max_seq_len and self.device.type == "cuda" else 0
        self.cache = model.kv_layout.allocate(num_blocks, block_size, model.dtype, model.device)

    def prepare(self, seqs, num_new_tokens: list[int], is_prefill: bool, logits_for: list[bool] | None = None,
                start: list[int] | None = None) -> StepContext:
        """The StepContext of one step. logits_for[i]: sequence i's last new token gets logits (None: every
        row of every sequence gets logits). start[i] (default num_computed_tokens): first position to
        compute; positions below num_computed_tokens are recomputed but not written (their blocks hold them)."""
        bs = self.block_size
        ids, positions, slots, cu, context, rows = [], [], [], [0], [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            c = seq.num_computed_tokens if start is None else start[i]
            if c + n > len(seq.block_table) * bs:
                raise RuntimeError(f"{seq}: positions up to {c + n - 1} need more than its "
                                   f"{len(seq.block_table)} blocks of {bs}; the scheduler must allocate them first.")
            ids += seq.token_ids[c:c + n]
            positions += range(c, c + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs if p >= seq.num_computed_tokens else -1 for p in range(c, c + n)]
            cu.append(cu[-1] + n)
            context.append(c + n)
            if logits_for is not None and logits_for[i]:
                rows.append(cu[-1] - 1)
        width = max(self.table_width, *(len(seq.block_table) for seq in seqs))
        table = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
        return StepContext(input_ids=tensor(ids, torch.int64), positions=tensor(positions, torch.int64),
                           slot_mapping=tensor(slots, torch.int64), cu_seqlens_q=tensor(cu, torch.int32),
                           context_lens=tensor(context, torch.int32), block_table=tensor(table, torch.int32),
                           logit_rows=None if logits_for is None else tensor(rows, torch.int64),
                           is_prefill=is_prefill, max_position=max(context) - 1,
                           num_context_tokens=sum(context))

    def run(self, ctx: StepContext) -> torch.Tensor:
        """Logits [R, V] float32 at ctx.logit_rows (every row when None)."""
        if ctx.logit_rows is not None and ctx.logit_rows.numel() == 0:  # only unfinished prompt chunks
            last = torch.full((1,), ctx.input_ids.shape[0] - 1, dtype=torch.int64, device=self.device)
            return self.model(StepContext(**{**ctx.__dict__, "logit_rows": last}), self.cache).float()[:0]
        return self.model(ctx, self.cache).float()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]]
               ) -> tuple[list[int], list[float]]:
        """Each row's next token and its log-probability under the raw logits (before any filter).

        logits [R, V] float32; params[r] the row's request settings; token_ids[r] its prompt + generated
        tokens (the repetition penalty's "seen" set). Greedy rows without a penalty are one argmax."""
        R = logits.shape[0]
        tokens = torch.empty(R, dtype=torch.int64, device=logits.device)
        plain = [r for r, p in enumerate(params) if p.config.temperature == 0 and p.config.repetition_penalty == 1.0]
        if plain:
            index = torch.tensor(plain, device=logits.device)
            tokens[index] = logits[index].argmax(-1)
        for r in sorted(set(range(R)) - set(plain)):  # each with its own generator: independent of the batch
            seen = None
            if params[r].config.repetition_penalty != 1.0:
                seen = torch.zeros(1, logits.shape[1], dtype=torch.bool, device=logits.device)
                seen[0, torch.tensor(token_ids[r], device=logits.device)] = True
            tokens[r] = sample_logits(logits[r:r + 1], seen, params[r].config, params[r].generator)[0]
        if self.world > 1:
            tokens = broadcast_from_rank0(tokens)
        logprobs = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), logprobs.tolist()


def prefill_logits(model, token_ids: list[int], block_size: int = 16, last_only: bool = False) -> torch.Tensor:
    """Logits [T, V] (or [1, V] at the last token) of one prefill of token_ids over a throwaway paged
    cache just large enough: a standalone model without an engine (checks, warm-up)."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    seq = SimpleNamespace(token_ids=list(token_ids), num_computed_tokens=0, block_table=list(range(num_blocks)))
    return runner.run(runner.prepare([seq], [len(token_ids)], True, logits_for=[True] if last_only else None))


def kv_cache_blocks(model, *, block_size: int, max_seq_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                    kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.9, world: int = 1) -> int:
    """How many KV blocks the cache gets, from memory (see tritonq.load), and a log line saying what they hold.

    kv_cache_gb: a byte budget (GiB). Otherwise on CUDA: gpu_memory_utilization x the GPU's memory, less
    what is in use (weights, other processes) and the activation peak of a warm-up prefill of
    max_num_batched_tokens tokens; on CPU: CPU_KV_CACHE_GB, capped by max_num_seqs x max_seq_len tokens
    (more would only hold prefix-cached blocks). Ranks agree on the smallest count (identical schedules)."""
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise ValueError(f"kv_cache_gb={kv_cache_gb}; expected a positive number of GiB (or None for the default).")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}; expected a fraction in (0, 1].")
    per_token = model.kv_layout.bytes_per_token(model.dtype)
    block_bytes = per_token * block_size
    blocks_per_seq = -(-max_seq_len // block_size)
    if kv_cache_gb is not None:
        budget, source = kv_cache_gb * 2 ** 30, f"kv_cache_gb={kv_cache_gb}"
    elif model.device.type == "cuda":
        budget = _free_gpu_bytes(model, block_size, min(max_num_batched_tokens, max_seq_len), gpu_memory_utilization)
        source = f"gpu_memory_utilization={gpu_memory_utilization}"
    else:
        budget = min(CPU_KV_CACHE_GB * 2 ** 30, max_num_seqs * blocks_per_seq * block_bytes)
        source = f"CPU default: {CPU_KV_CACHE_GB:g} GiB at most, capped by max_num_seqs={max_num_seqs} x max_seq_len"
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
    if blocks < blocks_per_seq:
        log.warning("the KV cache holds %d tokens, fewer than max_seq_len=%d: longer requests will be refused",
                    blocks * block_size, max_seq_len)
    return blocks


def _free_gpu_bytes(model, block_size: int, warmup_tokens: int, utilization: float) -> float:
    """Bytes for the KV cache: utilization x total memory, less what is used now and the extra peak of a
    warm-up prefill of warmup_tokens tokens (activations; measured, not guessed)."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    prefill_logits(model, [0] * warmup_tokens, block_size, last_only=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total * utilization - (total - free) - peak
