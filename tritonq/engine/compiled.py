"""The CPU decode step compiled with torch.compile, one graph per batch bucket.

The CPU counterpart of tritonq.engine.cuda_graphs: a decode step of B sequences runs at the
smallest bucket b >= B on the first b rows of StaticDecodeInputs, so every tensor has a shape
fixed by (b, max_seq_len) and every host int the model reads (max_position, num_context_tokens)
is a constant. The whole model forward is then one graph per bucket (fullgraph, static shapes):
inductor fuses each layer's norms, rope, residual adds and SiLU-and-mul into C++ loops and
calls oneDNN / MKL for the GEMMs, where the eager step runs ~15 small ops per layer, each a
dispatch and an OpenMP region. Paged attention and the KV write are two opaque custom ops in that
graph (kernels/cpu/attention.py): their per-sequence loops read lengths on the host.

A bucket is compiled the first time a step uses it (the log says how long it took); sequences
growing changes only tensor values, never a shape or a constant, so nothing recompiles after that
(tests/engine/test_compiled_decode.py counts dynamo's compiles over a 500-token generation).
Prefill and mixed steps (packed lengths change every step) stay eager.
"""
from __future__ import annotations

import logging
import time

import torch

from tritonq.models.common import StepContext

log = logging.getLogger(__name__)
COMPILE_LIMIT = 256  # graphs of one forward per process: buckets (17 at max_num_seqs=128) x models loaded


class CompiledDecode:
    """forward(ctx, cache) compiled once per decode bucket on first use; __call__ runs it.

    compile_s[bucket] is the wall time the bucket's first call took (dynamo trace + inductor codegen +
    the C++ compiler; inductor's on-disk cache makes a second process faster)."""

    def __init__(self, forward, buckets: list[int]):
        self.buckets = sorted(buckets)
        # Static shapes: one graph per bucket. Dynamo counts the graphs of one code object (the model's
        # forward, shared by every model of its class in the process) against recompile_limit (8 by
        # default): it is raised while a bucket compiles (COMPILE_LIMIT), left alone otherwise.
        self.compiled = torch.compile(forward, fullgraph=True, dynamic=False)
        self.compile_s: dict[int, float] = {}

    def __call__(self, ctx: StepContext, cache) -> torch.Tensor:
        bucket = ctx.input_ids.shape[0]
        if bucket in self.compile_s:
            return self.compiled(ctx, cache)
        start = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, COMPILE_LIMIT)):
            logits = self.compiled(ctx, cache)
        self.compile_s[bucket] = time.perf_counter() - start
        log.info("torch.compile: decode bucket %d compiled in %.1f s (first use; %d of %d buckets compiled)",
                 bucket, self.compile_s[bucket], len(self.compile_s), len(self.buckets))
        return logits
