"""Linear's weight layout: fp32 CPU dense weights are stored [K, N] (faster decode GEMV), same values."""
import torch

from tritonq.formats.layers import Linear
from tritonq.quant.weights import DenseWeight


def test_cpu_fp32_dense_weight_is_stored_k_major_with_the_same_values():
    w, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(2, 3, 32)
    linear = Linear(DenseWeight(w, bias))
    assert linear.weight.weight.shape == (48, 32) and linear.weight.weight.t().is_contiguous()
    assert torch.equal(linear.weight.weight, w)
    torch.testing.assert_close(linear(x), x @ w.T + bias)


def test_half_precision_dense_weight_keeps_its_layout():
    w = torch.randn(48, 32).bfloat16()
    assert Linear(DenseWeight(w)).weight.weight.data_ptr() == w.data_ptr()


def test_tied_embedding_and_lm_head_share_one_table(tmp_path):
    import tritonq
    from tritonq.demo import write_tiny_llama

    model = tritonq.load(write_tiny_llama(tmp_path, hidden_size=64, num_layers=1), device="cpu", max_num_seqs=1,
                         max_seq_len=16).model
    assert model.embed_tokens.weight.data_ptr() == model.lm_head.weight.weight.data_ptr()
    ids = torch.tensor([[3, 7, 250]])
    expected = torch.nn.functional.embedding(ids, model.lm_head.weight.weight.contiguous())
    assert torch.equal(model.embed_tokens(ids), expected)
