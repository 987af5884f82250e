"""The magic-number dequantization (`common.dequantize_int_tile`) is exact for every code and zero.

The kernels build (q - zero) * scale without int-to-float conversion: the code ORed into the mantissa of
1024.0 (fp16), 128.0 (bf16, codes < 128) or 2^23 (fp32), then one subtraction of magic + zero and one
multiply. The claim is bit equality with the fp32 reference ((q - zero) * scale in fp32, rounded once to the
output dtype), for all 4- and 8-bit codes and zeros, symmetric and asymmetric. The fp16 and fp32 paths run
here in Triton's interpreter; the bf16 path runs only on a GPU (the interpreter computes on bitcast bf16 as
raw bits, so there bf16 takes the fp32 path), so its arithmetic is checked in torch's bf16, which rounds
each operation once to nearest-even like the GPU's HADD2.BF16 / HMUL2.BF16.
"""
import pytest
import torch
import triton
import triton.language as tl

from tritonq.kernels import common
from tritonq.kernels.common import dequantize_int_tile


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, out_ptr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    w = dequantize_int_tile(tl.load(q_ptr + offs), tl.load(s_ptr + offs), tl.load(z_ptr + offs), BITS, HAS_ZEROS,
                            out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, w)


def every_code_and_zero(bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Codes and zeros covering every (q, zero) pair of `bits` (4 bits: all 256; 8 bits: every q against 16
    zeros spread over 0..255, and every zero against 16 q's), with random scales over 5 binades."""
    n = 1 << bits
    if bits == 4:
        q, z = torch.cartesian_prod(torch.arange(n), torch.arange(n)).T
    else:
        spread = torch.arange(0, n, 17)[:16]
        a = torch.cartesian_prod(torch.arange(n), spread).T
        q, z = torch.cat([a[0], a[1]]), torch.cat([a[1], a[0]])
    scale = (2.0 ** torch.empty(q.numel()).uniform_(-9, -4)).to(scale_dtype)
    return q.to(torch.int32), scale, z.to(scale_dtype)


def reference(q, scale, zero, bits, has_zeros, dtype):
    zero = zero.float() if has_zeros else 2.0 ** (bits - 1)
    return ((q.float() - zero) * scale.float()).to(dtype)


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("has_zeros", [True, False])
def test_dequantize_int_tile_is_exact_for_every_code(dtype, scale_dtype, bits, has_zeros):
    q, scale, zero = every_code_and_zero(bits, scale_dtype)
    cols = 16
    q, scale, zero = (t.reshape(-1, cols).contiguous() for t in (q, scale, zero))
    out = torch.empty(q.shape, dtype=dtype)
    _dequantize_kernel[(1,)](q, scale, zero, out, bits, has_zeros, q.shape[0], cols)
    expected = reference(q, scale, zero, bits, has_zeros, dtype)
    if dtype == torch.bfloat16:
        # The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest: its bf16 differs from
        # the reference by at most one bf16 ulp (the GPU's cast rounds; the GPU's bf16 path is the next test).
        ulp = expected.float().abs() * 2.0 ** -7
        assert ((out.float() - expected.float()).abs() <= ulp).all()
    else:
        assert torch.equal(out, expected), (out - expected).abs().max()


@pytest.mark.parametrize("has_zeros", [True, False])
def test_bf16_magic_number_arithmetic_is_exact(has_zeros):
    """The GPU's bf16 path: 0x4300 | q read as bf16 is 128 + q, and (h - (zero + 128)) * scale in bf16 is the
    reference, for every 4-bit code and zero (bits <= 7 take this path; 8-bit codes run in fp32)."""
    q, scale, zero = every_code_and_zero(4, torch.bfloat16)
    h = (q | 0x4300).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(h.float(), q.float() + 128)
    z = zero + 128.0 if has_zeros else torch.tensor(128.0 + 8, dtype=torch.bfloat16)
    assert torch.equal((h - z) * scale, reference(q, scale, zero, 4, has_zeros, torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# The GPU's packed-word paths (common.int4_words_to_magic, common.int8_words_to_halves): their PTX, run by an
# emulator of the PTX instructions they use (semantics from the PTX ISA), on every byte value in every byte of a word.
# ---------------------------------------------------------------------------------------------------------

MASK32 = (1 << 32) - 1


def _fma_half(a: int, b: int, c: int, dtype: torch.dtype) -> int:
    """One half of fma.rn.bf16x2 / fma.rn.f16x2: a * b + c rounded once to nearest-even dtype (subnormals kept, as
    the PTX ISA says for these FMAs without .ftz), bits in and out. The operands here make a * b + c exact in fp32
    (checked), so torch's fp32 -> dtype cast (round to nearest-even, inf past the largest finite value) is the one
    rounding; beyond fp32's range the result is inf."""
    a, b, c = (halves([v], dtype).double().item() for v in (a, b, c))
    exact = a * b + c
    if abs(exact) >= 2.0 ** 128:  # beyond bf16's largest finite value too: fma.rn overflows to inf
        return (0x7F80 if dtype == torch.bfloat16 else 0x7C00) | (0x8000 if exact < 0 else 0)
    as_fp32 = torch.tensor(exact, dtype=torch.float64).float()
    assert as_fp32.double().item() == exact, "a product fp32 cannot hold: emulate the wider rounding"
    return as_fp32.to(dtype).view(torch.int16).item() & 0xFFFF


def run_ptx(ptx: str, *inputs: int, outputs: int = 8) -> list[int]:
    """The outputs $0..$(outputs - 1) of a PTX block over the 32-bit inputs $outputs, $outputs + 1, ...: 16-bit
    halves where the block splits a register into them, else whole 32-bit registers. It emulates mov.b32, and.b32,
    or.b32, shr.u32, shl.b32, mul.lo.u32, prmt.b32 in default mode with its sign replication, lop3.b32,
    fma.rn.bf16x2, fma.rn.f16x2 and mov.b32 {lo, hi}; anything else fails the test, so an edited block cannot pass
    unread."""
    regs, out = {f"${outputs + i}": v & MASK32 for i, v in enumerate(inputs)}, {}

    def value(operand):
        return int(operand, 0) & MASK32 if operand[0].isdigit() else regs[operand]

    for line in ptx.strip().strip("{}").strip().splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        if op == ".reg":
            continue
        if op == "mov.b32" and rest.startswith("{"):
            pair, source = rest.split("}, ")
            lo, hi = pair.strip("{").split(", ")
            out[lo], out[hi] = regs[source] & 0xFFFF, regs[source] >> 16
            continue
        d, *args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[d] = value(args[0])
        elif op == "and.b32":
            regs[d] = value(args[0]) & value(args[1])
        elif op == "or.b32":
            regs[d] = value(args[0]) | value(args[1])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            a, b, c = (value(v) for v in args)
            dtype = torch.bfloat16 if op == "fma.rn.bf16x2" else torch.float16
            regs[d] = sum(_fma_half((a >> h) & 0xFFFF, (b >> h) & 0xFFFF, (c >> h) & 0xFFFF, dtype) << h
                          for h in (0, 16))
        elif op == "shr.u32":
            regs[d] = value(args[0]) >> value(args[1])
        elif op == "shl.b32":
            regs[d] = (value(args[0]) << value(args[1])) & MASK32
        elif op == "mul.lo.u32":
            regs[d] = (value(args[0]) * value(args[1])) & MASK32
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i & 7) of {b, a}, or with nibble bit 3 set that
            pool, selector = value(args[0]) | value(args[1]) << 32, value(args[2])  # byte's top bit in all 8 bits
            regs[d] = 0
            for i in range(4):
                nibble = (selector >> (4 * i)) & 15
                byte = (pool >> (8 * (nibble & 7))) & 0xFF
                regs[d] |= ((0xFF if byte >> 7 else 0) if nibble & 8 else byte) << (8 * i)
        elif op == "lop3.b32":  # bit of d = bit (4a + 2b + c) of the truth table
            a, b, c, lut = (value(v) for v in args)
            regs[d] = sum(((lut >> (4 * ((a >> i) & 1) + 2 * ((b >> i) & 1) + ((c >> i) & 1))) & 1) << i
                          for i in range(32))
        else:
            raise AssertionError(f"PTX op {op} has no emulation here")
    return [out[f"${i}"] if f"${i}" in out else regs[f"${i}"] for i in range(outputs)]


def halves(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype)


def byte_words() -> list[int]:
    """Every byte value in each of the four bytes of a word (the others a fixed pattern), and random words."""
    words = [b << (8 * i) | 0x5A5A5A5A & ~(0xFF << (8 * i)) for i in range(4) for b in range(256)]
    return words + torch.randint(0, 2**32, (256,), dtype=torch.int64).tolist()


@pytest.mark.parametrize("dtype, magic", [(torch.float16, 1024.0), (torch.bfloat16, 128.0)])
def test_int4_word_ptx_gives_magic_plus_each_field(dtype, magic):
    """Output j of the PTX is magic + field j of the word (bits 4j..4j+3), for every byte value in each of the
    four bytes (so every code in every field, next to every other code in its byte) and random words: the
    order the interpreter's path builds and the kernel's interleaves place at row 8 r + j."""
    ptx = (common.INT4_FP16_MAGIC_PTX if dtype == torch.float16 else common.INT4_BF16_MAGIC_PTX).value
    for word in byte_words():
        got = halves(run_ptx(ptx, word), dtype)
        fields = torch.tensor([(word >> (4 * j)) & 15 for j in range(8)], dtype=torch.float32)
        assert torch.equal(got.float(), fields + magic), hex(word)


@pytest.mark.parametrize("high", [1, 2])
@pytest.mark.parametrize("dtype, magic", [(torch.float16, 1024.0), (torch.bfloat16, 128.0)])
def test_high_word_ptx_gives_magic_plus_each_code(dtype, magic, high):
    """GGUF's 5- / 6-bit codes (common.high_words_to_magic): output j of the PTX is magic + (field j of the 4-bit
    word | its high bits << 4), the high bits the word's part (byte, or half) of the high word, for every byte value
    in each byte of both words, in each part, and random words."""
    ptx = getattr(common, f"HIGH{high}_{'FP16' if dtype == torch.float16 else 'BF16'}_MAGIC_PTX").value
    words = byte_words()
    for word, hb in zip(words + words[::-1], words[::-1] + words):
        for part in range(4 // high):
            if high == 1:
                inputs = (word, hb, part * 8)
            else:  # h << 4, h << 2, h >> 2 (arithmetic, as Triton's int32 shift) and the half's prmt selector
                signed = hb - (hb >> 31 << 32)
                inputs = (word, hb, hb << 4, hb << 2, signed >> 2, 0x1504 + part * 0x2222)
            got = halves(run_ptx(ptx, *inputs), dtype)
            codes = [(word >> (4 * j)) & 15 | ((hb >> (8 * high * part + high * j)) & ((1 << high) - 1)) << 4
                     for j in range(8)]
            assert torch.equal(got.float(), torch.tensor(codes, dtype=torch.float32) + magic), (hex(word), hex(hb))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_zeros", [True, False])
def test_int4_word_dequantization_is_exact(dtype, has_zeros):
    """From the PTX's magic + q on, `int4_words_minus_zero` and the scale, in the GPU's rounding (torch's 16-bit
    ops round once to nearest-even, as HADD2 / HMUL2 / HFMA2 do): q - zero is exact, and times the scale per
    weight it is the fp32 reference rounded once; on the dot's fp32 result (one scale row per tile) the dot
    sees these exact integers. Every (code, zero) pair, scales over 5 binades."""
    order = torch.randperm(256)  # neighbours in a word differ (every_code_and_zero lists q in runs of 16)
    q, scale, zero = (t[order] for t in every_code_and_zero(4, dtype))
    magic = 1024.0 if dtype == torch.float16 else 128.0
    ptx = (common.INT4_FP16_MAGIC_PTX if dtype == torch.float16 else common.INT4_BF16_MAGIC_PTX).value
    codes = q.reshape(-1, 8)  # 8 codes a word, field j = code j
    words = (codes << (4 * torch.arange(8))).sum(1)
    h = torch.cat([halves(run_ptx(ptx, int(w)), dtype) for w in words])
    t = h - ((zero + magic) if has_zeros else torch.tensor(magic + 8, dtype=dtype))
    assert torch.equal(t.float(), q.float() - (zero.float() if has_zeros else 8.0))
    assert torch.equal(t * scale, reference(q, scale, zero, 4, has_zeros, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_word_ptx_gives_each_byte(dtype):
    """Output j of the 8-bit PTX is byte j of the word as 1024 + q (fp16) or q - 128 (bf16: 128 + its low 7 bits plus
    -256 + 128 x its top bit, one packed add), for every byte value in every byte: the values `int8_words_to_halves`
    places at row 4 r + j."""
    ptx, offset = ((common.INT8_FP16_PTX, 1024.0) if dtype == torch.float16 else (common.INT8_BF16_PTX, -128.0))
    for word in byte_words():
        got = halves(run_ptx(ptx.value, word, outputs=4), dtype)
        codes = torch.tensor([(word >> (8 * j)) & 255 for j in range(4)], dtype=torch.float32)
        assert torch.equal(got.float(), codes + offset), hex(word)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_zeros", [True, False])
def test_int8_word_dequantization_is_exact(dtype, has_zeros):
    """`int8_words_minus_zero`'s arithmetic after the PTX, in the GPU's rounding (torch's 16-bit ops round once, as
    HADD2 does): q - zero is exact for every code against 16 zeros and every zero against 16 codes (zeros up to
    256: GPTQ v1's stored zero + 1), and times the scale it is the fp32 reference rounded once."""
    q, scale, zero = every_code_and_zero(8, dtype)
    zero = torch.where(zero == 255, 256.0, zero.float()).to(dtype)  # GPTQ v1: 255 + 1
    order = torch.randperm(q.numel())
    q, scale, zero = q[order], scale[order], zero[order]
    words = (q.reshape(-1, 4) << (8 * torch.arange(4))).sum(1)
    if dtype == torch.float16:
        h = torch.cat([halves(run_ptx(common.INT8_FP16_PTX.value, int(w), outputs=4), dtype) for w in words])
        t = h - ((zero + 1024.0) if has_zeros else torch.tensor(1152.0, dtype=dtype))
    else:
        h = torch.cat([halves(run_ptx(common.INT8_BF16_PTX.value, int(w), outputs=4), dtype) for w in words])
        t = h - (zero - 128.0) if has_zeros else h
    assert torch.equal(t.float(), q.float() - (zero.float() if has_zeros else 128.0))
    assert torch.equal(t * scale, reference(q, scale, zero, 8, has_zeros, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_code_pair_table_gives_both_codes_of_every_byte(dtype):
    """A code-table weight's decode path (common.code_pairs_lookup): entry b of `code_pair_table`, split by its PTX
    (a register-pair view), is {code[low nibble of b], code[high nibble of b]} in dtype, for every byte b."""
    from tritonq.kernels.int4_gemm import code_pair_table

    code = torch.randn(16)
    table = code_pair_table(code, dtype)
    for b in range(256):
        got = halves(run_ptx(common.PAIR_SPLIT_PTX.value, int(table[b]), outputs=2), dtype)
        assert torch.equal(got, code[[b & 15, b >> 4]].to(dtype)), b


def test_word_bytes_ptx_gives_each_byte_zero_extended():
    """Output i of the code-table path's index PTX (common.WORD_BYTES_PTX, `code_pairs_lookup`) is byte i of the word,
    zero-extended: the pair table's index, for every byte value in each byte of a word and random words."""
    for word in byte_words():
        assert run_ptx(common.WORD_BYTES_PTX.value, word, outputs=4) == [(word >> (8 * i)) & 255 for i in range(4)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_e4m3_word_ptx_gives_each_byte_over_256(dtype):
    """Output j of the fp8 weight-only path's PTX (common.e4m3_words_to_halves) is byte j of the word read as
    float8_e4m3fn, divided by 2^8, in dtype: exactly, for every byte value but the two NaNs in every byte (normals,
    subnormals, both zeros: the sign bits compared too), and random words."""
    ptx = (common.E4M3_FP16_PTX if dtype == torch.float16 else common.E4M3_BF16_PTX).value
    for word in byte_words():
        got = halves(run_ptx(ptx, word, outputs=4), dtype)
        codes = torch.tensor([(word >> (8 * j)) & 255 for j in range(4)], dtype=torch.uint8)
        expected = (codes.view(torch.float8_e4m3fn).float() / 256).to(dtype)
        finite = (codes & 0x7F) != 0x7F
        assert torch.equal(got.view(torch.int16)[finite], expected.view(torch.int16)[finite]), hex(word)


@triton.jit
def _divide_kernel(x_ptr, s_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    offs = rows * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + offs, common.divide_by_scale(tl.load(x_ptr + offs), tl.load(s_ptr + rows)))


def test_divide_by_scale_rounds_like_ieee_division():
    """The quantizers' division (common.divide_by_scale: one reciprocal per scale, two FMA corrections per x) equals
    torch's fp32 division bit for bit, signed zeros included: every finite bf16 and fp16 value as x against 64
    scales: absmax / 448 and absmax / 127.5 of random and of adversarial absmax (all-ones mantissas, powers of two,
    the 1e-10 floor). Where x or the quotient is below 2^-100 the remainder can underflow and the last bits differ,
    but both results are then below 2^-40 (x / a scale >= 2^-42), code 0 in e4m3 and int8 alike. The interpreter's
    FMA rounds once, as the GPU's does."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = torch.cat([bits.view(torch.bfloat16).float(), bits.view(torch.float16).float()])
    x = x[torch.isfinite(x)]
    absmax = torch.cat([torch.tensor([1e-10, 1.0, 2.0, 448.0, 3.0e38, 1.9999999, 1.0 - 2**-24, 65504.0]),
                        2.0 ** torch.empty(24).uniform_(-20, 20)])
    scales = torch.cat([absmax / torch.full_like(absmax, 448.0), absmax / torch.full_like(absmax, 127.5)])
    cols = 4096
    x = torch.nn.functional.pad(x, (0, -x.numel() % cols)).reshape(-1, cols)
    for s in scales:  # one scale for every row, all x at once
        rows = x.shape[0]
        out = torch.empty_like(x)
        _divide_kernel[(1,)](x, s.expand(rows).contiguous(), out, rows, cols)
        quotient = x / s
        tiny = (x != 0) & ((x.abs() < 2.0**-100) | (quotient.abs() < 2.0**-100))
        exact = ~tiny & (quotient.abs() < 2.0**126)  # the quantizers saturate far below
        assert torch.equal(out[exact].view(torch.int32), quotient[exact].view(torch.int32)), f"scale {s.item()}"
        assert (out[tiny].abs() < 2.0**-40).all() and (quotient[tiny].abs() < 2.0**-40).all()


# ---------------------------------------------------------------------------------------------------------
# MXFP4 (common.mxfp4_words_to_half): the PTX, run by the emulator above, for every e2m1 code in every position
# of a word against every E8M0 scale its path takes, with the scale factors the kernel computes for it.
# ---------------------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# (dtype, scale factors): the PTX block and the E8M0 exponents it takes (the launcher picks two factors past
# MXFP4_ONE_FACTOR_MAX_SCALE and refuses fp16 past MXFP4_FP16_MAX_SCALE; the loader keeps s <= 240)
MXFP4_PATHS = {(torch.bfloat16, 1): ("MXFP4_BF16_PTX", common.MXFP4_ONE_FACTOR_MAX_SCALE),
               (torch.bfloat16, 2): ("MXFP4_BF16_2_PTX", 254),
               (torch.float16, 1): ("MXFP4_FP16_PTX", common.MXFP4_ONE_FACTOR_MAX_SCALE),
               (torch.float16, 2): ("MXFP4_FP16_2_PTX", common.MXFP4_FP16_MAX_SCALE)}


@triton.jit
def _scale_factors_kernel(s_ptr, f1_ptr, f2_ptr, N: tl.constexpr, FP16: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.arange(0, N)
    f1, f2 = common.mxfp4_scale_factors(tl.load(s_ptr + offs)[:, None], tl.float16 if FP16 else tl.bfloat16, STEPS)
    tl.store(f1_ptr + offs[:, None], f1)
    tl.store(f2_ptr + offs[:, None], f2)


def scale_factors(dtype: torch.dtype, steps: int) -> tuple[list[int], list[int]]:
    """`common.mxfp4_scale_factors` of every exponent 0..255, computed by the kernel helper itself (interpreter)."""
    s = torch.arange(256, dtype=torch.int32)
    f1, f2 = torch.empty(256, dtype=torch.int32), torch.empty(256, dtype=torch.int32)
    _scale_factors_kernel[(1,)](s, f1, f2, 256, dtype == torch.float16, steps)
    return [int(v) & MASK32 for v in f1], [int(v) & MASK32 for v in f2]


@pytest.mark.parametrize("dtype, steps", list(MXFP4_PATHS), ids=[f"{d}-{n}" for d, n in MXFP4_PATHS])
def test_mxfp4_scale_factors_are_powers_of_two_in_both_halves(dtype, steps):
    """Each factor holds the same dtype power of two in both halves, and (times the decode's 2^-126 in bf16, 2^-14
    in fp16) their product is the scale 2^(s - 127) for every exponent the path takes; fp16's tiny scales (s < 99)
    stand in for 2^-28, whose products round to zero in fp16 as theirs do."""
    f1, f2 = scale_factors(dtype, steps)
    _, max_scale = MXFP4_PATHS[(dtype, steps)]
    for s in range(max_scale + 1):
        factors = [f1[s]] if steps == 1 else [f1[s], f2[s]]
        assert all(f & 0xFFFF == f >> 16 for f in factors), (s, [hex(f) for f in factors])
        value = 2.0 ** (-126 if dtype == torch.bfloat16 else -14)
        for f in factors:
            value *= halves([f & 0xFFFF], dtype).double().item()
        expected = 2.0 ** (max(s, 99) - 127) if dtype == torch.float16 else 2.0 ** (s - 127)
        assert value == expected, (s, value, expected)


@pytest.mark.parametrize("dtype, steps", list(MXFP4_PATHS), ids=[f"{d}-{n}" for d, n in MXFP4_PATHS])
def test_mxfp4_word_ptx_is_exact_for_every_code_and_scale(dtype, steps):
    """Output j of the PTX on a word and the kernel's scale factors is dtype(E2M1[code j] x 2^(s - 127)), the fp32
    reference rounded once (bf16: exact, every such product down to 2^-133 is a bf16 value, past its range inf;
    fp16: rounded to nearest even, subnormals and overflow to inf included), for every code in each of the 8
    positions next to varying neighbours, and random words, at every exponent the path takes."""
    name, max_scale = MXFP4_PATHS[(dtype, steps)]
    ptx = getattr(common, name).value
    f1, f2 = scale_factors(dtype, steps)
    words = [sum(((c + 3 * j) % 16) << (4 * j) for j in range(8)) for c in range(16)]
    words += torch.randint(0, 2**32, (8,), dtype=torch.int64).tolist()
    codes = torch.tensor([[(w >> (4 * j)) & 15 for j in range(8)] for w in words])
    values = torch.tensor(E2M1, dtype=torch.float64)[codes]
    for s in range(max_scale + 1):
        factors = (f1[s],) if steps == 1 else (f1[s], f2[s])
        got = torch.stack([halves(run_ptx(ptx, w, *factors), dtype) for w in words])
        expected = (values * 2.0 ** (s - 127)).float().to(dtype)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), f"scale {s}: {got} != {expected}"
