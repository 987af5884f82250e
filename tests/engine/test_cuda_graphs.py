"""#18: the static-shape, sync-free decode step and its CUDA graphs.

CPU (always): the decode step of Llama and DeepSeek-V2 (both attention modes) runs with every tensor
on the `meta` device, where any host read of a device value raises (and an injected one is shown to);
decode attention's launches are the same for every length up to max_seq_len; a bucket of 8 holding
5 sequences gives the 5 sequences' logits of an unpadded run (Triton kernels through the interpreter);
bucket choice; batched sampling is a pure function of (seed, step) per row.
GPU (`pytest -m gpu`, skipped without CUDA): for each model kind, 64 decode steps replayed through
graphs equal the eager steps bit for bit, with no host sync inside a replayed step.
"""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from models.test_llama import write_checkpoint
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

import tritonq
from tritonq.engine.cuda_graphs import decode_buckets, mixed_buckets
from tritonq.engine.runner import ModelRunner
from tritonq.engine.sampler import SamplingTensors, sample_logits, sampling_noise
from tritonq.formats.registry import get_loader
from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread
MAX_SEQ_LEN, BLOCK = 64, 16
DEEPSEEK = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                max_position_embeddings=256, initializer_range=0.1, n_shared_experts=1, q_lora_rank=None,
                n_routed_experts=4, num_experts_per_tok=2, topk_method="greedy",
                bos_token_id=None, eos_token_id=None, pad_token_id=0)


def deepseek(tmp_path_factory, mode: str, dense_only: bool = False, device="cpu", dtype=torch.float32):
    """A tiny random DeepSeek-V2 (dense_only: every layer a dense MLP, no routed experts)."""
    torch.manual_seed(0)
    config = DeepseekV2Config(**DEEPSEEK, first_k_dense_replace=2 if dense_only else 1)
    folder = tmp_path_factory.mktemp(f"deepseek_{mode}")
    HFDeepseekV2(config).save_pretrained(folder)
    return DeepseekV2ForCausalLM(config, get_loader(folder, dtype, device), dtype, device, attention_mode=mode)


def llama(folder, **options):
    return tritonq.load(folder, max_seq_len=MAX_SEQ_LEN, max_num_seqs=8, **options).model


def replayed_equals_eager(runner: ModelRunner, ctx, what: str) -> torch.Tensor:
    """(CUDA) The step ctx run eagerly, then replayed from its graph with any host sync an error: both finite (NaN !=
    NaN: a non-finite logit, e.g. an fp16 overflow of the random model, shows as what it is) and equal bit for bit.
    Returns the eager logits (the eager run rewrites the step's K/V with the same values: idempotent)."""
    runner.replay_graphs = False
    eager = runner.run(ctx).clone()
    runner.replay_graphs = True
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = runner.run(ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(eager).all() and torch.isfinite(replayed).all(), f"{what} not finite"
    assert torch.equal(replayed, eager), f"{what} differs"
    return eager


def sequences(runner: ModelRunner, prompts: list[list[int]]) -> list[SimpleNamespace]:
    """Sequences over interleaved blocks (never contiguous), prefilled through the runner."""
    per_seq, n = MAX_SEQ_LEN // BLOCK, len(prompts)
    seqs = [SimpleNamespace(token_ids=list(p), num_computed_tokens=0, block_table=list(range(b, n * per_seq, n)))
            for b, p in enumerate(prompts)]
    runner.run(runner.prepare(seqs, [len(p) for p in prompts], True, logits_for=[True] * n))
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
    return seqs


def decode_step(runner: ModelRunner, seqs, tokens: list[int]) -> torch.Tensor:
    """Append one token to each sequence and run its decode step: logits [B, V]."""
    for seq, t in zip(seqs, tokens):
        seq.token_ids.append(t)
    logits = runner.run(runner.prepare(seqs, [1] * len(seqs), False, logits_for=[True] * len(seqs)))
    for seq in seqs:
        seq.num_computed_tokens += 1
    return logits


# ---------------------------------------------------------------------------------------------------
# (a) no host read of a device value: the decode step on the meta device
# ---------------------------------------------------------------------------------------------------

def to_meta(obj, memo: dict):
    """Every tensor reachable from obj (modules, typed weights, rope tables, tuples) moved to `meta` in place
    (shared tensors stay shared); torch.device attributes become meta too. Returns the converted obj."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        memo[id(obj)] = out = obj.to("meta")
        return out
    if isinstance(obj, torch.device):
        return torch.device("meta")
    if isinstance(obj, (list, tuple)):
        out = type(obj)(to_meta(x, memo) for x in obj)
    elif isinstance(obj, dict):
        out = {k: to_meta(v, memo) for k, v in obj.items()}
        obj.clear(), obj.update(out)
        out = obj
    elif isinstance(obj, (torch.nn.Module, SimpleNamespace)) or dataclasses.is_dataclass(obj) or \
            type(obj).__module__.startswith("tritonq"):
        memo[id(obj)] = obj
        for name, value in list(vars(obj).items()):
            object.__setattr__(obj, name, to_meta(value, memo))  # frozen dataclasses too
        return obj
    else:
        return obj
    memo[id(obj)] = out
    return out


def meta_decode_step(model, prompts):
    """Prefill on CPU, then one decode step (a bucket of 4 holding 3) with the model, its KV cache and the
    step's buffers on the meta device; returns the logits (meta)."""
    runner = ModelRunner(model, num_blocks=len(prompts) * MAX_SEQ_LEN // BLOCK, block_size=BLOCK,
                         max_seq_len=MAX_SEQ_LEN)
    runner.use_static_decode(max_num_seqs=8)
    seqs = sequences(runner, prompts)
    for seq in seqs:
        seq.token_ids.append(7)
    ctx = runner.prepare(seqs, [1] * len(seqs), False, logits_for=[True] * len(seqs))
    assert ctx.input_ids.shape == (4,) and ctx.num_seqs == 3  # a padded bucket
    memo = {}
    model, cache, ctx = to_meta(model, memo), to_meta(runner.cache, memo), to_meta(ctx, memo)
    return model(ctx, cache)


def test_llama_decode_step_reads_no_device_value_on_the_host(llama_folder, monkeypatch):
    """On meta tensors .item(), int(t), bool(t), .tolist(), nonzero, boolean-mask indexing and
    repeat_interleave without output_size all raise: a decode step that completes reads none."""
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")  # the CPU path: the torch references
    prompts = [[5, 17, 3, 88, 41], [12, 7], [9, 9, 9, 1, 2, 3, 4, 60, 61]]
    logits = meta_decode_step(llama(llama_folder), prompts)
    assert logits.device.type == "meta" and logits.shape == (4, 258)  # a bucket of 4; the byte tokenizer's vocabulary

    # The same step with one injected host read fails: the test can see one.
    from tritonq.models.common import MLP
    forward = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: forward(self, x) * int(x.sum() > 0))
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta_decode_step(llama(llama_folder), prompts)


