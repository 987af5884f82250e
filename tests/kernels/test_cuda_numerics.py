"""What the first H200 run found wrong on CUDA only (#34), each caught here without a GPU.

* fp32 tl.dot defaults to tf32 on sm_80+ (10-bit mantissas): fp32 attention was 2.7e-3 off its
  reference. The kernels' fp32 dots must be IEEE (`common.ieee_dot`, UPCAST_DOT): the PTX of fp32
  launches has no tf32 tensor-core instruction, while fp16/bf16 launches still use the tensor cores.
* fp8 activation scales must be IEEE quotients, bit for bit, on every device: the kernel divides with
  div.rn (its PTX has no approximate fp32 division), and the torch reference must not divide by a
  Python number, which CUDA torch computes as a multiplication by the reciprocal.
* grouped_topk_reference made tensors on the default device (cuda in the GPU run) beside CPU ones.

The AOT compiles build each launch with the launcher's own builder over meta tensors and run in a
child process without TRITON_INTERPRET (see child_process.py).
"""
import pytest
import torch
from child_process import json_from_child
from torch.overrides import TorchFunctionMode

from tritonq.kernels.fp8_gemm import quantize_activation_fp8_reference
from tritonq.kernels.moe import grouped_topk, grouped_topk_reference

AOT_SCRIPT = r"""
import json, sys
import torch
from tritonq.kernels import attention, fp8_gemm, int4_gemm
from tritonq.kernels.aot import SM_COUNT, compile_launch

def meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")

i32 = torch.int32
reports = {}
for cc in (80, 90):
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        # prefill as the H200 failure ran it: Dqk 72 (a 64 + 8 tail: both qk dots), Dv 40, 32 x 16 tiles
        k_pages, v_pages = meta(64, 16, 2, 72, dtype=dtype), meta(64, 16, 2, 40, dtype=dtype)
        launch = attention.paged_prefill_launch(meta(128, 4, 72, dtype=dtype), k_pages, v_pages, meta(4, dtype=i32),
                                                meta(3, dtype=i32), meta(3, 8, dtype=i32), 0.2, 0,
                                                attention.PrefillConfig(32, 16, 8, 3))[0]
        reports[f"prefill {name} sm_{cc}"] = compile_launch(launch, cc)
        cfg = attention.decode_config(2, 8, 4096, 16, *attention.head_blocks(128, 128), SM_COUNT[cc])
        k_pages, v_pages = meta(512, 16, 8, 128, dtype=dtype), meta(512, 16, 8, 128, dtype=dtype)
        split, merge, _ = attention.decode_launches(meta(2, 32, 128, dtype=dtype), k_pages, v_pages,
                                                    meta(2, dtype=i32), meta(2, 256, dtype=i32), 0.1, 0, cfg)
        reports[f"decode {name} sm_{cc}"] = compile_launch(split, cc)
        reports[f"int4 {name} sm_{cc}"] = compile_launch(
            int4_gemm.aot_launch(int4_gemm.default_config(64, 4096, 4096), 64, 4096, 4096, dtype), cc)
    for dtype in (torch.float32, torch.float16):  # fp8 weight-only: x's dtype meets the decoded weight
        cfg = fp8_gemm.default_config(64, 4096, 4096, cc=80, block_scaled=True, weight_only=True)
        reports[f"fp8 weight-only {str(dtype).removeprefix('torch.')} sm_{cc}"] = compile_launch(
            fp8_gemm.aot_launch(cfg, 64, 4096, 4096, 80, dtype, block=True), cc)
for cc in (89, 90):  # activation quantization: per token, per 128-group, static scale
    for group, static in ((None, False), (128, False), (None, True)):
        x = meta(64, 4096, dtype=torch.bfloat16)
        scales = meta(1, dtype=torch.float32) if static else meta(64, 4096 // (group or 4096), dtype=torch.float32)
        reports[f"quantize group={group} static={static} sm_{cc}"] = compile_launch(fp8_gemm.quantize_activation_launch(
            x, meta(64, 4096, dtype=torch.float8_e4m3fn), scales, group or 4096, static=static), cc)
json.dump({k: dict(mma_types=r.mma_types, fp32_divisions=r.fp32_divisions) for k, r in reports.items()}, sys.stdout)
"""


