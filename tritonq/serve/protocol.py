"""OpenAI request bodies (pydantic v2) and the error body, as vLLM and TGI accept them.

Validation happens here, before any work: a field out of range becomes a 400 whose message names
the field, the value and what is allowed. Every field is either honoured or refused, never
silently ignored:

- unknown fields are refused ("unknown field X; this server accepts: ..."),
- OpenAI fields this server does not implement (functions, function_call, parallel_tool_calls,
  suffix, ...) are refused naming the field, unless their value asks for nothing (null, or e.g.
  `function_call: "none"`),
- types are strict (JSON types as written: `"stream": "yes"`, `max_tokens: 2.5`, `"5"` for a number
  and `true` for a token id are refused; an integer is accepted for a float field),
- a string holding a lone UTF-16 surrogate (`"\\ud800"`, which cannot be encoded) is refused.

The official `openai` client sends only the fields its caller passed, so every call it can make with
supported arguments is accepted. The sampling fields (OpenAI's presence / frequency penalties,
logit_bias, logprobs / top_logprobs, echo; vLLM's top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, repetition_penalty) go to GenerationConfig; logit_bias keys must be token ids (as JSON
strings) with biases in [-100, 100], top alternatives are 0..20. The server's fairness caps (stop strings,
tokens per request) are checked by the routes (tritonq.serve.limits).

Structured outputs (tritonq.engine.structured): `response_format` {"type": "json_object"} (any JSON object) or
{"type": "json_schema", "json_schema": {"name", "schema", ...}} becomes GenerationConfig.json_schema, on
both routes; so do vLLM's extras, each onto the GenerationConfig field of its kind: `structured_outputs`
{"json" | "regex" | "choice" | "grammar" | "json_object": ...} (one of them) and the older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`. Chat `tools` with `tool_choice` "none" / "auto" /
{"type": "function", "function": {"name"}} (a named function: its output is constrained to the function's
`parameters` schema). A request takes one constraint: two of these fields (or two members of
structured_outputs) are refused with a 400 naming both.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tritonq.config import MAX_TOP_LOGPROBS, GenerationConfig
from tritonq.serve.responses import ErrorBody, ErrorDetail

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}
LOGPROB_FLOOR = -9999.0  # written for a non-finite log-probability (-inf, NaN): JSON has no inf (as vLLM)


def finite_logprob(value: float | None) -> float | None:
    """The log-probability as JSON can carry it: -inf (or NaN) becomes LOGPROB_FLOOR."""
    if value is None or math.isfinite(value):
        return value
    return LOGPROB_FLOOR


def dumps(payload) -> str:
    """JSON text of a response. allow_nan=False: a stray NaN/inf raises here instead of sending the
    invalid token `NaN`; ensure_ascii=False keeps text readable (output text is valid UTF-8)."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    """JSONResponse that never writes NaN/inf (see dumps)."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


class APIError(Exception):
    """An error answered with `status` and the OpenAI body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return ErrorBody(error=ErrorDetail(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                                           param=self.param, code=self.status)).to_json()

    def response(self) -> JSONResponse:
        # ensure_ascii: an error message may quote the caller's input, which may not be valid UTF-8
        return _ErrorJSON(self.body(), status_code=self.status, headers=self.headers)


class _ErrorJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


# Fields of the OpenAI API this server does not implement, with the values that ask for nothing.
UNSUPPORTED = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v is None,
    "suffix": lambda v: not v,
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "service_tier": lambda v: v in (None, "auto", "default"),
}
# Accepted and ignored on purpose: they change nothing about the output.
METADATA = ("user", "store", "metadata")


def _lone_surrogate(value, path: str):
    """(field path, index) of the first string in value holding a lone surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}.{i}")
            if found:
                return found
    return None


def field_error(name: str, message: str) -> PydanticCustomError:
    """A 400 whose param is `name` and whose message is `message` (for checks across fields)."""
    return PydanticCustomError("invalid_field", "{message}", {"name": name, "message": message})


