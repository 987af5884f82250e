"""Streamed responses: server-sent events `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`, and the chunks in them.

`stream_response` reads a Stream's engine events into its choices and writes each new piece as chunks built
by a chunker: `CompletionChunks` (/v1/completions) or `ChatChunks` (/v1/chat/completions). A request the
engine failed, an engine that died, or an error writing the reply ends the stream with an error chunk (the
OpenAI error body) and [DONE]; with stream_options.include_usage every chunk carries "usage": null and the
last one the usage.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from tritonq.serve.dispatch import Choice, apply_output, choices_of, next_event, usage
from tritonq.serve.engine_loop import EngineLoop, StepFailed, Stream
from tritonq.serve.errors import api_error
from tritonq.serve.logprobs import chat_logprobs, completion_logprobs
from tritonq.serve.protocol import APIError, FunctionDefinition, dumps
from tritonq.serve.responses import (ChatChunkChoice, ChatCompletionChunk, Completion, CompletionChoice,
                                     CompletionLogprobs, Usage)
from tritonq.serve.tools import read_reply, tool_call

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    """One server-sent event holding a JSON body."""
    return f"data: {dumps(payload)}\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always calls on_close, however it ends (done, client gone, cancelled): the
    stream's engine requests are released there."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def stream_response(engine_loop: EngineLoop, stream: Stream, request: Request, n: int, chunker) -> SSEResponse:
    """The SSE response of a stream: chunker.chunks(choice, text, out, first) per engine output (the chunks
    carrying that output's new text; first: the choice's first output), chunker.usage(Usage) at the end
    when chunker.include_usage, then [DONE]."""
    async def body():
        choices = choices_of(stream, n)
        while any(c.finish_reason is None for c in choices.values()):
            news = await next_event(engine_loop, stream, request)
            if news is None:  # the client has gone: nobody to write to
                return
            if news.error is not None:
                yield event(api_error(news.error, "the request was interrupted: ").body())
                yield DONE
                return
            for out in news.outputs:
                choice = choices[out.request_id]
                first = not choice.started
                try:
                    text = apply_output(engine_loop, stream, choice, out)
                    chunks = [event(chunk.to_json()) for chunk in chunker.chunks(choice, text, out, first)]
                except StepFailed as exc:
                    yield event(api_error(exc).body())
                    yield DONE
                    return
                except Exception as exc:  # noqa: BLE001 - a bug writing one reply: still an error chunk and [DONE]
                    traceback.print_exc()
                    yield event(APIError(500, f"writing the reply failed: {type(exc).__name__}: {exc}").body())
                    yield DONE
                    return
                for chunk in chunks:
                    yield chunk
        if chunker.include_usage:
            yield event(chunker.usage(usage(list(choices.values()), n)).to_json())
        yield DONE
    return SSEResponse(body(), on_close=lambda: engine_loop.release(stream))


@dataclass
class CompletionChunks:
    """The chunks of a streamed /v1/completions response. echoes: per prompt, what echo prepends to its
    choices' first chunk (the prompt text, and its logprobs or None), or None without echo."""
    id: str
    created: int
    model: str
    tokenizer: object
    n: int
    logprobs: bool
    include_usage: bool
    echoes: list[tuple[str, CompletionLogprobs | None]] | None = None

    def _chunk(self, choices: list[CompletionChoice], **extra) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def chunks(self, choice: Choice, text: str, out, first: bool) -> list[Completion]:
        echo = self.echoes[choice.index // self.n] if self.echoes and first else None
        if not text and not out.finished and not self.logprobs and echo is None:
            return []  # nothing new to say (a token that completes no character yet)
        logprobs = None
        if self.logprobs:
            sampled = [] if out.token_id is None else [out.token_id]  # None: finished without a token
            echo_chars = len(self.echoes[choice.index // self.n][0]) if self.echoes else 0
            logprobs = completion_logprobs(self.tokenizer, sampled, [out.logprob] * len(sampled),
                                           [out.top_logprobs] * len(sampled), echo_chars + len(choice.text) - len(text))
            if echo is not None:
                logprobs = echo[1].then(logprobs)
        if echo is not None:
            text = echo[0] + text
        piece = CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                 finish_reason=choice.finish_reason if out.finished else None)
        return [self._chunk([piece], **({"usage": None} if self.include_usage else {}))]

    def usage(self, counts: Usage) -> Completion:
        return self._chunk([], usage=counts)


@dataclass
class ChatChunks:
    """The chunks of a streamed /v1/chat/completions response. Each choice starts with a chunk giving the
    role. named: the function tool_choice names (the text is its call's arguments, streamed as they come);
    parse_calls: tools with tool_choice "auto" (the text may be a tool call, read whole when it ends)."""
    id: str
    created: int
    model: str
    tokenizer: object
    logprobs: bool
    include_usage: bool
    named: FunctionDefinition | None = None
    parse_calls: bool = False

    def _chunk(self, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def chunks(self, choice: Choice, text: str, out, first: bool) -> list[ChatCompletionChunk]:
        def one(delta: dict, logprobs=None, finish_reason=None) -> ChatCompletionChunk:
            piece = ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return self._chunk([piece], **({"usage": None} if self.include_usage else {}))
        chunks = [one({"role": "assistant", "content": ""})] if first else []  # the role comes first
        logprobs = None
        if self.logprobs and out.token_id is not None:
            logprobs = chat_logprobs(self.tokenizer, [out.token_id], [out.logprob], [out.top_logprobs])
        finish = choice.finish_reason if out.finished else None
        if self.named is not None:  # the text is the arguments of one call: the first delta names it
            call = ((tool_call(self.named.name, text) | {"index": 0}) if first
                    else {"index": 0, "function": {"arguments": text}})
            if text or first or out.finished or self.logprobs:
                chunks.append(one({"tool_calls": [call]} if text or first else {}, logprobs, finish))
        elif self.parse_calls:  # the reply may be a tool call: its text is read whole when it ends
            if out.finished:
                content, calls, finish = read_reply(choice.text, finish)
                delta = ({"content": content} if content else {}) | (
                    {"tool_calls": [c | {"index": k} for k, c in enumerate(calls)]} if calls else {})
                chunks.append(one(delta, logprobs, finish))
            elif self.logprobs:
                chunks.append(one({}, logprobs))
        elif text or out.finished or self.logprobs:
            chunks.append(one({"content": text} if text else {}, logprobs, finish))
        return chunks

    def usage(self, counts: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage=counts)
