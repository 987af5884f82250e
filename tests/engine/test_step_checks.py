"""#34 B7: a step's values are checked once (by the runner, on the host), not in every layer, and the MLA
paths read nothing back from the device and convert no weight per step.

- Models pass write_kv_slots / paged_prefill_attention the step's tensors with check_values=False: the
  slot check (a max and an assert on CUDA) and the prefill consistency check (~8 kernels and an assert)
  are never run per layer, counted over prefill and decode steps of Llama and DeepSeek-V2 (both modes).
- The runner refuses a step whose slot lies past the cache, before the model runs.
- DeepSeek's latent prefill sizes its expanded pages from StepContext.num_context_blocks (a host int),
  so `_expand_context` runs on meta tensors, where any host read raises.
- Absorbed decode keeps W_uk / W_uv in the compute dtype: a bf16 decode converts no [H, Dn, R] /
  [H, R, Dv] tensor and agrees with the fp32 model to bf16's tolerance.
"""
import pytest
import torch
from models.paged import PagedRun
from test_cuda_graphs import deepseek, llama, to_meta

from tritonq.kernels import attention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread
PROMPTS = [[5, 17, 3, 88, 41], [12, 7], [9, 9, 9, 1, 2, 3, 4, 60, 61]]


@pytest.fixture
def value_checks(monkeypatch):
    """Counts of the kernels' value checks (slots, prefill lengths) while a test runs."""
    calls = {"slots": 0, "prefill": 0}
    check_slots, check_prefill = attention._check_slots, attention._check_prefill_lens

    def count(name, check):
        def counted(*args):
            calls[name] += 1
            return check(*args)
        return counted
    monkeypatch.setattr(attention.launch, "_check_slots", count("slots", check_slots))
    monkeypatch.setattr(attention.launch, "_check_prefill_lens", count("prefill", check_prefill))
    return calls


def run_steps(model) -> torch.Tensor:
    """Prefill PROMPTS, then two decode steps (logits [B, V] of the last)."""
    run = PagedRun(model, len(PROMPTS), 32)
    run.prefill(PROMPTS, every_row=False)
    run.decode([3, 4, 5])
    return run.decode([6, 7, 8])


@pytest.mark.parametrize("kind", ["llama", "deepseek-expanded", "deepseek-latent"])
def test_models_run_no_value_check_per_layer(kind, value_checks, monkeypatch, tmp_path_factory, llama_folder):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    model = llama(llama_folder) if kind == "llama" else deepseek(tmp_path_factory, kind.split("-")[1])
    assert len(model.layers) >= 2
    logits = run_steps(model)
    assert torch.isfinite(logits).all()
    assert value_checks == {"slots": 0, "prefill": 0}
    # The checks still run for direct callers of the kernels (the default), with their clear errors.
    pages = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="< num_blocks x block_size = 32"):
        attention.write_kv_slots(pages, pages, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.tensor([32]))
    assert value_checks["slots"] == 1


def test_runner_refuses_a_slot_past_the_cache_before_the_model_runs(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    model = deepseek(tmp_path_factory, "latent", dense_only=True)
    run = PagedRun(model, 1, 32)  # 2 blocks
    run.seqs[0].block_table = [0, 5]  # block 5: the cache has 2
    run.seqs[0].token_ids = list(range(20))
    with pytest.raises(RuntimeError, match="slot 83 is past the KV cache's 2 blocks x 16 = 32 slots"):
        run.runner.prepare(run.seqs, [20], True)


def test_latent_prefill_expansion_reads_nothing_from_the_device(tmp_path_factory, monkeypatch):
    """_expand_context on meta tensors (any host read raises there): its page count comes from the step."""
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    model = deepseek(tmp_path_factory, "latent", dense_only=True)
    run = PagedRun(model, len(PROMPTS), 48)
    run.prefill(PROMPTS, every_row=False)  # cached prefixes of 5, 2 and 9 tokens
    for seq, extra in zip(run.seqs, ([1] * 14, [2] * 20, [3])):
        seq.token_ids += extra  # new tokens crossing block boundaries: 19, 22 and 10 tokens of context
    ctx = run.runner.prepare(run.seqs, [14, 20, 1], True)
    assert ctx.num_context_blocks == 2 + 2 + 1
    attn = model.layers[0].self_attn
    k_cpu, v_cpu, table_cpu = attn._expand_context(run.runner.cache.k[0], ctx)
    memo = {}
    k, v, table = attn._expand_context(to_meta(run.runner.cache, memo).k[0], to_meta(ctx, memo))
    assert k.device.type == "meta" and k.shape == k_cpu.shape == (5, 16, 4, 24) and v.shape == v_cpu.shape
    assert table.shape == table_cpu.shape


def test_absorbed_decode_keeps_the_weights_in_the_compute_dtype(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    reference = run_steps(deepseek(tmp_path_factory, "latent", dense_only=True)).float()
    model = deepseek(tmp_path_factory, "latent", dense_only=True, dtype=torch.bfloat16)
    attn = model.layers[0].self_attn
    assert attn.w_uk.dtype == attn.w_uv_t.dtype == torch.bfloat16
    weight_shapes = {tuple(attn.w_uk.shape), tuple(attn.w_uv_t.shape), tuple(attn.w_uv_t.transpose(1, 2).shape)}
    converted = []
    for name in ("float", "to"):
        method = getattr(torch.Tensor, name)

        def spy(self, *args, _method=method, **kwargs):
            converted.append(tuple(self.shape))
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = run_steps(model)
    assert not weight_shapes & set(converted), "a per-head kv_b matrix is converted in a step"
    # bf16 end to end (weights, activations, KV cache) vs fp32: |logits| ~ 1 here, bf16 keeps 8 bits
    torch.testing.assert_close(logits.float(), reference, atol=5e-2, rtol=5e-2)