@pytest.mark.parametrize("mode", ["expanded", "latent"])
def test_deepseek_decode_step_reads_no_device_value_on_the_host(tmp_path_factory, monkeypatch, mode):
    """MLA decode in both modes on meta tensors. The layers are dense MLPs: on CPU the routed experts run
    per expert on the tokens routed to it (a host read of the routing, eager by design); on CUDA the
    Triton MoE (moe_align_block_size, no host read) is checked under the GPU tests' sync-debug mode."""
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    logits = meta_decode_step(deepseek(tmp_path_factory, mode, dense_only=True), [[5, 17, 3], [12, 7, 33, 2], [4]])
    assert logits.device.type == "meta" and logits.shape == (4, 96)


# ---------------------------------------------------------------------------------------------------
# (b) launch configs follow capacity, not the current length
# ---------------------------------------------------------------------------------------------------

class RecordingSpy:
    """Stands in for a @triton.jit kernel: records the grid and the non-tensor kwargs (constexprs, sizes,
    strides, launch options) of each launch; `common.Launch` passes every argument by keyword."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(
            (tuple(grid), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))


def test_decode_launches_are_the_same_for_every_length_up_to_max_seq_len(llama_folder, monkeypatch):
    """The runner's static decode step has one block-table width whatever the lengths, so decode attention
    launches one kernel config (grid, NUM_SPLITS, blocks) for every length 1..max_seq_len: no recompiles."""
    from tritonq.kernels import attention
    split, merge = RecordingSpy(), RecordingSpy()
    monkeypatch.setattr(attention.launch, "_decode_split_kernel", split)
    monkeypatch.setattr(attention.launch, "_decode_merge_kernel", merge)
    model = llama(llama_folder)
    runner = ModelRunner(model, num_blocks=2 * MAX_SEQ_LEN // BLOCK, block_size=BLOCK, max_seq_len=MAX_SEQ_LEN)
    runner.use_static_decode(max_num_seqs=2)
    k_pages = runner.cache.k[0]
    q = torch.randn(2, 4, k_pages.shape[-1])
    for n in range(1, MAX_SEQ_LEN + 1):
        seqs = [SimpleNamespace(token_ids=[1] * n, num_computed_tokens=n - 1,
                                block_table=list(range(b, 2 * -(-n // BLOCK), 2))) for b in range(2)]
        ctx = runner.prepare(seqs, [1, 1], False, logits_for=[True, True])
        assert ctx.block_table.shape == (2, MAX_SEQ_LEN // BLOCK)
        attention.decode_attention(q, k_pages, runner.cache.v[0], ctx.context_lens, ctx.block_table, 0.1)
    assert len(split.launches) == MAX_SEQ_LEN and len(merge.launches) == MAX_SEQ_LEN
    assert all(launch == split.launches[0] for launch in split.launches)
    assert all(launch == merge.launches[0] for launch in merge.launches)


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert decode_buckets(128) == [1, 2, 4] + list(range(8, 129, 8))
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        decode_buckets(0)


# ---------------------------------------------------------------------------------------------------
# (c) padding: a bucket of 8 holding 5 sequences (Triton kernels through the interpreter)
# ---------------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 3, 88, 41], [12, 7], [9, 9, 9, 1, 2, 3, 4, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [30],
           [44, 45, 46, 47]]


def padded_and_alone(model, steps: int = 2):
    """Logits of `steps` greedy decode steps of PROMPTS run as a bucket of 8 (static decode, 3 padding rows)
    and as a plain batch of 5 (no static decode), each over its own KV cache."""
    runs = []
    for static in (True, False):
        runner = ModelRunner(model, num_blocks=len(PROMPTS) * MAX_SEQ_LEN // BLOCK, block_size=BLOCK,
                             max_seq_len=MAX_SEQ_LEN)
        if static:
            runner.use_static_decode(max_num_seqs=8)
            runner.buckets = [8]  # force the bucket of 8 for 5 sequences
        seqs = sequences(runner, PROMPTS)
        tokens, out = [11, 12, 13, 14, 15], []
        for _ in range(steps):
            logits = decode_step(runner, seqs, tokens)
            assert logits.shape[0] == len(PROMPTS)
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
        runs.append(torch.stack(out))
    return runs


def test_padding_rows_change_nothing_llama(llama_folder):
    padded, alone = padded_and_alone(llama(llama_folder))
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)  # fp32: only the GEMMs' M differs (8 vs 5)


def test_padding_rows_change_nothing_deepseek_latent(tmp_path_factory):
    padded, alone = padded_and_alone(deepseek(tmp_path_factory, "latent"))  # routed experts: padding rows route too
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_static_decode_refuses_what_it_cannot_hold(llama_folder):
    runner = ModelRunner(llama(llama_folder), num_blocks=8, block_size=BLOCK, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        runner.use_static_decode(4, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs the runner's max_seq_len"):
        ModelRunner(runner.model, num_blocks=8, block_size=BLOCK).use_static_decode(4)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        tritonq.load(llama_folder, device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs='yes'; expected True, False or None"):
        tritonq.load(llama_folder, cuda_graphs="yes")


# ---------------------------------------------------------------------------------------------------
# batched sampling
# ---------------------------------------------------------------------------------------------------

def test_sampling_noise_depends_on_seed_and_step_only():
    seeds = torch.tensor([[7, 7, 8], [0, 0, 0]])
    noise = sampling_noise(seeds, torch.tensor([3, 3, 3]), 1000)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    alone = sampling_noise(seeds[:, 2:], torch.tensor([3]), 1000)
    assert torch.equal(alone[0], noise[2])  # the same whatever else is in the batch
    assert not torch.equal(sampling_noise(seeds[:, :1], torch.tensor([4]), 1000)[0], noise[0])
    # Gumbel(0, 1): mean = Euler's gamma 0.5772, variance pi^2 / 6 = 1.645 (over 200k draws)
    big = sampling_noise(torch.tensor([[1], [2]]), torch.tensor([5]), 200_000)
    assert abs(big.mean().item() - 0.5772) < 0.01 and abs(big.var().item() - 1.6449) < 0.03


def test_batched_sampling_follows_the_distribution():
    """Gumbel-max over the hashed noise draws from softmax(logits / T) restricted by top-k / top-p: the
    frequencies over 4000 seeds match the probabilities computed independently."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    n = 4000
    rows = logits.repeat(n, 1)
    seeds = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.int64)])

    def frequencies(temperature, top_k, top_p):
        noise = sampling_noise(seeds, torch.zeros(n, dtype=torch.int64), 6)
        tokens = sample_logits(rows, SamplingTensors(temperature=torch.full((n,), temperature),
                                                     top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p),
                                                     noise=noise, filters=True))
        return torch.bincount(tokens, minlength=6).float() / n

    probs = torch.softmax(logits / 0.7, -1)
    assert (frequencies(0.7, 0, 1.0) - probs).abs().max() < 0.03
    top3 = torch.zeros(6)
    top3[[5, 0, 1]] = torch.softmax(logits[[5, 0, 1]], -1)  # the three largest
    assert (frequencies(1.0, 3, 1.0) - top3).abs().max() < 0.03
    # top_p 0.7 at T=1: sorted probs 0.605, 0.222, ... -> keep {5, 0} (the smallest prefix reaching 0.7)
    top_p = torch.zeros(6)
    top_p[[5, 0]] = torch.softmax(logits[[5, 0]], -1)
    assert (frequencies(1.0, 0, 0.7) - top_p).abs().max() < 0.03
    greedy = sample_logits(rows[:2], SamplingTensors())
    assert greedy.tolist() == [5, 5]


