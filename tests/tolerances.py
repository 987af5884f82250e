"""One tolerance table per dtype for the kernel tests (and so for `python -m tritonq.check`, which runs
them on the GPU), each entry with its reason.

An entry bounds ours - reference for one kernel family whose output is in that dtype, against a
float32 (rms_norm: float64) reference; the tests use it as rtol and atol (int4_gemm and fp8_gemm:
atol = tol * max|reference|, for outputs that cancel to near zero). Ulps: fp32 2^-24, fp16 2^-11,
bf16 2^-8 relative (half the machine epsilon).
"""
from types import SimpleNamespace

import torch

TOLERANCE = {
    torch.float32: {
        # Same dequantized operands and an exact (ieee) fp32 dot: summation order over K only.
        "int4_gemm": 2 ** -11,
        # Products of e4m3 values are exact in fp32: summation order, K * 2^-24 of sum |terms|.
        "fp8_gemm": 2 ** -14,
        # Same int8 codes, exact int32 dot: only the fp32 epilogue (int -> fp32, two scale products) and the
        # split-K sum of fp32 partials, a few 2^-24 of max|y|.
        "int8_gemm": 2 ** -18,
        # Summation order, and exp2 (the kernels) vs exp (the references).
        "attention": 1e-4,
        # Exact fp32 dots: summation order only.
        "moe": 1e-4,
        # One fp32 rounding of mean(x^2), rsqrt and the product, against float64.
        "rms_norm": 1e-5,
        # Tiny models end to end (two layers, logits; relative to max|logit|): summation order in every
        # GEMM and attention, carried through norms and residuals.
        "model": 1e-3,
        # Realistic shapes on the GPU (relative to max|ref|): K up to 4224 fp32 terms per output.
        "large": 1e-3,
    },
    torch.float16: {
        # The dequantized weight meets x in fp16 on the tensor cores and y is rounded once: 2 ulps.
        "int4_gemm": 2 ** -10,
        # fp32 summation order can move y across one rounding boundary of fp16: 1 ulp (eps).
        "fp8_gemm": torch.finfo(torch.float16).eps,
        # As fp8_gemm: the same exact fp32 values rounded once to fp16 (split-K order moves it 1 ulp at most).
        "int8_gemm": torch.finfo(torch.float16).eps,
        # Probabilities rounded to fp16 before the PV dot (as every flash kernel), output rounded once.
        "attention": 4e-3,
        # x, the dequantized weights and the SiLU-and-mul hidden each rounded to fp16 before a GEMM.
        "moe": 2e-2,
        # The output rounded to fp16 at |y| up to ~4.
        "rms_norm": 1e-3,
        # Tiny models end to end in fp16 against the fp32 CPU path: every activation rounded to fp16
        # (2^-11) through two layers.
        "model": 5e-2,
        # Realistic shapes on the GPU (relative to max|ref|): fp16 rounding of the output, of the
        # dequantized weight or attention probabilities, plus K-long fp32 accumulation.
        "large": 1e-2,
    },
    torch.bfloat16: {
        # As fp16 with bf16's 8-bit mantissa: 2 ulps.
        "int4_gemm": 2 ** -7,
        # As fp16: 1 ulp (eps) of bf16.
        "fp8_gemm": torch.finfo(torch.bfloat16).eps,
        # As fp16: 1 ulp (eps) of bf16.
        "int8_gemm": torch.finfo(torch.bfloat16).eps,
        # As fp16, 8x coarser (probabilities rounded to bf16 before the PV dot, output rounded once).
        "attention": 3e-2,
        # As fp16, 8x coarser (8-bit mantissa).
        "moe": 5e-2,
        # As fp16 with bf16's 8-bit mantissa (2^-8 per rounding).
        "large": 3e-2,
    },
}


def table(family: str) -> dict:
    """{dtype: tolerance} of one kernel family."""
    return {dtype: row[family] for dtype, row in TOLERANCE.items() if family in row}


# ---- the engine: one prompt alone vs in a batch (or chunked, prefix-cached, interleaved) -------------
# float32 through the engine: the BLAS kernel a GEMM takes (and so its summation order) depends on the
# number of rows in the step and on the CPU (avx2 / avx512 paths, thread count), so the same logit of
# the same prompt differs by a few fp32 ulps (2^-24 relative) per dot, carried through the layers.
# For the tiny test models (|logits| < ~20, K <= 256, two layers) that stays below 1e-5 in a logprob.
# Bitwise equality would test the BLAS library, not the engine.
BATCH_ATOL = 1e-5
# A greedy pick whose top-2 logit gap is below this can flip under that rounding; after it two runs
# may rightly diverge, so tokens are compared exactly only up to the first such near tie.
GREEDY_TIE = 1e-4


def first_near_tie(model, prompt: list[int], ids: list[int]) -> int:
    """The first i where greedy token ids[i] after prompt won by less than GREEDY_TIE (len(ids) if none):
    the logits come from one prefill of prompt + ids. A test comparing texts exactly asserts there is none."""
    if not ids:
        return 0
    logits = model.engine.prompt_logits(list(prompt) + ids[:-1])[len(prompt) - 1:]  # [len(ids), V]
    top2 = logits.topk(2, dim=-1).values
    ties = (top2[:, 0] - top2[:, 1] < GREEDY_TIE).nonzero()
    return int(ties[0]) if len(ties) else len(ids)


def assert_greedy_equal(model, prompts: list[list[int]], got, want) -> None:
    """got and want (GenerationOutput of greedy runs of token-id prompts) agree: the same tokens up to the
    first near tie of want's run (GREEDY_TIE, from one prefill of prompt + want's tokens), all of them when
    there is none, and logprobs within BATCH_ATOL there."""
    for i, prompt in enumerate(prompts):
        ids = want.token_ids[i]
        n = first_near_tie(model, prompt, ids)
        assert got.token_ids[i][:n] == ids[:n], f"prompt {i}: tokens differ before any near tie"
        if n == len(ids):
            assert got.token_ids[i] == ids and got.finish_reasons[i] == want.finish_reasons[i], f"prompt {i}"
        torch.testing.assert_close(torch.tensor(got.logprobs[i][:n]), torch.tensor(want.logprobs[i][:n]),
                                   atol=BATCH_ATOL, rtol=0)


def solo_runs(model, prompts: list[list[int]], **options):
    """Each prompt generated alone, gathered as one GenerationOutput-like record for assert_greedy_equal."""
    runs = [model.generate(p, return_dict=True, **options) for p in prompts]
    return SimpleNamespace(**{name: [getattr(r, name)[0] for r in runs]
                              for name in ("text", "token_ids", "logprobs", "finish_reasons")})


def staggered_run(engine, prompts: list[list[int]], config):
    """The prompts through engine.step() with staggered arrivals: two at first, then one more before each step
    (so steps mix decodes with prefill chunks), each with GenerationConfig config; their outputs, in prompt order,
    as a GenerationOutput-like record for assert_greedy_equal."""
    pending, outputs = list(prompts), {}
    ids = [engine.add_request(pending.pop(0), config) for _ in range(min(2, len(pending)))]
    while engine.has_unfinished() or pending:
        if pending:
            ids.append(engine.add_request(pending.pop(0), config))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return SimpleNamespace(token_ids=[[o.token_id for o in outputs[rid]] for rid in ids],
                           logprobs=[[o.logprob for o in outputs[rid]] for rid in ids],
                           finish_reasons=[outputs[rid][-1].finish_reason for rid in ids])
