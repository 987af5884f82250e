"""OpenAI request bodies (pydantic v2) and the error body, as vLLM and TGI accept them.

Validation happens here, before any work: a field out of range becomes a 400 whose message names
the field, the value and what is allowed. Unknown extra fields are accepted and ignored, as vLLM
does, except the OpenAI sampling knobs this server cannot honour (penalties, logit_bias, suffix,
echo), which are refused instead of silently ignored.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tritonq.generate import GenerationConfig

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with `status` and the OpenAI body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)       # 0 = greedy; the OpenAI default is 1
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                   # 0 or -1 = off (vLLM accepts both)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name}={getattr(self, name)} is not supported; leave it at 0 "
                                 "(repetition_penalty is available)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported; leave it out")
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise ValueError("stop strings must be non-empty")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def generation_configs(self, max_new_tokens: int) -> list[GenerationConfig]:
        """One config per choice; with a seed and n > 1 choice i samples with seed + i so the
        choices differ but the whole response is repeatable."""
        return [GenerationConfig(max_new_tokens=max_new_tokens, temperature=self.temperature,
                                 top_k=max(self.top_k, 0), top_p=self.top_p,
                                 repetition_penalty=self.repetition_penalty, stop=self.stop_strings(),
                                 seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; which one is resolved by `prompts` (pydantic
    # would coerce "12" into a token id if this were a plain union of the four).
    prompt: str | list[Any]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.echo:
            raise ValueError("echo=true is not supported; the response carries the completion only")
        if self.suffix:
            raise ValueError("suffix is not supported; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported; leave it out or set it equal to n")
        if self.logprobs:
            raise ValueError(f"logprobs={self.logprobs} asks for the top {self.logprobs} alternatives per "
                             "token; this server returns only the sampled token's log-probability: "
                             "pass logprobs=0")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of texts or token id lists; raises ValueError on anything else."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(type(t) is int for t in p):
            return [list(p)]
        if p and all(isinstance(t, str) for t in p):
            return list(p)
        if p and all(isinstance(t, list) and t and all(type(i) is int for i in t) for t in p):
            return [list(t) for t in p]
        raise ValueError("prompt must be a non-empty string, a list of strings, a list of token ids or "
                         "a list of non-empty token id lists")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as one string: text parts of a multi-part content are joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported; "
                                 "only 'text' parts are")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                                 f"{self.max_completion_tokens} disagree; pass one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} is not supported; this server returns "
                             "only the sampled token's log-probability (logprobs=true, top_logprobs=0)")
        if self.tools:
            raise ValueError("tools are not supported; leave them out")
        return self

