"""OpenAI response bodies (pydantic v2): completions, chat completions, their stream chunks, models, errors.

Which fields a body writes follows one rule (`_Response`): a field whose default is None is written only
when it was set (to anything, None included), every other field always. So a chunk carries "usage": null only
where the caller asked for usage, a delta only the parts it has, and a tool call delta only its arguments,
as OpenAI's and vLLM's bodies do. `to_json()` gives the dict the routes send; it keeps floats as they are so
that `protocol.dumps` refuses a stray NaN / inf instead of writing it (pydantic's JSON mode would write null).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class _Response(BaseModel):
    """A response body: fields defaulting to None are left out unless set (see the module docstring)."""

    def model_post_init(self, context) -> None:
        # Fields with a real default (object names, "assistant") count as set, so exclude_unset keeps them.
        self.model_fields_set.update(n for n, f in type(self).model_fields.items() if f.default is not None)

    def to_json(self) -> dict:
        return self.model_dump(exclude_unset=True)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---- completions ------------------------------------------------------------------------
class CompletionLogprobs(_Response):
    """Per token: its text, logprob, {text: logprob} of it and the most likely alternatives (vLLM's shape),
    and the character offset of its text; None logprob / top entry for an echoed prompt's first token."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def then(self, later: CompletionLogprobs) -> CompletionLogprobs:
        """These tokens followed by later's (an echoed prompt's, then the generated ones)."""
        return CompletionLogprobs(**{name: getattr(self, name) + getattr(later, name)
                                     for name in type(self).model_fields})


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(_Response):
    """A /v1/completions body; also each of its stream chunks (OpenAI names both "text_completion")."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # a chunk: set (to null) only when the stream ends with a usage chunk


# ---- chat completions -------------------------------------------------------------------
class FunctionCall(_Response):
    name: str | None = None  # a streamed call's later deltas carry only more arguments
    arguments: str


class ToolCall(_Response):
    index: int | None = None  # stream deltas only: which call of the message this is
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class Delta(_Response):
    """What a chat stream chunk adds to its choice's message: any of these, or nothing ({})."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # set (to null) only when the stream ends with a usage chunk


# ---- models and errors ------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonq"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(_Response):
    """{"error": {message, type, param, code}}: every error the server answers, as OpenAI writes them."""
    error: ErrorDetail