class _Body(BaseModel):
    """Strict types; unknown fields refused with the list of the accepted ones."""
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data):
        if not isinstance(data, dict):
            return data
        fields = {f.alias or n for n, f in cls.model_fields.items()}
        for name, value in data.items():
            if name in fields:
                continue
            if name in UNSUPPORTED:
                raise PydanticCustomError(
                    "unsupported_field", "{name}={value} is not supported by this server; leave it out",
                    {"name": name, "value": json.dumps(value)[:80]})
            accepted = ", ".join(sorted(n for n in fields if n not in UNSUPPORTED))
            raise PydanticCustomError("unknown_field", "unknown field '{name}'; this server accepts: {accepted}",
                                      {"name": name, "accepted": accepted})
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    """response_format's json_schema: the schema (field `schema`) and its OpenAI metadata."""
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here (the grammar enforces it)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise field_error("json_schema", 'response_format {"type": "json_schema"} needs a "json_schema": '
                                              '{"name": ..., "schema": {...}}, and only that type takes one')
        return self

    def schema(self) -> dict | None:
        """The JSON schema the output must follow, or None (text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return None


def _schema(name: str, value: dict | str) -> dict:
    """A JSON schema given as a dict or as its JSON text (vLLM takes both), as a dict; a 400 naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise field_error(name, f"{name} is not valid JSON ({exc}); send a JSON schema object") from None
    if not isinstance(value, dict):
        raise field_error(name, f"{name} is a JSON {type(value).__name__}; send a JSON schema object")
    return value


def _choices(name: str, value: list[str]) -> tuple[str, ...]:
    if not value or not all(value):
        raise field_error(name, f"{name}={json.dumps(value)[:80]}; send at least one choice, each a non-empty string")
    return tuple(value)


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, choices, an EBNF grammar, or any JSON
    object."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = None
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    def constraint(self) -> dict:
        """The GenerationConfig fields of the one constraint set (a 400 unless exactly one is)."""
        given = [n for n in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if n == "json" else n) not in (None, False)]
        if len(given) != 1:
            found = f"sets {' and '.join(given)}" if given else "sets none"
            raise field_error("structured_outputs", f"structured_outputs {found}; set exactly one of json, regex, "
                                                    "choice, grammar or json_object")
        if self.json_ is not None:
            return {"json_schema": _schema("structured_outputs.json", self.json_)}
        if self.choice is not None:
            return {"choice": _choices("structured_outputs.choice", self.choice)}
        if self.json_object:
            return {"json_schema": {"type": "object"}}
        return {"regex": self.regex} if self.regex is not None else {"grammar": self.grammar}


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)       # 0 = greedy; the OpenAI default is 1
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                   # 0 or -1 = off (vLLM accepts both)
    min_p: float = Field(0.0, ge=0.0, le=1.0)      # vLLM extension: 0 = off
    min_tokens: int = Field(0, ge=0)               # vLLM extension: no EOS / stop before this many tokens
    ignore_eos: bool = False                       # vLLM extension
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)   # OpenAI: minus presence_penalty once generated
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI: minus frequency_penalty x times generated
    logit_bias: dict[str, float] | None = None     # OpenAI: {"token id": bias in [-100, 100]}
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM extension: end on these tokens
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM extension; so are the guided_* fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data):
        found = _lone_surrogate(data, "")
        if found:
            raise PydanticCustomError(
                "lone_surrogate", "{name} holds a lone UTF-16 surrogate at character {index}, which is not "
                "valid Unicode text; send valid UTF-8 (pair the surrogate or remove it)",
                {"name": found[0], "index": found[1]})
        return data

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=true")
        for name in type(self).model_fields:
            if name in UNSUPPORTED and not UNSUPPORTED[name](getattr(self, name)):
                raise PydanticCustomError(
                    "unsupported_field", "{name}={value} is not supported by this server; leave it out",
                    {"name": name, "value": json.dumps(getattr(self, name))[:80]})
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise ValueError("stop strings must be non-empty")
        SamplingRequest.output_constraint(self)  # a malformed constraint or two of them: refused with the others
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise field_error("logit_bias", f"logit_bias key {key!r} is not a token id; keys are token ids "
                                                'written as JSON strings, e.g. {"50256": -100}')
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise field_error("logit_bias", f"logit_bias[{key!r}]={bias} is out of range; a bias must be in "
                                                "[-100, 100]")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def output_constraint(self) -> tuple[dict, str | None]:
        """(the GenerationConfig fields that constrain the output, e.g. {"regex": ...}, the request field that
        asks for it), or ({}, None). Two fields asking for one are a 400 naming both."""
        asked = self._constraints()
        if len(asked) > 1:
            raise field_error(asked[1][1], f"{asked[0][1]} and {asked[1][1]} both constrain the output; pass one "
                                           "of them")
        return asked[0] if asked else ({}, None)

    def _constraints(self) -> list[tuple[dict, str]]:
        """Each (constraint, field) the request asks for (output_constraint refuses more than one)."""
        asked = []
        schema = self.response_format.schema() if self.response_format is not None else None
        if schema is not None:
            asked.append(({"json_schema": schema}, "response_format"))
        if self.structured_outputs is not None:
            asked.append((self.structured_outputs.constraint(), "structured_outputs"))
        if self.guided_json is not None:
            asked.append(({"json_schema": _schema("guided_json", self.guided_json)}, "guided_json"))
        if self.guided_regex is not None:
            asked.append(({"regex": self.guided_regex}, "guided_regex"))
        if self.guided_choice is not None:
            asked.append(({"choice": _choices("guided_choice", self.guided_choice)}, "guided_choice"))
        if self.guided_grammar is not None:
            asked.append(({"grammar": self.guided_grammar}, "guided_grammar"))
        return asked

    def top_logprobs_wanted(self) -> int:
        """How many alternatives each generated token's logprobs carry (0: the sampled token's only)."""
        return 0

    def generation_configs(self, max_new_tokens: int) -> list[GenerationConfig]:
        """One config per choice; with a seed and n > 1 choice i samples with seed + i so the
        choices differ but the whole response is repeatable."""
        constraint, _ = self.output_constraint()
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        return [GenerationConfig(max_new_tokens=max_new_tokens, temperature=self.temperature,
                                 top_k=max(self.top_k, 0), top_p=self.top_p,
                                 repetition_penalty=self.repetition_penalty, stop=self.stop_strings(),
                                 seed=None if self.seed is None else self.seed + i,
                                 min_p=self.min_p, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                                 stop_token_ids=tuple(self.stop_token_ids or ()),
                                 presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                 logit_bias=bias, top_logprobs=self.top_logprobs_wanted(), **constraint)
                for i in range(self.n)]




