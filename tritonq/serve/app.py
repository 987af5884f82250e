"""The FastAPI app: OpenAI routes over an EngineLoop.

Order of work for a request, cheapest check first: the API key (before the body is read), the
body size (--max-request-bytes, before it is parsed), pydantic validation, tokenization and chat
templating (in a small thread pool, off the event loop), then `Engine.check_request` on every
prompt x choice, then (completions with `echo` and `logprobs`) the prompts scored by `Engine.score` on
the engine thread, then the queue bound (--max-waiting); only then is anything queued. Errors use
the OpenAI body {"error": {message, type, param, code}}. A response is either one JSON body or
server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`); choice i of prompt p has index
p * n + i, as in vLLM. A request the engine failed is answered 500 (streaming: an error chunk, then
[DONE]); JSON never carries NaN or inf (a -inf log-probability is written as -9999.0, as vLLM).
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonq.generate import GenerationConfig, text_message, top_dicts
from tritonq.serve.engine_loop import EngineLoop, Event, QueueFull, Stream
from tritonq.serve.metrics import ServerMetrics
from tritonq.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest,
                                    StrictJSONResponse, dumps, finite_logprob)
from tritonq.serve.tools import parse_tool_calls, tool_call
from tritonq.structured import constraint_of

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DISCONNECT_POLL_S = 0.5    # how often a request checks whether its client left (busy or not)
ACCEPT_TIMEOUT_S = 60.0    # the engine thread takes commands between steps: a minute means it is stuck
RETRY_AFTER_S = 1          # the Retry-After of a 429: a waiting request usually starts within a second
MAX_REQUEST_BYTES = 2 << 20  # default --max-request-bytes: a 128k-token prompt fits, as text or as ids
TOKENIZER_THREADS = 2      # tokenization / chat templating off the event loop (HF tokenizers release the GIL)
OPEN_PATHS = ("/health",)  # the only routes that never need the API key


class _Guard:
    """ASGI middleware, before routing and body parsing: the API key, then the body size.

    The key is checked first so an unauthenticated caller learns nothing about bodies; the body is
    read here (counting bytes, so a chunked body without Content-Length is bounded too) and replayed
    to the app, whose later `receive` calls (disconnect checks) go to the client."""

    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...], max_request_bytes: int):
        self.app, self.api_key, self.open_paths, self.limit = app, api_key, open_paths, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in self.open_paths and not self._authorized(scope):
            denied = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                   "with the key the server was started with (--api-key)")
            return await denied.response()(scope, receive, send)
        headers = dict(scope["headers"])
        too_big = APIError(413, f"the request body is larger than this server's limit of {self.limit} bytes "
                                "(--max-request-bytes); send a smaller request")
        try:
            if int(headers.get(b"content-length", b"0")) > self.limit:
                return await too_big.response()(scope, receive, send)
        except ValueError:
            return await APIError(400, "the Content-Length header is not a number").response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone while sending
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await too_big.response()(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.strip().partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())


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
    return f"data: {dumps(payload)}\n\n"


class _Choice:
    """Accumulated state of one choice (one engine request)."""
    __slots__ = ("index", "prompt_tokens", "text", "tokens", "token_ids", "logprobs", "tops", "finish_reason",
                 "started")

    def __init__(self, index: int, prompt_tokens: int):
        self.index, self.prompt_tokens = index, prompt_tokens
        self.text, self.tokens, self.token_ids, self.logprobs, self.tops = "", 0, [], [], []
        self.finish_reason, self.started = None, False


def create_app(model, served_model_name: str, *, api_key: str | None = None, max_waiting: int | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, open_metrics: bool = False, on_dead=None) -> FastAPI:
    """The app over a loaded tritonq Model (its engine runs in a background thread while the app lives).

    api_key: required on every route but /health (and /metrics with open_metrics). on_dead(reason):
    called from the engine thread once the engine cannot continue (the command line exits non-zero)."""
    tokenizer, engine, max_seq_len = model.tokenizer, model.engine, model.max_seq_len
    metrics = ServerMetrics(served_model_name)
    engine_loop = EngineLoop(engine, metrics, max_waiting, on_dead=on_dead)
    metrics.update_engine(engine)
    tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tritonq-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()
        tokenizer_pool.shutdown(wait=False)

    app = FastAPI(title="tritonq", lifespan=lifespan, default_response_class=StrictJSONResponse)
    app.state.engine_loop = engine_loop
    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=max_request_bytes,
                       open_paths=OPEN_PATHS + (("/metrics",) if open_metrics else ()))

    async def off_loop(fn, *args, **kwargs):
        """Run fn (tokenizer work: up to --max-request-bytes of text) in the pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, lambda: fn(*args, **kwargs))

    # ---- errors -------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") in ("unknown_field", "unsupported_field", "lone_surrogate", "invalid_field"):
            # raised by a model validator: its loc is the object, ctx names the field inside it
            param = ".".join(filter(None, [param, str(first["ctx"]["name"])]))
            whole = "." not in param or first["type"] in ("lone_surrogate", "invalid_field")
            return APIError(400, first["msg"] if whole else f"{param}: {first['msg']}", param).response()
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

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{served_model_name}`.",
                           "model")

    # ---- health, models, metrics --------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine_loop.why_dead() is not None:
            return APIError(503, f"the engine loop has died: {engine_loop.dead}; the process exits so a "
                                 "supervisor can restart it").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request):
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tritonq", "max_model_len": max_seq_len}]}

    # ---- generation ---------------------------------------------------------------------
    async def check_output_schema(body: SamplingRequest) -> None:
        """Compile the schema the output must follow once here (off the loop, into the engine's grammar
        cache), so a bad one is a 400 naming its field before anything is queued."""
        schema, field = body.output_schema()
        if schema is not None:
            try:
                await off_loop(engine.grammars.compile, constraint_of(GenerationConfig(json_schema=schema)))
            except (ValueError, TypeError, ModuleNotFoundError) as exc:
                raise APIError(400, f"{field}: {exc}", field) from None

    def configs_for(body: SamplingRequest, prompts: list[list[int]]) -> list[list]:
        """Every prompt checked against the context and the engine (400 naming what is wrong): the
        GenerationConfigs of its n choices. max_tokens=0 is allowed with echo only."""
        least = 0 if getattr(body, "echo", False) else 1
        configs = []
        for i, prompt in enumerate(prompts):
            name = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            if not prompt:
                raise APIError(400, f"{name} has no tokens; give at least one token.", "prompt")
            max_tokens = body.max_tokens if body.max_tokens is not None else max_seq_len - len(prompt)
            if max_tokens < least or len(prompt) + max_tokens > max_seq_len:
                raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, "
                                    f"{name} has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                                    f"{len(prompt) + max_tokens} tokens in all. Shorten the prompt or lower "
                                    "max_tokens.", "max_tokens" if body.max_tokens is not None else "prompt")
            try:
                choices = body.generation_configs(max_tokens)
                for config in choices:  # reads constants only: safe off the engine thread
                    engine.check_request(prompt, config, name=name)
            except (ValueError, TypeError) as exc:  # the engine's checks name the field first
                param = next((f for f in ("stop_token_ids", "logit_bias") if str(exc).startswith(f)), "prompt")
                raise APIError(400, str(exc), param) from None
            configs.append(choices)
        return configs

    async def submit(body: SamplingRequest, prompts: list[list[int]], configs: list[list]) -> Stream:
        """Queue prompts x n choices (configs_for's) on the engine."""
        total = len(prompts) * body.n
        if engine_loop.max_waiting is not None and total > engine_loop.max_waiting:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} = {total} sequences, but this server "
                                f"queues at most {engine_loop.max_waiting} (--max-waiting), so the request can "
                                "never be accepted; send fewer prompts or a smaller n", "n")
        try:
            return await engine_loop.submit(prompts, configs, ACCEPT_TIMEOUT_S)
        except QueueFull as exc:
            raise APIError(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - Refused("internal"): the engine failed to add it
            raise APIError(500, str(exc)) from None

    def choices_of(stream: Stream, n: int) -> dict[int, _Choice]:
        rids = iter(stream.request_ids)
        return {next(rids): _Choice(p * n + c, len(prompt))
                for p, prompt in enumerate(stream.prompts) for c in range(n)}

    def apply(stream: Stream, choice: _Choice, out) -> str:
        """Record one RequestOutput on its choice; returns its new text."""
        if not choice.started:
            choice.started = True
            engine_loop.mark_started(stream)
        if out.finished and out.finish_reason == "error":  # the engine failed this request
            raise _Failed(out.error or "the engine failed this request")
        if out.token_id is not None:
            choice.tokens += 1
            choice.token_ids.append(out.token_id)
            choice.logprobs.append(finite_logprob(out.logprob))
            choice.tops.append(out.top_logprobs)
        choice.text += out.text
        if out.finished:
            choice.finish_reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        return out.text

    async def next_event(stream: Stream, request: Request) -> Event | None:
        """The stream's next event, or None once the client has gone. The client is checked every
        DISCONNECT_POLL_S whether events flow or not (a busy request must notice too); a dead engine
        ends the wait with an error event."""
        while True:
            now = time.monotonic()
            if now - stream.checked >= DISCONNECT_POLL_S:
                stream.checked = now
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(stream.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if engine_loop.why_dead() is not None:
                    return Event(error=f"the engine loop has died: {engine_loop.dead}")

    async def collect(stream: Stream, request: Request, n: int) -> list[_Choice]:
        """Run a non-streamed request to the end; aborts it if the client leaves."""
        choices = choices_of(stream, n)
        try:
            while any(c.finish_reason is None for c in choices.values()):
                event = await next_event(stream, request)
                if event is None:
                    raise APIError(499, "client disconnected")
                if event.error is not None:
                    raise APIError(event.status, event.error)
                for out in event.outputs:
                    apply(stream, choices[out.request_id], out)
        except _Failed as exc:
            raise APIError(500, f"generation failed: {exc}") from None
        finally:
            engine_loop.release(stream)
        return sorted(choices.values(), key=lambda c: c.index)

    def usage_of(choices: list[_Choice], n: int) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in choices if c.index % n == 0)
        completion = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def completion_logprobs(token_ids, logprobs, tops, offset: int) -> dict:
        """The completions `logprobs` object of these tokens, text starting at character `offset`: per token
        its text, logprob, and top_logprobs {text: logprob} of the sampled token and the `logprobs` most
        likely ones (vLLM's shape: up to logprobs + 1 entries); None for an echoed prompt's first token."""
        tokens = [tokenizer.decode([t]) for t in token_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top_logprobs = []
        for text, lp, top in zip(tokens, logprobs, tops):
            if lp is None:  # the first prompt token: nothing before it to predict it from
                top_logprobs.append(None)
                continue
            entry = {text: finite_logprob(lp)}
            for t, alt in (top or {}).items():
                entry.setdefault(tokenizer.decode([t]), finite_logprob(alt))
            top_logprobs.append(entry)
        return {"tokens": tokens, "token_logprobs": [finite_logprob(lp) for lp in logprobs],
                "top_logprobs": top_logprobs, "text_offset": offsets}

    def joined_logprobs(first: dict, second: dict) -> dict:
        return {key: first[key] + second[key] for key in first}

    def chat_logprobs(token_ids, logprobs, tops) -> dict:
        """The chat `logprobs` object: per token its text, logprob, bytes and top_logprobs, the
        top_logprobs most likely tokens (OpenAI's shape; [] when not asked for)."""
        content = []
        for t, lp, top in zip(token_ids, logprobs, tops):
            text = tokenizer.decode([t])
            alternatives = [{"token": s, "logprob": finite_logprob(a), "bytes": list(s.encode())}
                            for s, a in ((tokenizer.decode([i]), a) for i, a in (top or {}).items())]
            content.append({"token": text, "logprob": finite_logprob(lp), "bytes": list(text.encode()),
                            "top_logprobs": alternatives})
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
                    yield _sse(APIError(event.status, f"the request was interrupted: {event.error}").body())
                    yield "data: [DONE]\n\n"
                    return
                for out in event.outputs:
                    choice = choices[out.request_id]
                    first = not choice.started
                    try:
                        text = apply(stream, choice, out)
                    except _Failed as exc:
                        yield _sse(APIError(500, f"generation failed: {exc}").body())
                        yield "data: [DONE]\n\n"
                        return
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
        check_model(body.model)
        try:
            texts = body.prompts()
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        try:
            encoded = await off_loop(lambda: [tokenizer(p).input_ids for p in texts if isinstance(p, str)])
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from None
        prompts = [encoded.pop(0) if isinstance(p, str) else p for p in texts]
        await check_output_schema(body)
        configs = configs_for(body, prompts)
        want_logprobs = body.logprobs is not None
        echoes = await echo_parts(body, texts, prompts) if body.echo else None
        stream = await submit(body, prompts, configs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(choice, text, out, first):
                if choice is None:
                    return dict(base)
                echo = echoes[choice.index // body.n] if echoes and first else None
                if not text and not out.finished and not want_logprobs and echo is None:
                    return None
                logprobs = None
                echo_chars = len(echoes[choice.index // body.n][0]) if echoes else 0
                if want_logprobs:
                    sampled = [] if out.token_id is None else [out.token_id]  # None: finished without a token
                    logprobs = completion_logprobs(sampled, [out.logprob] * len(sampled),
                                                   [out.top_logprobs] * len(sampled),
                                                   echo_chars + len(choice.text) - len(text))
                    if echo is not None:
                        logprobs = joined_logprobs(echo[1], logprobs)
                if echo is not None:
                    text = echo[0] + text
                payload = base | {"choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                                "finish_reason": choice.finish_reason if out.finished else None}]}
                return payload | ({"usage": None} if include_usage else {})
            return stream_events(stream, request, body.n, chunk, include_usage)
        choices = await collect(stream, request, body.n)

        def one(c: _Choice) -> dict:
            echo_text, echo_logprobs = echoes[c.index // body.n] if echoes else ("", None)
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(c.token_ids, c.logprobs, c.tops, len(echo_text))
                logprobs = joined_logprobs(echo_logprobs, logprobs) if echoes else logprobs
            return {"index": c.index, "text": echo_text + c.text, "finish_reason": c.finish_reason,
                    "logprobs": logprobs}
        return base | {"choices": [one(c) for c in choices], "usage": usage_of(choices, body.n)}

    async def echo_parts(body: CompletionRequest, texts: list, prompts: list[list[int]]) -> list[tuple]:
        """Per prompt, what echo prepends to each of its choices: (text, its logprobs object or None). The
        prompt's logprobs come from Engine.score on the engine thread (entry 0 None: no context)."""
        echo_texts = [t if isinstance(t, str) else await off_loop(tokenizer.decode, t) for t in texts]
        if body.logprobs is None:
            return [(t, None) for t in echo_texts]
        try:
            scored = await engine_loop.score(prompts, body.logprobs, ACCEPT_TIMEOUT_S)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        except RuntimeError as exc:
            raise APIError(503, f"scoring the prompt for echo failed: {exc}") from None
        parts = []
        for text, prompt, (logprobs, _, top) in zip(echo_texts, prompts, scored):
            tops = [None] + (top_dicts(top) if top is not None else [None] * len(logprobs))
            parts.append((text, completion_logprobs(prompt, [None] + logprobs.tolist(), tops, 0)))
        return parts

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            messages = [text_message(i, m.for_template()) for i, m in enumerate(body.messages)]
            text = await off_loop(tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                  tokenize=False, **({"tools": tools} if tools else {}))
            if tools and text == await off_loop(tokenizer.apply_chat_template, messages,
                                                add_generation_prompt=True, tokenize=False):
                raise APIError(400, "this model's chat template does not render tools, so the model would "
                                    "never see them; leave tools out (or serve a model whose template takes "
                                    "tools, e.g. Hermes / Qwen style)", "tools")
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
            raise APIError(400, f"the messages do not fit the chat template: {exc}", "messages") from None
        prompt = await off_loop(lambda: tokenizer(text, add_special_tokens=False).input_ids)
        named, parse_calls = body.named_tool(), body.parses_tool_calls()
        await check_output_schema(body)
        stream = await submit(body, [prompt], configs_for(body, [prompt]))
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
                logprobs = None
                if body.logprobs and out.token_id is not None:
                    logprobs = chat_logprobs([out.token_id], [out.logprob], [out.top_logprobs])
                finish = choice.finish_reason if out.finished else None
                if named is not None:  # the text is the arguments of one call, streamed as they come
                    call = {"index": 0, "function": {"arguments": text}}
                    if first:
                        call = tool_call(named.name, text) | {"index": 0}
                    if text or first or out.finished or body.logprobs:
                        chunks.append(one({"tool_calls": [call]} if text or first else {}, logprobs, finish))
                elif parse_calls:  # the reply may be a tool call: its text is read whole when it ends
                    if out.finished:
                        content, calls = parse_tool_calls(choice.text)
                        delta = ({"content": content} if content else {}) | (
                            {"tool_calls": [c | {"index": k} for k, c in enumerate(calls)]} if calls else {})
                        chunks.append(one(delta, logprobs, "tool_calls" if calls and finish == "stop" else finish))
                    elif body.logprobs:
                        chunks.append(one({}, logprobs))
                elif text or out.finished or body.logprobs:
                    chunks.append(one({"content": text} if text else {}, logprobs, finish))
                return chunks
            return stream_events(stream, request, body.n, chunk, include_usage)
        choices = await collect(stream, request, body.n)

        def reply(c: _Choice) -> tuple[dict, str]:
            """(message, finish_reason) of a finished choice, its tool calls read out of the text."""
            if named is not None:
                return {"role": "assistant", "content": None, "tool_calls": [tool_call(named.name, c.text)]}, \
                    c.finish_reason
            content, calls = parse_tool_calls(c.text) if parse_calls else (c.text, [])
            if not calls:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            return ({"role": "assistant", "content": content, "tool_calls": calls},
                    "tool_calls" if c.finish_reason == "stop" else c.finish_reason)
        replies = [reply(c) for c in choices]
        return base | {
            "object": "chat.completion",
            "choices": [{"index": c.index, "message": message,
                         "logprobs": chat_logprobs(c.token_ids, c.logprobs, c.tops) if body.logprobs else None,
                         "finish_reason": finish} for c, (message, finish) in zip(choices, replies)],
            "usage": usage_of(choices, body.n)}

    return app


class _Failed(Exception):
    """An output with finish_reason "error": the engine failed that request (message: why)."""