# ---------------------------------------------------------------------------------------------------
# GPU: graphs replay the eager steps bit for bit, without a host sync
# ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
GPU_STEPS, GPU_PROMPTS = 64, [[5, 17, 3, 88, 41], [12, 7], [9, 9, 9, 1, 2, 3, 4, 60, 61]]


def gpu_model(kind: str, tmp_path_factory):
    """(model, max_seq_len) of one kind on CUDA in fp16."""
    if kind.startswith("deepseek"):
        return deepseek(tmp_path_factory, kind.split("_")[1], device="cuda", dtype=torch.float16)
    folder = tmp_path_factory.mktemp(kind)
    write_checkpoint(folder, kv_heads=2, tied=False, bias=True, rope="llama3", hidden=128)
    if kind == "llama_awq":
        from tritonq.quantize.writer import write_quantized
        folder = write_quantized(folder, tmp_path_factory.mktemp("awq"), "awq", group_size=64)
    return tritonq.load(folder, device="cuda", dtype=torch.float16, max_seq_len=128, max_num_seqs=4, kv_cache_gb=0.05,
                        cuda_graphs=False).model


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["llama_dense", "llama_awq", "deepseek_expanded", "deepseek_latent"])
def test_graph_replay_equals_eager_bit_for_bit_without_host_sync(kind, tmp_path_factory):
    model = gpu_model(kind, tmp_path_factory)
    runner = ModelRunner(model, num_blocks=len(GPU_PROMPTS) * 128 // BLOCK, block_size=BLOCK, max_seq_len=128)
    runner.use_static_decode(max_num_seqs=4, cuda_graphs=True)
    assert sorted(runner.graphs.graphs) == [1, 2, 4]
    per_seq = 128 // BLOCK
    seqs = [SimpleNamespace(token_ids=list(p), num_computed_tokens=0,
                            block_table=list(range(b, len(GPU_PROMPTS) * per_seq, len(GPU_PROMPTS))))
            for b, p in enumerate(GPU_PROMPTS)]
    runner.run(runner.prepare(seqs, [len(p) for p in GPU_PROMPTS], True, logits_for=[True] * len(seqs)))
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
    tokens = [1, 2, 3]
    for step in range(GPU_STEPS):
        for seq, t in zip(seqs, tokens):
            seq.token_ids.append(t)
        ctx = runner.prepare(seqs, [1] * 3, False, logits_for=[True] * 3)  # bucket 4: one padding row
        eager = replayed_equals_eager(runner, ctx, f"{kind}: step {step}")
        for seq in seqs:
            seq.num_computed_tokens += 1
        tokens = eager.argmax(-1).tolist()


@pytest.mark.gpu
@needs_cuda
def test_load_captures_graphs_by_default_and_generate_matches_eager(llama_folder, caplog):
    """load() on CUDA captures one graph per bucket, decode and mixed (logged with the time), and generate() through
    them (the prompts' prefill is a mixed step) gives the tokens and log-probabilities of the same model run
    eagerly."""
    with caplog.at_level("INFO", logger="tritonq"):
        model = tritonq.load(llama_folder, device="cuda", dtype=torch.float16, max_seq_len=128, max_num_seqs=12,
                             kv_cache_gb=0.05)
    runner = model.engine.runner
    assert runner.buckets == [1, 2, 4, 8, 12] and sorted(runner.graphs.graphs) == runner.buckets
    assert "CUDA graphs: captured 5 decode steps" in caplog.text
    assert sorted(runner.mixed_graphs.graphs) == runner.mixed_buckets == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert "CUDA graphs: captured 9 mixed steps" in caplog.text
    prompts = [[5, 17, 3], [12, 7, 33, 2, 9], [4], [8, 8, 8, 8, 8, 8, 8]]
    graphed = model.generate(prompts, max_new_tokens=40, return_dict=True)
    runner.replay_graphs = False
    eager = model.generate(prompts, max_new_tokens=40, return_dict=True)
    for run in (graphed, eager):  # NaN != NaN: a non-finite log-probability must show as what it is
        assert all(math.isfinite(p) for row in run.logprobs for p in row), run.logprobs
    assert graphed.token_ids == eager.token_ids and graphed.logprobs == eager.logprobs


def test_static_inputs_are_filled_in_place_and_padded():
    """The buffers keep their storage; padding rows get token 0, position 0, slot -1, context 0; a row's
    block table follows its sequence's list whether that list grew in place or was replaced."""
    from tritonq.engine.cuda_graphs import StaticDecodeInputs
    inputs = StaticDecodeInputs(max_batch=8, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    storage = inputs.tokens.data_ptr(), inputs.block_table.data_ptr(), inputs.context_lens.data_ptr()
    a, b = [3, 9], [4]
    ctx = inputs.fill(4, [7, 8], [20, 5], [9 * 16 + 4, 4 * 16 + 5], [21, 6], [a, b])
    assert ctx.num_seqs == 2 and ctx.input_ids.tolist() == [7, 8, 0, 0] and ctx.positions.tolist() == [20, 5, 0, 0]
    assert ctx.slot_mapping.tolist() == [148, 69, -1, -1] and ctx.context_lens.tolist() == [21, 6, 0, 0]
    assert ctx.block_table[:2].tolist() == [[3, 9, -1, -1], [4, -1, -1, -1]] and ctx.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    a.append(11)          # grown in place (the block manager appends)
    b = [6]               # replaced by a list of the same length (freed and reallocated)
    ctx = inputs.fill(2, [1, 2], [32, 6], [11 * 16, 6 * 16 + 6], [33, 7], [a, b])
    assert ctx.block_table.tolist() == [[3, 9, 11, -1], [6, -1, -1, -1]] and ctx.input_ids.shape == (2,)
    assert (inputs.tokens.data_ptr(), inputs.block_table.data_ptr(), inputs.context_lens.data_ptr()) == storage
    with pytest.raises(ValueError, match="5 blocks; the static block table holds 4"):
        inputs.fill(1, [1], [0], [0], [1], [[0, 1, 2, 3, 4]])


def test_padding_rows_attend_to_nothing_and_write_nothing():
    """A padding row (context length 0, slot -1): decode attention gives it zeros, not NaN, in the kernel
    (interpreter) and the reference alike, and the KV write leaves every page as it was for it."""
    from tritonq.kernels.attention import (decode_attention, decode_attention_reference, write_kv_slots,
                                           write_kv_slots_reference)
    g = torch.Generator().manual_seed(5)
    pages_k, pages_v = torch.randn(4, 16, 2, 24, generator=g), torch.randn(4, 16, 2, 40, generator=g)
    q, lens = torch.randn(3, 4, 24, generator=g), torch.tensor([20, 0, 5], dtype=torch.int32)
    table = torch.tensor([[2, 0], [-1, -1], [3, -1]], dtype=torch.int32)
    for fn in (decode_attention, decode_attention_reference):
        out = fn(q, pages_k, pages_v, lens, table, 0.2)
        assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    before_k, before_v = pages_k.clone(), pages_v.clone()
    for write in (write_kv_slots, write_kv_slots_reference):
        write(pages_k, pages_v, torch.randn(2, 2, 24), torch.randn(2, 2, 40), torch.tensor([-1, -1]))
        assert torch.equal(pages_k, before_k) and torch.equal(pages_v, before_v)


# ---------------------------------------------------------------------------------------------------
# speculative verification steps at fixed shapes: k + 1 = 3 queries a sequence (runner.use_static_decode's
# verify_tokens; engine/cuda_graphs.py)
# ---------------------------------------------------------------------------------------------------

def verification_step(runner: ModelRunner, seqs, proposals: list[list[int]]):
    """The StepContext of a verification step: each sequence scores its last token (which lacks KV) and its
    proposals."""
    counts = [1 + len(p) for p in proposals]
    assert all(seq.num_computed_tokens == len(seq.token_ids) - 1 for seq in seqs)
    return runner.prepare(seqs, counts, True, logits_for=counts, proposals=proposals)


def verify_runner(model, static: bool) -> ModelRunner:
    runner = ModelRunner(model, num_blocks=len(PROMPTS) * MAX_SEQ_LEN // BLOCK, block_size=BLOCK,
                         max_seq_len=MAX_SEQ_LEN)
    if static:
        runner.use_static_decode(max_num_seqs=8, verify_tokens=3)
        runner.buckets = [8]  # 5 sequences in a bucket of 8: 3 padding sequences of 3 rows
    return runner


def test_verification_step_in_a_padded_bucket_equals_the_eager_one(llama_folder):
    """A verification step of 5 sequences x 3 queries as a static bucket of 8 (fixed cu_seqlens, 9 padding rows
    that attend to nothing and write nothing) gives the eager step's logits, and so does the decode step after it
    (the padding wrote no KV); Triton kernels through the interpreter, fp32."""
    model, proposals = llama(llama_folder), [[21, 22], [23, 24], [25, 26], [27, 28], [29, 30]]
    runs = []
    for static in (True, False):
        runner = verify_runner(model, static)
        seqs = sequences(runner, PROMPTS)
        for seq, t in zip(seqs, [11, 12, 13, 14, 15]):
            seq.token_ids.append(t)
        ctx = verification_step(runner, seqs, proposals)
        assert (ctx.num_seqs == 5 and ctx.input_ids.shape == (24,)) if static else ctx.num_seqs is None
        verified = runner.run(ctx)
        assert verified.shape == (15, 258)
        for seq in seqs:  # no proposal accepted: the last token's KV stays, the proposals' is rewritten next
            seq.num_computed_tokens += 1
        runs.append((verified, decode_step(runner, seqs, [p[0] for p in proposals])))
    (static_verified, static_next), (eager_verified, eager_next) = runs
    assert torch.isfinite(static_verified).all()
    torch.testing.assert_close(static_verified, eager_verified, atol=1e-5, rtol=0)
    torch.testing.assert_close(static_next, eager_next, atol=1e-5, rtol=0)


def test_only_uniform_verification_steps_are_static(llama_folder):
    """A sequence with fewer proposals than k, or more sequences than the largest bucket, runs eagerly."""
    runner = verify_runner(llama(llama_folder), static=True)
    seqs = sequences(runner, PROMPTS)
    for seq in seqs:
        seq.token_ids.append(7)
    assert verification_step(runner, seqs, [[1, 2]] * 5).num_seqs == 5
    assert verification_step(runner, seqs, [[1, 2]] * 4 + [[1]]).num_seqs is None
    runner.buckets = [4]
    assert verification_step(runner, seqs, [[1, 2]] * 5).num_seqs is None


def test_verification_step_reads_no_device_value_on_the_host(llama_folder, monkeypatch):
    """The static verification step of Llama on the meta device (as the decode step above, but through the Triton
    launchers with the launches stubbed: the torch reference of prefill attention loops over sequences on the
    host): it completes, so it reads no device value on the host and can be captured."""
    from triton.runtime.interpreter import InterpretedFunction
    model = llama(llama_folder)
    runner = verify_runner(model, static=True)
    runner.buckets = [4]
    seqs = sequences(runner, PROMPTS[:3])
    for seq in seqs:
        seq.token_ids.append(7)
    ctx = verification_step(runner, seqs, [[1, 2]] * 3)
    assert ctx.input_ids.shape == (12,) and ctx.num_seqs == 3
    launched = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kw: launched.append(self))
    memo = {}
    logits = to_meta(model, memo)(to_meta(ctx, memo), to_meta(runner.cache, memo))
    assert logits.device.type == "meta" and logits.shape == (12, 258) and launched


def test_models_whose_prefill_reads_host_counts_refuse_static_verification_and_mixed_steps(tmp_path_factory):
    runner = ModelRunner(deepseek(tmp_path_factory, "latent"), num_blocks=8, block_size=BLOCK, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="runs no fixed-shape prefill-attention step .* leave verify_tokens unset"):
        runner.use_static_decode(4, verify_tokens=3)
    with pytest.raises(ValueError, match="runs no fixed-shape prefill-attention step .* leave mixed_tokens unset"):
        runner.use_static_decode(4, mixed_tokens=64)


# ---------------------------------------------------------------------------------------------------
# mixed steps at fixed shapes: prompt chunks beside decodes, padded to a token bucket (runner.use_static_decode's
# mixed_tokens; engine/cuda_graphs.py StaticMixedInputs)
# ---------------------------------------------------------------------------------------------------

LONG = list(range(100, 140))  # a prompt prefilled in chunks: its first 5 tokens before the mixed step


def test_mixed_buckets():
    assert mixed_buckets(5) == [5]
    assert mixed_buckets(64) == [8, 16, 32, 64]
    assert mixed_buckets(100) == [8, 16, 32, 64, 100]
    assert mixed_buckets(2048) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert mixed_buckets(3000) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    with pytest.raises(ValueError, match="max_tokens=0"):
        mixed_buckets(0)


def mixed_runner(model, static: bool) -> ModelRunner:
    runner = ModelRunner(model, num_blocks=(len(PROMPTS) + 2) * MAX_SEQ_LEN // BLOCK, block_size=BLOCK,
                         max_seq_len=MAX_SEQ_LEN)
    if static:
        runner.use_static_decode(max_num_seqs=8, mixed_tokens=64)
    return runner


def mixed_step(runner: ModelRunner, decodes: int, chunk: int):
    """(decoding sequences, StepContext of the step) for `decodes` of PROMPTS decoding one token each, then LONG's
    next `chunk` tokens after its first 5 (logits only where that chunk ends the prompt) and a new 3-token prompt
    computed whole: the decodes are prefilled first, and LONG's first 5 tokens in a step of their own."""
    seqs = sequences(runner, PROMPTS[:decodes])
    for seq, t in zip(seqs, [11, 12, 13, 14, 15]):
        seq.token_ids.append(t)
    per_seq, first = MAX_SEQ_LEN // BLOCK, len(PROMPTS) * MAX_SEQ_LEN // BLOCK
    long = SimpleNamespace(token_ids=LONG[:5 + chunk] if chunk == 1 else LONG, num_computed_tokens=0,
                           block_table=list(range(first, first + per_seq)))
    assert runner.run(runner.prepare([long], [5], True, logits_for=[False])) is None  # a chunk short of its end
    long.num_computed_tokens = 5
    new = SimpleNamespace(token_ids=[30, 31, 32], num_computed_tokens=0, block_table=[first + per_seq])
    step = seqs + [long, new]
    wanted = [True] * decodes + [long.num_computed_tokens + chunk == len(long.token_ids), True]
    return seqs, runner.prepare(step, [1] * decodes + [chunk, 3], True, logits_for=wanted)


@pytest.mark.parametrize("decodes, chunk", [(1, 1), (3, 3), (5, 17)])
def test_padded_mixed_step_equals_the_eager_one(llama_folder, decodes, chunk):
    """A mixed step of `decodes` decodes, a chunk of `chunk` tokens in the middle of a prompt and a whole new prompt,
    padded to a token bucket (5 -> 8, 9 -> 16, 25 -> 32 tokens: the padding a sequence of its own with context 0),
    gives the eager step's logits, and so does the decode step after it (the padding wrote no KV); Triton kernels
    through the interpreter, fp32."""
    model, runs = llama(llama_folder), []
    for static in (True, False):
        runner = mixed_runner(model, static)
        seqs, ctx = mixed_step(runner, decodes, chunk)
        tokens = decodes + chunk + 3
        if static:
            bucket = next(b for b in (8, 16, 32) if b > tokens)
            assert ctx.num_logits == decodes + 1 + (chunk == 1) and ctx.input_ids.shape == (bucket,)
        else:
            assert ctx.num_logits is None and ctx.input_ids.shape == (tokens,)
        logits = runner.run(ctx)
        assert logits.shape == (decodes + 1 + (chunk == 1), 258)
        for seq in seqs:
            seq.num_computed_tokens += 1
        runs.append((logits, decode_step(runner, seqs, logits[:decodes].argmax(-1).tolist())))
    (static_mixed, static_next), (eager_mixed, eager_next) = runs
    assert torch.isfinite(static_mixed).all() and torch.isfinite(static_next).all()
    torch.testing.assert_close(static_mixed, eager_mixed, atol=1e-5, rtol=0)  # fp32: only the GEMMs' M differs
    torch.testing.assert_close(static_next, eager_next, atol=1e-5, rtol=0)


def test_only_mixed_steps_that_fit_run_at_fixed_shapes(llama_folder):
    """Rows of logits past one a sequence (scoring), or more tokens than the largest bucket, run eagerly; a step of
    only chunks short of their end runs at a bucket and gives no logits."""
    runner = mixed_runner(llama(llama_folder), static=True)
    runner.mixed_buckets = [8, 16]
    seq = SimpleNamespace(token_ids=LONG, num_computed_tokens=0, block_table=list(range(3)))
    assert runner.prepare([seq], [16], True, logits_for=[1]).num_logits == 1
    assert runner.prepare([seq], [17], True, logits_for=[1]).num_logits is None
    assert runner.prepare([seq], [4], True, logits_for=[2]).num_logits is None
    assert runner.prepare([seq], [4], True, logits_for=None).num_logits is None
    ctx = runner.prepare([seq], [4], True, logits_for=[0])
    assert ctx.num_logits == 0 and runner.run(ctx) is None


def test_models_with_recurrent_state_refuse_mixed_steps(tmp_path):
    """A hybrid model's prefill chunks update each sequence's recurrent state: its mixed steps stay eager."""
    from models.test_qwen3_5 import write_checkpoint as write_hybrid
    write_hybrid(tmp_path, "qwen3_5_text")
    runner = ModelRunner(tritonq.load(tmp_path, max_seq_len=MAX_SEQ_LEN, max_num_seqs=4).model, num_blocks=8,
                         block_size=BLOCK, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="keeps recurrent state.* leave mixed_tokens unset"):
        runner.use_static_decode(4, mixed_tokens=64)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_mixed_step_reads_no_device_value_on_the_host(llama_folder, tmp_path_factory, monkeypatch, family):
    """A padded mixed step (3 decodes, a 17-token chunk, a new prompt) of Llama, Qwen3 (qk-norm) and Qwen3-MoE (the
    Triton routing and expert GEMMs) on the meta device, through the Triton launchers with the launches stubbed: it
    completes, so it reads no device value on the host and can be captured."""
    from triton.runtime.interpreter import InterpretedFunction
    if family == "llama":
        model = llama(llama_folder)
    else:
        from models.test_llama_family import write_checkpoint as write_dense
        from models.test_moe_models import write_checkpoint as write_moe
        folder = tmp_path_factory.mktemp(family)
        write_moe(folder, "qwen3_moe") if family == "qwen3_moe" else write_dense(folder, "qwen3_tied")
        model = tritonq.load(folder, max_seq_len=MAX_SEQ_LEN, max_num_seqs=8).model
    runner = mixed_runner(model, static=True)
    _, ctx = mixed_step(runner, 3, 17)
    assert ctx.input_ids.shape == (32,) and ctx.num_logits == 4
    launched = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kw: launched.append(self))
    memo = {}
    logits = to_meta(model, memo)(to_meta(ctx, memo), to_meta(runner.cache, memo))
    assert logits.device.type == "meta" and logits.shape == (9, model.config.vocab_size) and launched  # 9 slots
    if family == "qwen3_moe":  # a step of 4096 tokens routes over a grid and aligns by torch's scans: no host read
        from tritonq.models.moe import SparseMoE
        x = torch.empty(4096, model.config.hidden_size, dtype=model.dtype, device="meta")
        assert isinstance(model.layers[0].mlp, SparseMoE) and model.layers[0].mlp(x).shape == x.shape


