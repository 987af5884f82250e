"""KV cache sizing: how many blocks the paged cache gets (`kv_cache_blocks`), from a byte budget or, on
CUDA, from what the GPU has left after the largest steps' measured peaks (`_warmup_peaks`)."""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import torch

from tritonq.engine.cuda_graphs import decode_buckets, mixed_buckets
from tritonq.engine.runner import ModelRunner
from tritonq.config import MAX_TOP_LOGPROBS, EngineConfig, GenerationConfig
from tritonq.engine.sampler import Sampler, SamplingParams
from tritonq.engine.state_cache import is_hybrid, state_pool_bytes

log = logging.getLogger(__name__)
CPU_KV_CACHE_GB = 4.0  # the CPU default budget (capped by what max_num_seqs sequences of max_seq_len use)


def kv_cache_blocks(model, config: EngineConfig, *, world: int = 1, cuda_graphs: bool = False,
                    extra_bytes_per_token: int = 0) -> int:
    """How many KV blocks the cache gets, from memory (see tritonq.load), and a log line saying what they hold.
    config: load's EngineConfig (checked there), its max_seq_len resolved. extra_bytes_per_token: per-token bytes
    of a second cache with as many blocks (a speculative draft model's), paid from the same budget.

    kv_cache_gb: a byte budget (GiB). Otherwise on CUDA: gpu_memory_utilization x the GPU's memory, less
    what is in use (weights, other processes), the peak of the largest steps (`_free_gpu_bytes`) and, with
    cuda_graphs, the graph pool; on CPU: CPU_KV_CACHE_GB. Both are capped by what max_num_seqs sequences of
    max_seq_len tokens use (more would only hold prefix-cached blocks, at the cost of millions of host-side
    block objects on a large GPU). Ranks agree on the smallest count (identical schedules). A hybrid model's
    recurrent-state pool (max_num_seqs sequences, tritonq.engine.state_cache) is paid from the memory first."""
    block_size, max_seq_len, max_num_seqs = config.block_size, config.max_seq_len, config.max_num_seqs
    kv_cache_gb, gpu_memory_utilization = config.kv_cache_gb, config.gpu_memory_utilization
    assert max_seq_len is not None, "load resolves max_seq_len before the cache is sized"
    per_token = model.kv_layout.bytes_per_token(model.dtype) + extra_bytes_per_token
    block_bytes = per_token * block_size
    blocks_per_seq = -(-max_seq_len // block_size)
    needed = max_num_seqs * blocks_per_seq * block_bytes
    cap = f"capped by max_num_seqs={max_num_seqs} x max_seq_len"
    states = state_pool_bytes(model, max_num_seqs)
    if kv_cache_gb is not None:
        budget, source = kv_cache_gb * 2 ** 30, f"kv_cache_gb={kv_cache_gb}"
        budget -= states
        memory = budget  # before the max_num_seqs cap
    elif model.device.type == "cuda":
        free = _free_gpu_bytes(model, block_size, max_seq_len, max_num_seqs, config.max_num_batched_tokens,
                               gpu_memory_utilization, cuda_graphs)
        free -= states
        budget, memory = min(free, needed), free
        source = f"gpu_memory_utilization={gpu_memory_utilization}: {free / 2 ** 30:.2f} GiB free, {cap}"
    else:
        memory = CPU_KV_CACHE_GB * 2 ** 30 - states
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
    if states:
        log.info("recurrent state: %d sequences x %d bytes = %.3f GiB beside the KV cache", max_num_seqs,
                 model.state_layout.bytes_per_slot(model.dtype), states / 2 ** 30)
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
WORST_SAMPLING = GenerationConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=0,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((0, 1.0),),
                                  top_logprobs=MAX_TOP_LOGPROBS)


def _warmup_peaks(model, block_size: int, max_seq_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> dict[str, int]:
    """Peak bytes allocated above the current use (CUDA's peak counter) by the largest steps, each run once
    over a throwaway cache: "prefill" (`warmup_prompt_lengths` prompts, then their logits sampled),
    "decode" (max_num_seqs sequences through the static decode buckets, forward only: what a captured graph
    keeps in its pool) and "decode sampling" (those logits sampled with every filter and a penalty)."""
    device = model.device
    peaks: dict[str, int] = {}

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
        runner = ModelRunner(model, len(seqs) * per_seq, block_size, max_seq_len=max_seq_len,
                             num_state_slots=len(seqs))
        if static:
            runner.use_static_decode(max_num_seqs)  # no graphs: the eager step of the largest bucket
        ctx = runner.prepare(seqs, [n - computed for n in lengths], not static, logits_for=[True] * len(seqs))
        logits = measure(name, lambda: runner.run(ctx))
        # sampling runs while the logits are held: its peak counts them (measured relative to before they existed)
        measure(f"{name} sampling", lambda: Sampler().sample(logits, [SamplingParams(WORST_SAMPLING)] * len(seqs),
                                                          [seq.token_ids for seq in seqs]))
        peaks[f"{name} sampling"] += logits.numel() * logits.element_size()

    step("prefill", warmup_prompt_lengths(max_num_batched_tokens, max_seq_len, max_num_seqs), 0, static=False)
    step("decode", [2] * max_num_seqs, 1, static=True)
    return peaks


def _free_gpu_bytes(model, block_size: int, max_seq_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                    utilization: float, cuda_graphs: bool) -> float:
    """Bytes for the KV cache: utilization x total memory, less what is used now, the peak of the largest
    step (prefill, or decode with its sampling; measured by `_warmup_peaks`, not guessed) and, with
    cuda_graphs, what the captured graphs keep: their pools hold the largest decode step's intermediates and, where
    mixed steps are captured too (a model with static_prefill and no recurrent state, as tritonq.load decides),
    the largest prefill step's, and each bucket's logits (a mixed bucket's: one row per sequence slot)."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    peaks = _warmup_peaks(model, block_size, max_seq_len, max_num_seqs, max_num_batched_tokens)
    torch.cuda.empty_cache()
    graph_pool = 0
    if cuda_graphs:
        logits_bytes = model.config.vocab_size * torch.empty((), dtype=model.dtype).element_size()
        graph_pool = peaks["decode"] + sum(decode_buckets(max_num_seqs)) * logits_bytes
        if getattr(model, "static_prefill", False) and not is_hybrid(model):  # the mixed steps' graphs
            slots = [min(b, max_num_seqs + 1) for b in mixed_buckets(max_num_batched_tokens)]
            graph_pool += peaks["prefill"] + sum(slots) * logits_bytes
    free, total = torch.cuda.mem_get_info(device)
    largest = max(peaks.values())
    log.info("KV sizing: the largest step peaks at %.2f GiB (%s); CUDA-graph pool ~%.2f GiB", largest / 2 ** 30,
             ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in peaks.items()), graph_pool / 2 ** 30)
    return total * utilization - (total - free) - largest - graph_pool
