"""#34 B5: the KV cache's size on CUDA, checked on CPU with torch.cuda's memory functions replaced.

- The block count is capped by what max_num_seqs sequences of max_seq_len need, however much is free.
- The warm-up runs the largest real steps: max_num_batched_tokens prompt tokens split into prompts of at
  most max_seq_len, and a decode step of max_num_seqs sequences through the static buckets, each with
  the costliest sampling; the budget subtracts the largest peak and, with CUDA graphs, their pool.
- Graph capture gives its side stream's cached blocks back (empty_cache after the last capture).
"""
from types import SimpleNamespace

import pytest
import torch

from tritonq.config import EngineConfig
from tritonq.engine import kv_sizing
from tritonq.engine.cuda_graphs import DecodeGraphs, StaticDecodeInputs, decode_buckets
from tritonq.engine.kv_sizing import kv_cache_blocks, warmup_prompt_lengths
from tritonq.engine.runner import ModelRunner
from tritonq.engine.sampler import Sampler
from tritonq.models.common import KVLayout

GiB = 2 ** 30


def fake_cuda_model(bytes_per_token: int = 1024):
    """What kv_cache_blocks reads of a model: a device, a KV layout (1 layer, bytes_per_token) and a dtype."""
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16,
                           kv_layout=KVLayout(1, 1, bytes_per_token // 4, bytes_per_token // 4))


def test_cuda_block_count_is_capped_by_the_sequences_it_can_hold(monkeypatch):
    """An H200's ~125 GiB free for a 1 KiB/token model would be ~8 M blocks; 128 x 4096 tokens need 32,768."""
    seen = {}
    monkeypatch.setattr(kv_sizing, "_free_gpu_bytes",
                        lambda model, *args: seen.setdefault("args", args) and 125 * GiB)
    blocks = kv_cache_blocks(fake_cuda_model(), EngineConfig(max_seq_len=4096), cuda_graphs=True)
    assert blocks == 128 * 4096 // 16
    assert seen["args"] == (16, 4096, 128, 2048, 0.9, True)
    # less free memory than the sequences need: the free memory decides
    monkeypatch.setattr(kv_sizing, "_free_gpu_bytes", lambda model, *args: GiB / 4)
    assert kv_cache_blocks(fake_cuda_model(), EngineConfig(max_seq_len=4096)) == GiB // 4 // (16 * 1024)


@pytest.mark.parametrize("tokens, max_seq_len, max_num_seqs, expected", [
    (2048, 4096, 128, [2048]),               # one prompt holds the whole step
    (2048, 512, 128, [512] * 4),             # max_seq_len shorter: several prompts fill the step
    (2048, 600, 128, [512] * 4),             # split evenly, never over max_seq_len
    (1000, 300, 128, [250] * 4),
    (2048, 100, 8, [100] * 8),               # at most max_num_seqs prompts: the step cannot hold more
])
def test_warmup_prompts_are_the_largest_step(tokens, max_seq_len, max_num_seqs, expected):
    lengths = warmup_prompt_lengths(tokens, max_seq_len, max_num_seqs)
    assert lengths == expected and max(lengths) <= max_seq_len and len(lengths) <= max_num_seqs
    assert sum(lengths) == min(tokens, max_num_seqs * max_seq_len)


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """torch.cuda's memory functions as a fake device: steps and sampling "allocate" what the spies say
    (1 KiB per token of a step, 1 MiB per sampled row), 80 GiB total with 20 GiB in use."""
    state = SimpleNamespace(peak=0, steps=[], empty_cache=0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(state, "peak", 0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state.peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(state, "empty_cache", state.empty_cache + 1))
    run, sample = ModelRunner.run, Sampler.sample

    def spy_run(self, ctx):
        state.steps.append((ctx.is_prefill, ctx.cu_seqlens_q.diff().tolist(), ctx.input_ids.shape[0],
                            self.static is not None))
        state.peak = max(state.peak, ctx.input_ids.shape[0] * 1024)
        return run(self, ctx)

    def spy_sample(self, logits, params, token_ids, *args, **kwargs):
        state.peak = max(state.peak, logits.shape[0] * 2 ** 20)
        return sample(self, logits, params, token_ids, *args, **kwargs)
    monkeypatch.setattr(ModelRunner, "run", spy_run)
    monkeypatch.setattr(Sampler, "sample", spy_sample)
    return state


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_warmup_runs_the_largest_steps_and_the_budget_subtracts_them(tiny_llama_model, fake_cuda_memory,
                                                                     cuda_graphs):
    """A real tiny model (on CPU) through the warm-up: a step of 100 tokens in prompts of at most 32 tokens,
    a decode step of 8 sequences (a static bucket of 8); free = 0.9 x 80 - 20 GiB - the largest peak
    - the graph pools (decode peak + every bucket's logits; the mixed steps': prefill peak + their buckets' logits,
    a row per sequence slot: min(tokens, 8 + 1) for the token buckets 8, 16, ... 64, 100)."""
    model = tiny_llama_model.model
    free = kv_sizing._free_gpu_bytes(model, 16, 32, 8, 100, 0.9, cuda_graphs)
    prefill, decode = fake_cuda_memory.steps
    assert prefill == (True, [25, 25, 25, 25], 100, False)
    assert decode == (False, [1] * 8, 8, True)
    logits = lambda rows: rows * model.config.vocab_size * 4  # noqa: E731  float32 logits while sampling
    peaks = {"prefill": 100 * 1024, "prefill sampling": 2 ** 20 + logits(4), "decode": 8 * 1024,
             "decode sampling": 8 * 2 ** 20 + logits(8)}
    row = model.config.vocab_size * model.dtype.itemsize
    graph_pool = 8 * 1024 + sum(decode_buckets(8)) * row + 100 * 1024 + (8 + 9 * 4) * row
    assert free == 0.9 * 80 * GiB - 20 * GiB - max(peaks.values()) - (graph_pool if cuda_graphs else 0)
    assert fake_cuda_memory.empty_cache >= 2  # before (weights' loading leftovers) and after the warm-up


def test_capture_gives_the_side_streams_blocks_back(monkeypatch):
    """DecodeGraphs.capture ends with torch.cuda.empty_cache(), after the last capture (CUDA faked)."""
    import contextlib

    events = []
    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, value in dict(graph_pool_handle=lambda: None, Stream=lambda device: stream,
                            current_stream=lambda device=None: stream, stream=lambda s: contextlib.nullcontext(),
                            CUDAGraph=lambda: object(), synchronize=lambda device=None: None,
                            graph=lambda g, pool=None, stream=None: contextlib.nullcontext(),
                            empty_cache=lambda: events.append("empty_cache")).items():
        monkeypatch.setattr(torch.cuda, name, value)
    inputs = StaticDecodeInputs(4, 32, 16, torch.device("cpu"))
    graphs = DecodeGraphs(lambda ctx: events.append(f"forward {ctx.input_ids.shape[0]}"), inputs, [1, 2, 4])
    graphs.capture()
    assert events[-1] == "empty_cache" and events.count("forward 1") == 3  # 2 warm-ups + the capture
