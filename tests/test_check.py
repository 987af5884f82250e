"""python -m tritonq.check: the GPU self-check runs its quick cases through the interpreter here."""
import tritonq.check
from tritonq.kernels import int4_gemm


def test_quick_check_passes(capsys):
    assert tritonq.check.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for family in ("int4_gemm", "fp8_gemm", "fp8_quant", "rms_norm", "attention", "moe_routing", "fused_moe", "model"):
        assert f"ok   {family}" in out
    assert "FAIL" not in out


def test_check_reports_a_wrong_kernel(monkeypatch, capsys):
    wrong = lambda x, w: int4_gemm.int4_gemm_reference(x, w) * 1.05  # a 5% error
    monkeypatch.setattr(int4_gemm, "int4_gemm", wrong)
    assert tritonq.check.main(["--quick"]) == 1
    assert "FAIL int4_gemm" in capsys.readouterr().out
