"""Measuring a model's quality: perplexity and the lm-evaluation-harness.

    model = tritonq.load("path/or/org-name")
    model.score("Hello world")                       # per-token log-probabilities
    model.perplexity(text, context=512, stride=256)   # sliding-window perplexity

    python -m tritonq.eval perplexity MODEL FILE [--context N --stride S]
    python -m tritonq.eval lm_eval --model-path MODEL --tasks hellaswag   # needs pip install "tritonq[eval]"

tritonq.eval.perplexity computes the windows; tritonq.eval.harness is the `tritonq` model for lm_eval.
"""
