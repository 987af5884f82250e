"""The compiled CPU decode step (tritonq.engine.compiled) against the eager step, and the CPU default dtype.

Compiled and eager run the same fp32 arithmetic except that inductor fuses the elementwise ops (norms,
rope, SiLU-and-mul) and may sum in another order: logits within TOLERANCE[float32]["model"] of max |logit|
(summation order through two layers), the same greedy tokens. One bucket is compiled in this module
(~30 s of inductor's C++ compiler on a busy 2-core box): marked `compile`.
"""
import logging

import pytest
import torch
from tolerances import TOLERANCE
from torch._dynamo.utils import counters

import tritonq
import tritonq.api.load
from tritonq import GenerationConfig
from tritonq.demo import write_tiny_llama

NEW_TOKENS = 500
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [70, 71]]  # 3 sequences: bucket 4 with one padding row


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("compiled"), hidden_size=64, num_layers=2)


def _load(folder, compile, max_num_seqs=4):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.delenv("TRITONQ_BACKEND", raising=False)
        return tritonq.load(folder, dtype=torch.float32, max_num_seqs=max_num_seqs, max_seq_len=512, compile=compile)


@pytest.mark.compile
def test_compiled_decode_matches_eager_without_recompiling(folder):
    compiled, eager = _load(folder, True), _load(folder, False)
    assert compiled.engine.runner.compiled is not None and eager.engine.runner.compiled is None
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    graphs_before = counters["stats"]["unique_graphs"]
    ours = compiled.generate(PROMPTS, config, return_dict=True)
    # Every decode step ran at bucket 4; it compiled once, on its first use, and never again as the
    # sequences grew from 3..5 to 503..505 tokens.
    assert list(compiled.engine.runner.compiled.compile_s) == [4]
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    reference = eager.generate(PROMPTS, config, return_dict=True)
    assert [len(t) for t in ours.token_ids] == [NEW_TOKENS] * len(PROMPTS)
    assert ours.token_ids == reference.token_ids
    # One more step, compiled and eager on the same inputs (the compiled runner's cache and buffers).
    runner = compiled.engine.runner
    ctx = runner.static.fill(4, [1, 2, 3], [9, 9, 9], [-1, -1, -1], [10, 10, 10], [[0], [40], [80]])
    got, want = runner.compiled(ctx, runner.cache), runner.model(ctx, runner.cache)
    tol = TOLERANCE[torch.float32]["model"] * want.abs().max().item()
    torch.testing.assert_close(got[:3], want[:3], atol=tol, rtol=0)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


@pytest.mark.compile
@pytest.mark.parametrize("num_prompts", [3, 10])
def test_compiled_decode_runs_int4_weights(folder, tmp_path, num_prompts):
    """An AWQ int4 model compiles too (its linears hold their CPU form: the step reads no weak dict), with the
    same tokens as eager and one step's logits within the int4 path's bf16 tolerance. Bucket 4 traces the int4
    kernel into the graph; bucket 16 (above TEMPLATE_ABOVE_M rows) calls the template through an opaque op."""
    from tritonq.quantize.writer import write_quantized
    awq = write_quantized(folder, tmp_path / "awq", "awq", group_size=64)
    compiled, eager = _load(awq, True, max_num_seqs=16), _load(awq, False, max_num_seqs=16)
    prompts = [[5 + 7 * i + j for j in range(2 + i % 4)] for i in range(num_prompts)]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ours = compiled.generate(prompts, config, return_dict=True)
    bucket = 4 if num_prompts == 3 else 16
    assert bucket in compiled.engine.runner.compiled.compile_s
    assert ours.token_ids == eager.generate(prompts, config, return_dict=True).token_ids
    runner = compiled.engine.runner
    rows = list(range(num_prompts))
    ctx = runner.static.fill(bucket, [1 + r for r in rows], [9] * num_prompts, [-1] * num_prompts,
                             [10] * num_prompts, [[r * 4] for r in rows])
    got, want = runner.compiled(ctx, runner.cache), runner.model(ctx, runner.cache)
    # The same int4 products in both; the fused fp32 elementwise ops differ in summation order only, which can move
    # an activation across one bf16 rounding (2^-8) where the int4 linear rounds its input: 2 bf16 ulps.
    tol = TOLERANCE[torch.bfloat16]["int4_gemm"] * want.abs().max().item()
    torch.testing.assert_close(got[:num_prompts], want[:num_prompts], atol=tol, rtol=0)


def test_compile_option_is_checked(folder):
    with pytest.raises(ValueError, match="compile='yes'; expected True, False or None"):
        tritonq.load(folder, compile="yes")


def test_compile_is_off_by_default_on_cpu(folder):
    """A compile per bucket for a small gain (docs/engine.md, tritonq.api.load.CPU_COMPILE): the default runs
    eagerly."""
    assert _load(folder, None).engine.runner.compiled is None


@pytest.mark.parametrize("native", [True, False])
def test_cpu_default_dtype_follows_native_bf16(folder, monkeypatch, caplog, native):
    monkeypatch.setattr(tritonq.api.load, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="tritonq"):
        model = tritonq.load(folder, max_seq_len=32, max_num_seqs=1)
    assert model.model.dtype == (torch.bfloat16 if native else torch.float32)
    assert f"CPU compute dtype: {'bfloat16' if native else 'float32'}" in caplog.text
    assert tritonq.load(folder, dtype="float32", max_seq_len=32, max_num_seqs=1).model.dtype == torch.float32

