"""The FastAPI app: OpenAI routes over an EngineLoop.

Every request is validated (pydantic, then prompt length against the context) before anything is
queued; errors use the OpenAI body {"error": {message, type, param, code}}. A response is either
one JSON body or server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`); choice i of
prompt p has index p * n + i, as in vLLM.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonq.serve.engine_loop import EngineLoop, Event, QueueFull, Stream
from tritonq.serve.metrics import ServerMetrics
from tritonq.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DISCONNECT_POLL_S = 0.5  # how often a request with no new tokens checks whether its client left


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always calls on_close, however it ends (done, client gone, cancelled)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Choice:
    """Accumulated state of one choice (one engine request)."""
    __slots__ = ("index", "prompt_tokens", "text", "tokens", "token_ids", "logprobs", "finish_reason", "started")

    def __init__(self, index: int, prompt_tokens: int):
        self.index, self.prompt_tokens = index, prompt_tokens
        self.text, self.tokens, self.token_ids, self.logprobs = "", 0, [], []
        self.finish_reason, self.started = None, False


def create_app(model, served_model_name: str, *, api_key: str | None = None,
               max_waiting: int | None = None) -> FastAPI:
    """The app over a loaded tritonq Model (its engine runs in a background thread while the app lives)."""
    tokenizer, engine, max_seq_len = model.tokenizer, model.engine, model.max_seq_len
    metrics = ServerMetrics(served_model_name)
    engine_loop = EngineLoop(engine, metrics, max_waiting)
    metrics.update_engine(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="tritonq", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    # ---- errors -------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "json_invalid":
            param = None
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            message = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                f"{e.get('msg', '').removeprefix('Value error, ')}"
                + (f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], (dict, list)) else "")
                for e in errors)
        return APIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with (--api-key)")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{served_model_name}`.",
                           "model")

    # ---- health, models, metrics --------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine_loop.dead is not None:
            return APIError(503, f"the engine loop has died: {engine_loop.dead}").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tritonq", "max_model_len": max_seq_len}]}

    # ---- generation ---------------------------------------------------------------------
    async def start(body: SamplingRequest, prompts: list[list[int]]) -> Stream:
        """Check every prompt against the context, then queue prompts x n choices on the engine."""
        configs = []
        for i, prompt in enumerate(prompts):
            name = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            if not prompt:
                raise APIError(400, f"{name} has no tokens; give at least one token.", "prompt")
            max_tokens = body.max_tokens if body.max_tokens is not None else max_seq_len - len(prompt)
            if max_tokens < 1 or len(prompt) + max_tokens > max_seq_len:
                raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, "
                                    f"{name} has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                                    f"{len(prompt) + max_tokens} tokens in all. Shorten the prompt or lower "
                                    "max_tokens.", "max_tokens" if body.max_tokens is not None else "prompt")
            try:
                engine.check_request(len(prompt), max_tokens)  # reads constants only: safe off the engine thread
                configs.append(body.generation_configs(max_tokens))
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
        try:
            return await engine_loop.submit(prompts, configs)
        except QueueFull as exc:
            raise APIError(429, str(exc)) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc)) from None

    def choices_of(stream: Stream, n: int) -> dict[int, _Choice]:
        rids = iter(stream.request_ids)
        return {next(rids): _Choice(p * n + c, len(prompt))
                for p, prompt in enumerate(stream.prompts) for c in range(n)}

    def apply(stream: Stream, choice: _Choice, out) -> str:
        """Record one RequestOutput on its choice; returns its new text."""
        if not choice.started:
            choice.started = True
            engine_loop.mark_started(stream)
        if out.token_id is not None:
            choice.tokens += 1
            choice.token_ids.append(out.token_id)
            choice.logprobs.append(out.logprob)
        choice.text += out.text
        if out.finished:
            choice.finish_reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        return out.text

    async def next_event(stream: Stream, request: Request) -> Event | None:
        """The stream's next event, or None once the client has gone."""
        while True:
            try:
                return await asyncio.wait_for(stream.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def collect(stream: Stream, request: Request, n: int) -> list[_Choice]:
        """Run a non-streamed request to the end; aborts it if the client leaves."""
        choices = choices_of(stream, n)
        try:
            while any(c.finish_reason is None for c in choices.values()):
                event = await next_event(stream, request)
                if event is None:
                    raise APIError(499, "client disconnected")
                if event.error is not None:
                    raise APIError(503, event.error)
                for out in event.outputs:
                    apply(stream, choices[out.request_id], out)
        finally:
            engine_loop.release(stream)
        return sorted(choices.values(), key=lambda c: c.index)

    def usage_of(choices: list[_Choice], n: int) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in choices if c.index % n == 0)
        completion = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def completion_logprobs(choice: _Choice, token_ids, logprobs, offset: int) -> dict:
        tokens = [tokenizer.decode([t]) for t in token_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(token_ids, logprobs) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            text = tokenizer.decode([t])
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    def stream_events(stream: Stream, request: Request, n: int, chunk, include_usage: bool):
        """The SSE body: chunk(choice, new_text, out) -> a chunk dict or None; ends with usage and [DONE]."""
        async def body():
            choices = choices_of(stream, n)
            while any(c.finish_reason is None for c in choices.values()):
                event = await next_event(stream, request)
                if event is None:
                    return
                if event.error is not None:
                    yield _sse(APIError(503, f"the request was interrupted: {event.error}").body())
                    yield "data: [DONE]\n\n"
                    return
                for out in event.outputs:
                    choice = choices[out.request_id]
                    first = not choice.started
                    text = apply(stream, choice, out)
                    payload = chunk(choice, text, out, first)
                    for item in payload if isinstance(payload, list) else [payload] if payload else []:
                        yield _sse(item)
            if include_usage:
                yield _sse(chunk(None, "", None, False) | {"choices": [],
                                                            "usage": usage_of(list(choices.values()), n)})
            yield "data: [DONE]\n\n"
        return _SSEResponse(body(), on_close=lambda: engine_loop.release(stream))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        try:
            prompts = [tokenizer(p).input_ids if isinstance(p, str) else p for p in body.prompts()]
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        stream = await start(body, prompts)
        rid, created, want_logprobs = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.logprobs is not None
        base = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(choice, text, out, first):
                if choice is None:
                    return dict(base)
                if not text and not out.finished and not want_logprobs:
                    return None
                logprobs = None
                if want_logprobs and out.token_id is not None:
                    logprobs = completion_logprobs(choice, [out.token_id], [out.logprob], len(choice.text) - len(text))
                payload = base | {"choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                                "finish_reason": choice.finish_reason if out.finished else None}]}
                return payload | ({"usage": None} if include_usage else {})
            return stream_events(stream, request, body.n, chunk, include_usage)
        choices = await collect(stream, request, body.n)
        return base | {
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c, c.token_ids, c.logprobs, 0) if want_logprobs else None}
                        for c in choices],
            "usage": usage_of(choices, body.n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
            raise APIError(400, f"the messages do not fit the chat template: {exc}", "messages") from None
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        stream = await start(body, [prompt])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": served_model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(choice, text, out, first):
                if choice is None:
                    return base | {"object": "chat.completion.chunk"}
                def one(delta, logprobs=None, finish_reason=None):
                    return base | {"object": "chat.completion.chunk",
                                   "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": finish_reason}]} | (
                        {"usage": None} if include_usage else {})
                chunks = [one({"role": "assistant", "content": ""})] if first else []  # the role comes first
                if text or out.finished or body.logprobs:
                    logprobs = None
                    if body.logprobs and out.token_id is not None:
                        logprobs = chat_logprobs([out.token_id], [out.logprob])
                    chunks.append(one({"content": text} if text else {}, logprobs,
                                      choice.finish_reason if out.finished else None))
                return chunks
            return stream_events(stream, request, body.n, chunk, include_usage)
        choices = await collect(stream, request, body.n)
        return base | {
            "object": "chat.completion",
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(c.token_ids, c.logprobs) if body.logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_of(choices, body.n)}

    return app
