"""Whole (non-streamed) response bodies from finished choices: /v1/completions and /v1/chat/completions.

The streamed ones are built chunk by chunk in tritonq.serve.sse.
"""
from __future__ import annotations

from tritonq.serve.dispatch import Choice, usage
from tritonq.serve.logprobs import chat_logprobs, completion_logprobs
from tritonq.serve.protocol import ChatCompletionRequest, CompletionRequest
from tritonq.serve.responses import (AssistantMessage, ChatChoice, ChatCompletion, Completion, CompletionChoice,
                                     CompletionLogprobs)
from tritonq.serve.tools import read_reply, tool_call


def completion(body: CompletionRequest, choices: list[Choice], tokenizer, *, id: str, created: int, model: str,
               echoes: list[tuple[str, CompletionLogprobs | None]] | None) -> Completion:
    """The /v1/completions body. echoes: per prompt, the text (and logprobs or None) echo prepends to each of
    its choices; None without echo."""
    def one(c: Choice) -> CompletionChoice:
        echo_text, echo_logprobs = echoes[c.index // body.n] if echoes else ("", None)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.tops, len(echo_text))
            logprobs = echo_logprobs.then(logprobs) if echoes else logprobs
        return CompletionChoice(index=c.index, text=echo_text + c.text, logprobs=logprobs,
                                finish_reason=c.finish_reason)
    return Completion(id=id, created=created, model=model, choices=[one(c) for c in choices],
                      usage=usage(choices, body.n))


def chat_completion(body: ChatCompletionRequest, choices: list[Choice], tokenizer, *, id: str, created: int,
                    model: str) -> ChatCompletion:
    """The /v1/chat/completions body; each reply's tool calls read out of its text (see ChatChunks)."""
    named, parse_calls = body.named_tool(), body.parses_tool_calls()

    def one(c: Choice) -> ChatChoice:
        finish = c.finish_reason
        if named is not None:  # the whole text is the arguments of the named function's call
            message = AssistantMessage(content=None, tool_calls=[tool_call(named.name, c.text)])
        else:
            content, calls, finish = read_reply(c.text, finish) if parse_calls else (c.text, [], finish)
            message = AssistantMessage(content=content, tool_calls=calls) if calls else AssistantMessage(content=c.text)
        logprobs = chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.tops) if body.logprobs else None
        return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish)
    return ChatCompletion(id=id, created=created, model=model, choices=[one(c) for c in choices],
                          usage=usage(choices, body.n))