@pytest.fixture(scope="module")
def reports():
    return json_from_child(["-c", AOT_SCRIPT])


@pytest.mark.aot
@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("kernel", ["prefill", "decode", "int4", "fp8 weight-only"])
def test_fp32_dots_are_ieee_and_half_dots_use_tensor_cores(reports, kernel, cc):
    half = "float16" if kernel == "fp8 weight-only" else "bfloat16"
    fp32, low = reports[f"{kernel} float32 sm_{cc}"], reports[f"{kernel} {half} sm_{cc}"]
    assert fp32["mma_types"] == [], fp32  # an IEEE fp32 dot runs on FMAs: no tf32 (nor any) MMA
    assert low["mma_types"] == [{"float16": "f16", "bfloat16": "bf16"}[half]], low


@pytest.mark.aot
@pytest.mark.parametrize("cc", [89, 90])
@pytest.mark.parametrize("group,static", [(None, False), (128, False), (None, True)])
def test_activation_quantization_divides_in_ieee(reports, group, static, cc):
    report = reports[f"quantize group={group} static={static} sm_{cc}"]
    assert report["fp32_divisions"] == ["div.rn.f32"], report  # no div.full / div.approx


class CudaScalarDivision(TorchFunctionMode):
    """Division of an fp32 tensor by a Python number as CUDA torch does it (aten's div_true_kernel_cuda):
    a multiplication by the fp32 reciprocal, two roundings. CPU torch divides, so a reference that
    matches a kernel bit for bit on CPU can miss it by an ulp on CUDA; under this mode it does on CPU too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func in (torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide) and not kwargs
                and isinstance(args[1], (int, float)) and args[0].dtype == torch.float32):
            return args[0] * (torch.tensor(1.0) / torch.tensor(float(args[1])))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("group_size", [None, 128])
def test_activation_quantization_reference_is_ieee_on_cuda_too(group_size):
    """The reference's scales are the correctly rounded absmax / 448 (a float64 quotient rounded once to
    fp32 is exact: 53 >= 2 * 24 + 2 bits) also under CUDA's scalar division, and so are its codes."""
    x = torch.randn(17, 384, dtype=torch.bfloat16) * torch.logspace(-3, 2, 17)[:, None]
    absmax = x.float().view(17, -1, group_size or 384).abs().amax(dim=2)
    ieee = (absmax.double() / 448).float()
    with CudaScalarDivision():
        q, scales = quantize_activation_fp8_reference(x, group_size)
        rounded_twice = absmax / 448
    assert not torch.equal(rounded_twice, ieee)  # these values tell the two divisions apart
    assert torch.equal(scales, ieee)
    q_ref, _ = quantize_activation_fp8_reference(x, group_size)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_reference_ignores_the_default_device(with_bias):
    """Inputs on the CPU while the default device is "meta" (the GPU run had cuda): every tensor either
    routing function makes must be on its input's device (meta ones cannot even be read back)."""
    logits = torch.randn(9, 64, device="cpu")  # explicitly: the kernel tests' default device is the GPU there
    bias = torch.randint(0, 4, (64,), device="cpu").float() * 0.25 if with_bias else None
    args = dict(top_k=6, n_group=4, topk_group=2, scoring="sigmoid", correction_bias=bias, renormalize=True,
                routed_scaling_factor=2.5)
    expected = grouped_topk_reference(logits, **args)
    with torch.device("meta"):
        ref_weights, ref_ids = grouped_topk_reference(logits, **args)
        weights, ids = grouped_topk(logits, **args)
    for got in (ref_weights, ref_ids, weights, ids):
        assert got.device.type == "cpu"
    assert torch.equal(ref_ids, expected[1]) and torch.equal(ref_weights, expected[0])
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
