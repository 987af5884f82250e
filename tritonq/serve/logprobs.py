"""The `logprobs` objects of completions and chat replies, from token ids and their log-probabilities.

Token texts are each token decoded alone (as vLLM and OpenAI write them); log-probabilities pass through
`finite_logprob` (JSON has no -inf). top: per token {token id: log-probability} of the most likely ones
(the engine's RequestOutput.top_logprobs), or None when not asked for.
"""
from __future__ import annotations

from tritonq.serve.protocol import finite_logprob
from tritonq.serve.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None], tops: list,
                        offset: int) -> CompletionLogprobs:
    """The completions `logprobs` of these tokens, their text starting at character `offset`: per token its
    text, logprob and top_logprobs {text: logprob} of the token itself and then the most likely ones (vLLM's
    shape: up to logprobs + 1 entries; texts that decode alike keep the first). A None logprob (an echoed
    prompt's first token: nothing before it to predict it from) has top_logprobs None."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top_logprobs = []
    for text, lp, top in zip(tokens, logprobs, tops):
        if lp is None:
            top_logprobs.append(None)
            continue
        entry = {text: finite_logprob(lp)}
        for t, alternative in (top or {}).items():
            entry.setdefault(tokenizer.decode([t]), finite_logprob(alternative))
        top_logprobs.append(entry)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[finite_logprob(lp) for lp in logprobs],
                              top_logprobs=top_logprobs, text_offset=offsets)


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], tops: list) -> ChatLogprobs:
    """The chat `logprobs`: per token its text, logprob, UTF-8 bytes and top_logprobs, the most likely
    tokens with theirs (OpenAI's shape; [] when not asked for)."""
    content = []
    for t, lp, top in zip(token_ids, logprobs, tops):
        text = tokenizer.decode([t])
        alternatives = [TopLogprob(token=s, logprob=finite_logprob(a), bytes=list(s.encode()))
                        for s, a in ((tokenizer.decode([i]), a) for i, a in (top or {}).items())]
        content.append(ChatTokenLogprob(token=text, logprob=finite_logprob(lp), bytes=list(text.encode()),
                                        top_logprobs=alternatives))
    return ChatLogprobs(content=content)
