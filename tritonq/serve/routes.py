"""The routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

They read what they serve from `request.app.state` (set by create_app): `model` (the tritonq Model: its
tokenizer, engine and chat_prompt), `engine_loop`, `metrics`, `served_model_name`, `tokenizer_pool` and `grammar_pool`.

Order of work for a request, cheapest check first: the API key and the body size (app._Guard, before the
body is parsed), pydantic validation (protocol), tokenization and chat templating (Model.chat_prompt), then
`Engine.check_request` on every prompt x choice (the fit rule, token ids, the output's grammar compiled),
in small thread pools off the event loop (a request whose output follows a schema is checked on its own
pool: that check compiles the grammar), then (completions with `echo` and `logprobs`) the prompts
scored by `Engine.score` on the engine thread, then the queue bound (--max-waiting); only then is anything
queued. A response is one JSON body (replies) or server-sent events (sse).
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tritonq.engine.engine import CheckedRequest, top_dicts
from tritonq.engine.sequence import RequestTooLong
from tritonq.serve import replies
from tritonq.serve.dispatch import collect, score, submit
from tritonq.serve.errors import api_error
from tritonq.serve.logprobs import completion_logprobs
from tritonq.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from tritonq.serve.responses import CompletionLogprobs, ModelCard, ModelList
from tritonq.serve.sse import ChatChunks, CompletionChunks, stream_response
from tritonq.engine.structured import GrammarError

router = APIRouter()


async def _off_loop(request: Request, fn, *args, pool: str = "tokenizer_pool", **kwargs):
    """Run fn (tokenizer work: up to --max-request-bytes of text) in a pool of the app's, not on the event loop."""
    executor = getattr(request.app.state, pool)
    return await asyncio.get_running_loop().run_in_executor(executor, lambda: fn(*args, **kwargs))


async def _checked_configs(request: Request, body: SamplingRequest, prompts: list[list[int]]) -> list[list]:
    """_sampling_configs off the loop: on the grammar pool when the output follows a schema (its check compiles
    the grammar, up to structured.COMPILE_TIMEOUT_S), so plain requests never wait behind a compile."""
    constrained = bool(body.output_constraint()[0])
    return await _off_loop(request, _sampling_configs, request.app.state.model, body, prompts,
                           pool="grammar_pool" if constrained else "tokenizer_pool")


def _check_model(request: Request, name: str | None) -> None:
    served = request.app.state.served_model_name
    if name is not None and name != served:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.", "model")


# ---- health, models, metrics --------------------------------------------------------------
@router.get("/health")
async def health(request: Request):
    engine_loop = request.app.state.engine_loop
    if engine_loop.why_dead() is not None:
        return APIError(503, f"the engine loop has died: {engine_loop.dead}; the process exits so a supervisor "
                             "can restart it").response()
    return Response(status_code=200)


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state
    card = ModelCard(id=state.served_model_name, created=int(time.time()), max_model_len=state.model.max_seq_len)
    return ModelList(data=[card]).to_json()


# ---- generation ---------------------------------------------------------------------------
def _max_tokens(model, body: SamplingRequest, prompt: list[int]) -> int:
    """The most tokens a choice of this prompt may generate: max_tokens, or left out the rest of the context (at
    least 1, 0 with echo: a prompt too long for it is refused by the fit rule, naming the numbers)."""
    least = 0 if getattr(body, "echo", False) else 1  # max_tokens=0 generates nothing: echo only
    return body.max_tokens if body.max_tokens is not None else max(model.max_seq_len - len(prompt), least)


def _check_limits(request: Request, body: SamplingRequest, prompts: list[list[int]]) -> None:
    """The server's fairness caps (tritonq.serve.limits): past one, a 400 naming it and its option."""
    state = request.app.state
    refused = state.limits.refusal(body.stop_strings(), body.n, [_max_tokens(state.model, body, p) for p in prompts],
                                   body.max_tokens is not None)
    if refused is not None:
        raise APIError(400, refused[1], refused[0])