def test_mixed_path_gives_the_solo_greedy_runs_under_preemption(llama_folder, monkeypatch):
    """The engine with mixed steps at fixed shapes (torch references, fp32): prompts arrive one per step into a cache
    too small for them all, so steps mix decodes with prefill chunks and sequences are preempted and recomputed;
    every prompt still gives its solo greedy run."""
    from tolerances import assert_greedy_equal, solo_runs, staggered_run
    from tritonq.api.model import GenerationConfig
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    per_token = 2 * 2 * 2 * 16 * 4
    options = dict(max_seq_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    model = tritonq.load(llama_folder, kv_cache_gb=8 * 16 * per_token / 2 ** 30, **options)
    engine = model.engine
    engine.runner.use_static_decode(4, mixed_tokens=32)
    mixed, prepare = [], engine.runner.prepare

    def recording_prepare(*args, **kwargs):
        ctx = prepare(*args, **kwargs)
        if ctx.num_logits is not None:
            mixed.append(ctx.input_ids.shape[0])
        return ctx
    monkeypatch.setattr(engine.runner, "prepare", recording_prepare)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (16 if i % 4 else 7,), generator=g).tolist() for i in range(8)]
    got = staggered_run(engine, prompts, GenerationConfig(max_new_tokens=12))
    assert engine.scheduler.num_preemptions > 0 and len(mixed) > 5 and set(mixed) <= {8, 16, 32}
    plain = tritonq.load(llama_folder, enable_prefix_caching=False, **options)
    assert_greedy_equal(plain, prompts, got, solo_runs(plain, prompts, max_new_tokens=12))


