"""The recurrent-state pool of hybrid models (tritonq.engine.state_cache) on tiny Qwen3.5 / Qwen3-Next checkpoints.

References are transformers' greedy tokens for each prompt alone (fp32 on both sides, ATOL 1e-4 on logprobs, as in
tests/models/test_qwen3_5.py) and, for the static decode step, the same step run unpadded. The slot bookkeeping is
checked on the scheduler alone (no torch).
"""
import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from models.test_llama import hf_greedy
from models.test_llama_family import MAX_LEN, build
from models.test_qwen3_5 import ATOL, write_checkpoint

import tritonq
from tritonq.config import EngineConfig
from tritonq.demo import byte_tokenizer
from tritonq.engine.block_manager import BlockManager
from tritonq.engine.kv_sizing import kv_cache_blocks
from tritonq.engine.runner import ModelRunner
from tritonq.engine.scheduler import Scheduler
from tritonq.engine.sequence import Sequence
from tritonq.engine.state_cache import StateSlots
from tritonq.models.common import RecurrentState

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def assert_solo_tokens(hf, ours, prompts, n):
    """Each prompt's greedy tokens and logprobs from ours (all batched) equal transformers' on it alone."""
    eos = ours.tokenizer.eos_token_id
    expected = [hf_greedy(copy.deepcopy(hf), p, n, eos) for p in prompts]
    got = ours.generate(prompts, max_new_tokens=n, return_dict=True)
    for (tokens, logprobs), got_tokens, got_logprobs in zip(expected, got.token_ids, got.logprobs):
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_preempted_and_chunked_requests_equal_solo_runs(tmp_path, name):
    """Five prompts in a KV cache of 6 blocks with an 8-token step budget: long prompts are prefilled in chunks
    beside running decodes (mixed steps), sequences are preempted (their slot dropped) and re-prefilled from
    position 0; every request still gives transformers' greedy tokens for its prompt alone."""
    hf = write_checkpoint(tmp_path, name)
    per_block = build(tmp_path).kv_layout.bytes_per_token(torch.float32) * 16
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 30, 3, 26, 1)]
    ours = tritonq.load(tmp_path, max_num_seqs=4, max_seq_len=MAX_LEN, max_num_batched_tokens=8,
                        kv_cache_gb=6 * per_block / 2 ** 30 + 5 * build(tmp_path).state_layout.bytes_per_slot(
                            torch.float32) / 2 ** 30)  # the state pool (4 slots + scratch) is paid first
    assert ours.engine.block_manager.num_blocks == 6
    assert_solo_tokens(hf, ours, prompts, 12)
    assert ours.engine.scheduler.num_preemptions > 0
    assert ours.engine.state_slots.num_free == 4  # every slot back


def test_finished_sequence_state_is_zeroed_before_reuse(tmp_path, monkeypatch):
    """One slot: request B reuses the slot request A finished in, which still holds A's state; B's tokens equal
    its solo run. With the zeroing disabled, B starts from A's state and its tokens differ: the test sees it."""
    hf = write_checkpoint(tmp_path, "qwen3_5_text")
    a, b = torch.randint(0, 256, (30,)).tolist(), torch.randint(0, 256, (6,)).tolist()

    def run(zero: bool):
        ours = tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=MAX_LEN)
        ours.generate(a, max_new_tokens=4)
        states = ours.engine.runner.states
        assert ours.engine.state_slots.num_free == 1
        assert states.ssm[0][0].abs().sum() > 0 and states.conv[0][0].abs().sum() > 0  # A's state is left there
        if not zero:
            monkeypatch.setattr(RecurrentState, "zero", lambda self, slots: None)
        return ours.generate(b, max_new_tokens=8, return_dict=True)

    expected, _ = hf_greedy(copy.deepcopy(hf), b, 8, byte_tokenizer().eos_token_id)
    assert run(zero=True).token_ids[0] == expected
    stale = run(zero=False)
    assert stale.token_ids[0] != expected