class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; which one is resolved by `prompts` (pydantic
    # would coerce "12" into a token id if this were a plain union of the four).
    prompt: str | list[Any]
    max_tokens: int | None = Field(None, ge=0)     # 0 only with echo: the prompt's logprobs, nothing generated
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per token
    echo: bool = False                             # prepend the prompt (and its logprobs) to each choice
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported; leave it out or set it equal to n")
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens=0 generates nothing; it is only meaningful with echo=true "
                                            "(the prompt and its logprobs). Pass max_tokens >= 1 or echo=true")
        return self

    def top_logprobs_wanted(self) -> int:
        return self.logprobs or 0

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
                         "a list of non-empty token id lists (token ids are JSON integers, not booleans "
                         "or strings)")


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None                 # a "tool" turn: the call it answers

    def for_template(self) -> dict:
        """The message as chat templates take it: tool-call arguments as a dict (OpenAI sends JSON text;
        Hermes / Qwen templates write them with `tojson`)."""
        message = {"role": self.role, "content": "" if self.content is None else self.content}
        message.update({k: v for k in ("name", "tool_call_id") if (v := getattr(self, k)) is not None})
        if self.tool_calls is not None:
            calls = []
            for call in self.tool_calls:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template gets the text as sent
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        return message


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                                 f"{self.max_completion_tokens} disagree; pass one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true (the "
                                              "alternatives come with each token's logprob); pass logprobs=true or "
                                              "leave top_logprobs out")
        choice = self.tool_choice
        if choice == "required":
            raise field_error("tool_choice", 'tool_choice="required" is not supported; use "auto" or name the '
                                              'function: {"type": "function", "function": {"name": ...}}')
        if choice not in (None, "none") and not self.tools:
            raise field_error("tool_choice", f"tool_choice={json.dumps(_plain(choice))} needs tools; pass "
                                              "tools or leave tool_choice out")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise field_error("tool_choice", f"tool_choice names the function {choice.function.name!r}, "
                                                  f"which is not in tools ({', '.join(map(repr, names))}); "
                                                  "name one of them")
            asked = self._constraints()
            if asked:
                raise field_error(asked[0][1], f"tool_choice naming a function and {asked[0][1]} both constrain "
                                               "the output; pass one of them")
        return self

    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def named_tool(self) -> FunctionDefinition | None:
        """The function tool_choice names (its call is the whole reply), or None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)
        return None

    def parses_tool_calls(self) -> bool:
        """tools with tool_choice "auto" (the default when tools are given): tool calls are read from the text."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def output_constraint(self) -> tuple[dict, str | None]:
        named = self.named_tool()
        if named is not None:  # the reply is this function's arguments
            return {"json_schema": named.parameters if named.parameters is not None else {"type": "object"}}, \
                "tool_choice"
        return super().output_constraint()


def _plain(value):
    return value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