def test_mixed_steps_sample_inside_the_step_as_eager_steps(llama_folder, monkeypatch):
    """Seeded sampling (temperature, top-p, a repetition penalty, top-2 log-probabilities) with mixed steps at fixed
    shapes, their rows sampled inside the step (runner.run_sampled over the bucket's logits), gives the tokens and
    log-probabilities of the same engine with every mixed step eager (torch references, fp32)."""
    from tritonq.api.model import GenerationConfig
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    prompts = [list(range(40 + 7 * i, 60 + 9 * i)) for i in range(5)]  # 20..56 tokens: chunks of a 32-token budget
    config = GenerationConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=11,
                              top_logprobs=2)
    runs, sampled = [], []
    for mixed in (True, False):
        model = tritonq.load(llama_folder, max_seq_len=MAX_SEQ_LEN * 2, max_num_seqs=4, max_num_batched_tokens=32)
        runner = model.engine.runner
        if mixed:
            runner.use_static_decode(4, mixed_tokens=32)
            run_sampled = runner.run_sampled
            monkeypatch.setattr(runner, "run_sampled", lambda ctx, sample: sampled.append(ctx.num_logits) or
                                run_sampled(ctx, sample))
        runs.append(model.generate(prompts, config=config, return_dict=True))
    assert sum(n is not None for n in sampled) >= 3  # mixed steps sampled inside the step
    assert runs[0].token_ids == runs[1].token_ids
    assert [[list(top) for top in row] for row in runs[0].top_logprobs] == \
        [[list(top) for top in row] for row in runs[1].top_logprobs]
    torch.testing.assert_close(torch.tensor(runs[0].logprobs), torch.tensor(runs[1].logprobs), atol=1e-5, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["llama_dense", "llama_awq"])