def test_admission_waits_for_a_free_state_slot():
    """Two state slots and max_num_seqs 4: the third request waits, without a slot, until one finishes; a
    preempted sequence gives its slot back and takes a free one when it resumes."""
    scheduler = Scheduler(BlockManager(16, 16, False), max_num_seqs=4, max_num_batched_tokens=64,
                          state_slots=StateSlots(2))
    seqs = [Sequence(i, [1, 2, 3], 4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    step = scheduler.schedule()
    assert step.seqs == seqs[:2] and [s.state_slot for s in seqs] == [0, 1, None]
    assert list(scheduler.waiting) == [seqs[2]]
    scheduler.postprocess(step, [9, 9])
    scheduler.finish(seqs[0])
    step = scheduler.schedule()
    assert seqs[2] in step.seqs and seqs[2].state_slot == 0 and seqs[0].state_slot is None
    scheduler._preempt(seqs[2])
    assert seqs[2].state_slot is None and scheduler.state_slots.num_free == 1


def test_prefix_caching_is_off_for_hybrid_models_with_one_log_line(tmp_path, caplog):
    write_checkpoint(tmp_path, "qwen3_5_text")
    with caplog.at_level(logging.INFO, logger="tritonq"):
        ours = tritonq.load(tmp_path, max_num_seqs=2, max_seq_len=MAX_LEN, enable_prefix_caching=True)
    assert not ours.engine.block_manager.enable_prefix_caching
    lines = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == 1 and "qwen3_5_text" in lines[0]


def test_speculative_decoding_is_refused_naming_the_model_type(tmp_path):
    write_checkpoint(tmp_path, "qwen3_5_text")
    with pytest.raises(ValueError, match="speculative decoding is not supported for model_type 'qwen3_5_text'"):
        tritonq.load(tmp_path, max_num_seqs=2, max_seq_len=MAX_LEN, speculative={"method": "ngram", "num_tokens": 2})


def test_kv_sizing_pays_for_the_state_pool_first(tmp_path):
    """The blocks of a byte budget are what is left after the pool of max_num_seqs + 1 (scratch) slots, each
    holding, per linear-attention layer, a conv window (W - 1 fp32 values per channel of q, k and v) and a
    delta-rule state (Hv x Dk x Dv fp32), computed here from the config."""
    hf = write_checkpoint(tmp_path, "qwen3_5_text")
    c = hf.config
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    per_slot = 3 * 4 * (conv_dim * (c.linear_conv_kernel_dim - 1) +  # 3 linear layers, 4 bytes a value
                        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)
    block = 1 * 2 * c.num_key_value_heads * c.head_dim * 4 * 16  # 1 full-attention layer, k + v, 16 tokens
    budget = 40 * block + 5 * per_slot + block // 2
    config = EngineConfig(max_seq_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_gb=budget / 2 ** 30)
    blocks = kv_cache_blocks(build(tmp_path), config)
    assert blocks == 40


def test_padding_rows_of_a_static_decode_step_change_nothing(tmp_path):
    """A decode step of 3 sequences in a bucket of 8 (5 padding rows naming the scratch slot) gives the logits and
    the states of the same step unpadded; no slot but the real ones and the scratch is written."""
    write_checkpoint(tmp_path, "qwen3_5_text")
    model = build(tmp_path)
    prompts = [[5, 17, 3, 88, 41], [12, 7], [9, 9, 9, 1, 2, 3, 4, 60, 61]]
    runs = []
    for static in (True, False):
        runner = ModelRunner(model, num_blocks=3 * MAX_LEN // 16, block_size=16, max_seq_len=MAX_LEN,
                             num_state_slots=6)
        if static:
            runner.use_static_decode(max_num_seqs=8)
            runner.buckets = [8]
        seqs = [SimpleNamespace(token_ids=list(p), num_computed_tokens=0, state_slot=2 * b,
                                block_table=list(range(b, 3 * MAX_LEN // 16, 3))) for b, p in enumerate(prompts)]
        runner.run(runner.prepare(seqs, [len(p) for p in prompts], True, logits_for=[True] * 3))
        logits = []
        for token in (11, 12):
            for seq in seqs:
                seq.num_computed_tokens = len(seq.token_ids)
                seq.token_ids.append(token)
            ctx = runner.prepare(seqs, [1] * 3, False, logits_for=[True] * 3)
            assert (ctx.num_seqs is not None) == static
            logits.append(runner.run(ctx))
        runs.append((torch.stack(logits), runner.states))
    (padded, padded_states), (alone, alone_states) = runs
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)  # fp32: only the GEMMs' M differs (8 vs 3)
    for layer in range(len(padded_states.ssm)):
        for slot in (0, 2, 4):
            torch.testing.assert_close(padded_states.ssm[layer][slot], alone_states.ssm[layer][slot], atol=1e-5, rtol=0)
            torch.testing.assert_close(padded_states.conv[layer][slot], alone_states.conv[layer][slot])
        for slot in (1, 3, 5):
            assert not padded_states.ssm[layer][slot].any() and not padded_states.conv[layer][slot].any()


def test_hybrid_decode_step_reads_no_device_value_on_the_host(tmp_path, monkeypatch):
    """The static decode step (a bucket of 4 holding 3) of a hybrid model on the meta device, where .item(),
    .tolist(), nonzero and boolean-mask indexing raise: the model and the deltanet wrappers on their GPU path (the
    kernel launches stubbed: meta tensors have no data) update the conv and delta-rule states at the step's slot
    indices without a host read, so CUDA graphs can capture them (tests/engine/test_cuda_graphs.py's contract)."""
    from test_cuda_graphs import to_meta

    from tritonq.kernels import deltanet
    write_checkpoint(tmp_path, "qwen3_5_text")
    model = build(tmp_path)
    runner = ModelRunner(model, num_blocks=3 * MAX_LEN // 16, block_size=16, max_seq_len=MAX_LEN, num_state_slots=4)
    runner.use_static_decode(max_num_seqs=8)
    seqs = [SimpleNamespace(token_ids=list(p), num_computed_tokens=0, block_table=list(range(b, 3 * MAX_LEN // 16, 3)))
            for b, p in enumerate([[5, 17, 3], [12, 7], [9, 9, 9, 1]])]
    runner.run(runner.prepare(seqs, [len(s.token_ids) for s in seqs], True, logits_for=[True] * 3))
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(7)
    ctx = runner.prepare(seqs, [1] * 3, False, logits_for=[True] * 3)
    assert ctx.input_ids.shape == (4,) and ctx.num_seqs == 3 and ctx.state_slots.tolist() == [0, 1, 2, 4]
    launched = []
    for name in ("conv_launch", "rule_launch", "gated_rms_norm_launch"):
        monkeypatch.setattr(deltanet, name, lambda *args, name=name: lambda: launched.append(name))
    monkeypatch.setattr(deltanet, "backend", lambda x: "triton")
    memo = {}
    logits = to_meta(model, memo)(to_meta(ctx, memo), to_meta(runner.cache, memo))
    assert logits.device.type == "meta" and logits.shape == (4, model.config.vocab_size)
    assert launched == ["conv_launch", "rule_launch", "gated_rms_norm_launch"] * 3  # 3 linear-attention layers