def _sampling_configs(model, body: SamplingRequest, prompts: list[list[int]]) -> list[list[CheckedRequest]]:
    """Per prompt, its n choices validated by Engine.check_request (the request's one validation; run off the
    loop: it may compile the output's grammar), ready to queue; a refusal is a 400 naming the field to change."""
    schema_field = body.output_constraint()[1]
    configs = []
    for i, prompt in enumerate(prompts):
        name = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        try:
            configs.append([model.engine.check_request(prompt, config, name=name)
                            for config in body.generation_configs(_max_tokens(model, body, prompt))])
        except RequestTooLong as exc:  # the fit rule's numbers, led by OpenAI's words (clients match on them)
            given = body.max_tokens is not None
            raise APIError(400, f"This model's maximum context length is {model.max_seq_len} tokens; {exc}"
                                + (" (max_new_tokens is max_tokens)" if given else ""),
                           "max_tokens" if given else "prompt") from None
        except (GrammarError, ModuleNotFoundError) as exc:  # the schema, or xgrammar not installed
            raise APIError(400, f"{schema_field}: {exc}", schema_field) from None
        except (ValueError, TypeError) as exc:  # the engine's checks name the field first
            param = next((f for f in ("stop_token_ids", "logit_bias") if str(exc).startswith(f)), "prompt")
            raise api_error(exc, param=param) from None
    return configs


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    _check_model(request, body.model)
    state = request.app.state
    tokenizer = state.model.tokenizer
    try:
        texts = body.prompts()
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from None
    try:
        encoded = await _off_loop(request, lambda: [tokenizer(p).input_ids for p in texts if isinstance(p, str)])
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from None
    prompts = [encoded.pop(0) if isinstance(p, str) else p for p in texts]
    _check_limits(request, body, prompts)
    configs = await _checked_configs(request, body, prompts)
    echoes = await _echo_parts(request, body, texts, prompts) if body.echo else None
    stream = await submit(state.engine_loop, prompts, configs, body.n)
    ids = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.served_model_name)
    if body.stream:
        chunker = CompletionChunks(**ids, tokenizer=tokenizer, n=body.n, logprobs=body.logprobs is not None,
                                   include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                   echoes=echoes)
        return stream_response(state.engine_loop, stream, request, body.n, chunker)
    choices = await collect(state.engine_loop, stream, request, body.n)
    return replies.completion(body, choices, tokenizer, **ids, echoes=echoes).to_json()


async def _echo_parts(request: Request, body: CompletionRequest, texts: list,
                      prompts: list[list[int]]) -> list[tuple[str, CompletionLogprobs | None]]:
    """Per prompt, what echo prepends to each of its choices: (text, its logprobs or None). The prompt's
    logprobs come from scoring requests on the engine (dispatch.score; entry 0 None: no context)."""
    state = request.app.state
    tokenizer = state.model.tokenizer
    echo_texts = [t if isinstance(t, str) else await _off_loop(request, tokenizer.decode, t) for t in texts]
    if body.logprobs is None:
        return [(t, None) for t in echo_texts]
    scored = await score(state.engine_loop, prompts, body.logprobs, request)
    parts = []
    for text, prompt, (logprobs, _, top) in zip(echo_texts, prompts, scored):
        tops = [None] + (top_dicts(top) if top is not None else [None] * len(logprobs))
        parts.append((text, completion_logprobs(tokenizer, prompt, [None] + logprobs.tolist(), tops, 0)))
    return parts


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    _check_model(request, body.model)
    state = request.app.state
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        prompt = await _off_loop(request, state.model.chat_prompt, [m.for_template() for m in body.messages],
                                 tools=tools)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
        if str(exc).startswith("tools:"):  # Model.chat_prompt: the template does not render tools
            raise APIError(400, str(exc), "tools") from None
        raise APIError(400, f"the messages do not fit the chat template: {exc}", "messages") from None
    _check_limits(request, body, [prompt])
    configs = await _checked_configs(request, body, [prompt])
    stream = await submit(state.engine_loop, [prompt], configs, body.n)
    ids = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.served_model_name)
    if body.stream:
        chunker = ChatChunks(**ids, tokenizer=state.model.tokenizer, logprobs=body.logprobs,
                             include_usage=bool(body.stream_options and body.stream_options.include_usage),
                             named=body.named_tool(), parse_calls=body.parses_tool_calls())
        return stream_response(state.engine_loop, stream, request, body.n, chunker)
    choices = await collect(state.engine_loop, stream, request, body.n)
    return replies.chat_completion(body, choices, state.model.tokenizer, **ids).to_json()
