"""tritonq.quant.packing: bit layout of pack_int32, pack/unpack round trips, and the AWQ <-> GPTQ
repacks into Int4Weight (formats/awq.py, formats/gptq.py) preserving the dequantized matrix exactly."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonq.formats.awq import awq_to_int4, int4_to_awq
from tritonq.formats.gptq import gptq_to_int4
from tritonq.quant.packing import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_int32, unpack_int32

SETTINGS = settings(max_examples=40, deadline=None)


def test_pack_bit_layout():
    cols = torch.arange(1, 9, dtype=torch.int32)[None]  # values 1..8 in columns 0..7
    as_uint = lambda t: int(t.item()) & 0xFFFFFFFF  # noqa: E731
    assert as_uint(pack_int32(cols, 4, dim=1)) == 0x87654321  # field j (bits 4j..) holds column j
    assert as_uint(pack_int32(cols, 4, dim=1, order=AWQ_ORDER)) == 0x86427531  # field j holds column AWQ_ORDER[j]
    assert as_uint(pack_int32(torch.tensor([[255, 1, 2, 128]]), 8, dim=1)) == 0x800201FF
    assert [AWQ_ORDER[c] for c in AWQ_REVERSE_ORDER] == list(range(8))


@SETTINGS
@given(bits=st.sampled_from([4, 8]), dim=st.sampled_from([0, 1]), awq=st.booleans(),
       words=st.integers(1, 3), other=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, dim, awq, words, other, seed):
    order = AWQ_ORDER if awq and bits == 4 else None
    gen = torch.Generator().manual_seed(seed)
    shape = [other, other]
    shape[dim] = words * 32 // bits
    values = torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.int32)
    packed = pack_int32(values, bits, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == words
    assert torch.equal(unpack_int32(packed, bits, dim, order), values)
    assert torch.equal(pack_int32(unpack_int32(packed, bits, dim, order), bits, dim, order), packed)


def test_pack_rejects_size_not_multiple_of_fields():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_int32(torch.zeros(3, 12, dtype=torch.int32), 4, dim=1)


@SETTINGS
@given(k_groups=st.integers(1, 3), group_size=st.sampled_from([32, 64]), n_packs=st.integers(1, 3),
       v1=st.booleans(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_awq_and_gptq_checkpoints_of_one_matrix_dequantize_identically(k_groups, group_size, n_packs, v1, dtype, seed):
    """The same integer weights and zeros written as AWQ and as GPTQ repack to Int4Weights with the
    same dense matrix, bit for bit, and Int4Weight -> AWQ gives back the AWQ tensors."""
    gen = torch.Generator().manual_seed(seed)
    K, N, G = k_groups * group_size, n_packs * 8, k_groups
    q = torch.randint(0, 16, (K, N), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1 if v1 else 0, 16, (G, N), generator=gen, dtype=torch.int32)  # v1 stores zero - 1
    scales = (torch.rand(G, N, generator=gen) * 0.1 + 1e-3).to(dtype)

    awq = (pack_int32(q, 4, dim=1, order=AWQ_ORDER), pack_int32(zeros, 4, dim=1, order=AWQ_ORDER), scales)
    offset = 1 if v1 else 0
    gptq_qzeros = pack_int32(zeros - offset, 4, dim=1)
    g_idx = torch.arange(K, dtype=torch.int32) // group_size
    from_awq = awq_to_int4(*awq, group_size)
    from_gptq = gptq_to_int4(pack_int32(q, 4, dim=0), gptq_qzeros, scales, g_idx, 4, group_size, sym=False,
                             zero_offset=offset)
    assert from_gptq.g_idx is None  # the trivial g_idx is dropped
    assert torch.equal(from_awq.qweight, from_gptq.qweight)
    assert torch.equal(from_awq.dequantize(), from_gptq.dequantize())
    for got, want in zip(int4_to_awq(from_gptq), awq):
        assert torch.equal(got, want)


def test_int4_to_awq_rejects_act_order():
    q = pack_int32(torch.zeros(64, 8, dtype=torch.int32), 4, dim=0)
    w = gptq_to_int4(q, None, torch.ones(2, 8, dtype=torch.float16), torch.arange(64, dtype=torch.int32).flip(0) // 32,
                     4, 32, sym=True, zero_offset=1)
    with pytest.raises(ValueError, match="g_idx=True"):
        int4_to_awq(w)


def test_gptq_to_int4_rejects_g_idx_beyond_scales():
    q = pack_int32(torch.zeros(64, 8, dtype=torch.int32), 4, dim=0)
    g_idx = torch.arange(64, dtype=torch.int32).flip(0) // 16  # groups 0..3, but scales has 2 rows
    with pytest.raises(ValueError, match=r"values in \[0, 3\], expected \[64\] in \[0, 2\)"):
        gptq_to_int4(q, None, torch.ones(2, 8, dtype=torch.float16), g_idx, 4, 32, sym=True, zero_offset=1)