def test_mixed_graph_replay_equals_eager_bit_for_bit_without_host_sync(kind, tmp_path_factory):
    """Mixed steps (3 decodes beside chunks of 1, 3, 17, ... tokens of a 100-token prompt, then the chunk ending it)
    replayed through their token buckets' graphs equal the same steps run eagerly, bit for bit, with no host sync
    inside a replayed step."""
    model = gpu_model(kind, tmp_path_factory)
    runner = ModelRunner(model, num_blocks=(len(GPU_PROMPTS) + 1) * 128 // BLOCK, block_size=BLOCK, max_seq_len=128)
    runner.use_static_decode(max_num_seqs=4, cuda_graphs=True, mixed_tokens=64)
    assert sorted(runner.mixed_graphs.graphs) == [8, 16, 32, 64]
    per_seq = 128 // BLOCK
    seqs = [SimpleNamespace(token_ids=list(p), num_computed_tokens=0, block_table=list(range(b * per_seq, (b + 1) *
                                                                                              per_seq)))
            for b, p in enumerate(GPU_PROMPTS)]
    runner.run(runner.prepare(seqs, [len(p) for p in GPU_PROMPTS], True, logits_for=[True] * len(seqs)))
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
    long = SimpleNamespace(token_ids=list(range(100)), num_computed_tokens=0,
                           block_table=list(range(3 * per_seq, 4 * per_seq)))
    tokens, chunks = [1, 2, 3], [1, 3, 17, 33, 5, 41]  # 100 tokens: the last chunk ends the prompt
    for step, chunk in enumerate(chunks):
        for seq, t in zip(seqs, tokens):
            seq.token_ids.append(t)
        ends = long.num_computed_tokens + chunk == len(long.token_ids)
        ctx = runner.prepare(seqs + [long], [1, 1, 1, chunk], True, logits_for=[True, True, True, ends])
        assert ctx.num_logits == 3 + ends
        eager = replayed_equals_eager(runner, ctx, f"{kind}: step {step}")
        for seq in seqs:
            seq.num_computed_tokens += 1
        long.num_computed_tokens += chunk
        tokens = eager[:3].argmax(-1).tolist()
