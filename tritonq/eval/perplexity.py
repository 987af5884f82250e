"""Sliding-window perplexity, the method of the transformers perplexity guide ("Perplexity of fixed-length models").

A text of N tokens is cut into windows of `context` tokens starting every `stride` tokens. Window w covers
[begin, end) and scores only the tokens the previous window did not reach, [max(prev_end, begin + 1), end),
each with the window's earlier tokens as context; the first token of a text is never scored (nothing
predicts it). With stride < context every scored token past the first window sees at least
context - stride tokens of context. ppl = exp(sum of NLL / number of scored tokens), pooled over texts.
The guide's code weighs each window's mean loss by (its labels - 1), one token too few for every window
after the first (whose first label is already masked); here each scored token counts once, exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PerplexityOutput:
    """perplexity = exp(mean_nll); mean_nll in nats per scored token; num_tokens scored over num_windows windows."""
    perplexity: float
    mean_nll: float
    num_tokens: int
    num_windows: int
    context: int
    stride: int


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window of a text of num_tokens tokens; tokens [first_scored, end) are
    the ones that window scores. Each token is scored at most once: every one but token 0 when
    stride < context; with stride == context a window's first token has no context and is skipped."""
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        windows.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def check_window(context, stride, max_seq_len: int) -> tuple[int, int]:
    """(context, stride) with the defaults filled in; ValueError naming the bad one and the fix."""
    context = max_seq_len if context is None else context
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"context={context!r}; expected an int >= 2 (tokens per window: one to predict "
                         "from, at least one to score).")
    if context > max_seq_len:
        raise ValueError(f"context={context} > max_seq_len={max_seq_len}: a window must fit the model's "
                         f"positions; pass context <= {max_seq_len} or load with a larger max_seq_len.")
    stride = max(1, context // 2) if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r}; expected a positive int (tokens each window moves on).")
    if stride > context:
        raise ValueError(f"stride={stride} > context={context}: the tokens between windows would never be "
                         f"scored; pass stride <= {context} (stride == context: non-overlapping windows).")
    return context, stride


def perplexity(model, texts, *, context: int | None = None, stride: int | None = None,
               add_special_tokens: bool = True, return_dict: bool = False, progress: bool | None = None):
    """See tritonq.Model.perplexity. Every input is checked before any window runs."""
    context, stride = check_window(context, stride, model.max_seq_len)
    if isinstance(texts, (list, tuple)) and not texts:
        raise ValueError("texts is an empty list; give at least one text.")
    encoded, _ = model._encode(texts, add_special_tokens)
    for i, ids in enumerate(encoded):
        model.engine.check_token_ids(ids, name=f"text {i}")
    for i, ids in enumerate(encoded):
        if len(ids) < 2:
            raise ValueError(f"text {i} has {len(ids)} token(s); perplexity needs at least 2 (the first token is "
                             "never scored). Remove empty texts or join short ones.")
    windows, spans = [], []
    for ids in encoded:
        for begin, end, first in sliding_windows(len(ids), context, stride):
            windows.append(ids[begin:end])
            spans.append((first - begin - 1, end - begin - 1))  # logprob j predicts window token j + 1
    progress = len(windows) > 8 if progress is None else progress
    scored = model._score_ids(windows, progress, "Perplexity", "window")
    nll = -sum(float(lp[a:b].double().sum()) for (lp, _, _), (a, b) in zip(scored, spans))
    count = sum(b - a for a, b in spans)
    out = PerplexityOutput(math.exp(nll / count), nll / count, count, len(windows), context, stride)
    return out if return_dict else out.perplexity
