"""GGUF block formats: tritonq's torch dequantization (formats/gguf.py) equals the gguf package's reference
(gguf.quants.dequantize) bit for bit in fp32, on random blocks whose scales span the fp16 range (subnormals,
the largest finite values, both signs) and whose codes take every value."""
import numpy as np
import pytest
import torch

import gguf  # noqa: E402  (a tritonq dependency: never skipped)

from tritonq.formats.gguf import BLOCK_FORMATS, dequantize  # noqa: E402

QUANTIZED = [t for t in BLOCK_FORMATS if t not in ("F32", "F16", "BF16")]

# byte offsets of each format's fp16 scales (d, and dmin / m where the format has one)
SCALE_BYTES = {"Q2_K": [80, 82], "Q3_K": [108], "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
EXTREME_F16 = np.array([6.1e-5, -6.1e-5, 5.96e-8, -5.96e-8, 65504.0, -65504.0, 1.0, -0.0, 0.0, 3.14, 1e-3, 2.5e4],
                       dtype=np.float16)


def random_blocks(type_name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n blocks of random bytes (every code and every sub-block scale bit pattern occurs) with finite fp16
    scales, a third of them taken from EXTREME_F16."""
    _, size, _ = BLOCK_FORMATS[type_name]
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for start in SCALE_BYTES[type_name]:
        scales = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)).astype(np.float16)
        pick = rng.random(n) < 1 / 3
        scales[pick] = rng.choice(EXTREME_F16, pick.sum())
        blocks[:, start:start + 2] = scales.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_block_dequantization_equals_gguf_reference(type_name):
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size, _ = BLOCK_FORMATS[type_name]
    assert gguf.GGML_QUANT_SIZES[qtype] == (block, size)
    rows, per_row = 37, 3  # 111 blocks of random bytes
    blocks = random_blocks(type_name, rows * per_row, rng).reshape(rows, per_row * size)
    ours = dequantize(torch.from_numpy(blocks), type_name)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (rows, per_row * block)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # bit for bit, signed zeros included


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_equal_gguf_reference(type_name):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((5, 24)) * 100).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(values, qtype).view(np.uint8)
    ours = dequantize(torch.from_numpy(raw), type_name)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(ours, ref)


def test_every_code_decodes_by_definition():
    """Blocks built by hand with d = 1 decode to their codes' levels, the formats' definition (independent of the
    gguf package): Q8_0 stores int8 values, Q4_0 nibbles q (element j low, j + 16 high) meaning q - 8."""
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    levels = np.arange(-128, 128, dtype=np.int8).reshape(8, 32)
    q8 = np.concatenate([np.tile(one, (8, 1)), levels.view(np.uint8)], axis=1)
    assert torch.equal(dequantize(torch.from_numpy(q8), "Q8_0"), torch.from_numpy(levels.astype(np.float32)))
    codes = np.arange(32, dtype=np.uint8) % 16  # every 4-bit code, twice
    q4 = np.concatenate([one, codes[:16] | (codes[16:] << 4)])[None]
    assert torch.equal(dequantize(torch.from_numpy(q4), "Q4_0"), torch.from_numpy(codes.astype(np.float32) - 8)[None])
