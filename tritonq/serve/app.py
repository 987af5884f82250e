"""The FastAPI app over a loaded Model: its state, its guard (API key, body size), error bodies and routes.

The routes (tritonq.serve.routes) read everything from `app.state`; errors are the OpenAI body
{"error": {message, type, param, code}} (tritonq.serve.errors). JSON never carries NaN or inf (a -inf
log-probability is written as -9999.0, as vLLM).
"""
from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tritonq.serve.engine_loop import EngineLoop
from tritonq.serve.errors import add_error_handlers
from tritonq.serve.limits import Limits
from tritonq.serve.metrics import ServerMetrics
from tritonq.serve.protocol import APIError, StrictJSONResponse
from tritonq.serve.routes import router

MAX_REQUEST_BYTES = 2 << 20  # default --max-request-bytes: a 128k-token prompt fits, as text or as ids
TOKENIZER_THREADS = 2      # tokenization and chat templating off the event loop (they release the GIL)
GRAMMAR_THREADS = 2        # checks of requests with a schema, whose grammar compiles (engine/structured.py's process)
OPEN_PATHS = ("/health",)  # the only routes that never need the API key


def create_app(model, served_model_name: str, *, api_key: str | None = None, max_waiting: int | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, open_metrics: bool = False, on_dead=None,
               limits: Limits = Limits(), log_interval: float = 5.0) -> FastAPI:
    """The app over a loaded tritonq Model (its engine runs in a background thread while the app lives).

    api_key: required on every route but /health (and /metrics with open_metrics); an empty or whitespace key
    is refused (ValueError), since a bare 'Authorization: Bearer' would match it. max_waiting: the most
    sequences waiting for their first token (429 past it). limits: the fairness caps (tritonq.serve.limits).
    on_dead(reason): called from the engine thread once the engine cannot continue (the command line exits
    non-zero). log_interval: seconds between the throughput log lines while busy (0: none)."""
    check_api_key(api_key, "api_key")
    metrics = ServerMetrics(served_model_name)
    engine_loop = EngineLoop(model.multiplexer, metrics, max_waiting, on_dead=on_dead, log_interval=log_interval)
    metrics.update_engine(model.engine)
    tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tritonq-tokenize")
    grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="tritonq-grammar")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()
        tokenizer_pool.shutdown(wait=False)
        grammar_pool.shutdown(wait=False)

    app = FastAPI(title="tritonq", lifespan=lifespan, default_response_class=StrictJSONResponse)
    app.state.model, app.state.served_model_name = model, served_model_name
    app.state.engine_loop, app.state.metrics, app.state.tokenizer_pool = engine_loop, metrics, tokenizer_pool
    app.state.limits = limits
    app.state.grammar_pool = grammar_pool
    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=max_request_bytes,
                       open_paths=OPEN_PATHS + (("/metrics",) if open_metrics else ()),
                       body_timeout_s=limits.body_timeout_s)
    add_error_handlers(app)
    app.include_router(router)
    return app


def check_api_key(api_key: str | None, source: str) -> None:
    """Refuse a key no client can send or that a bare 'Bearer' would match: empty, whitespace, or with
    whitespace at either end (HTTP strips it from header values); source names where it came from."""
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError(f"{source} is {api_key!r}: an API key must be non-empty and must not start or end with "
                         "whitespace; pass the key itself, or leave the option unset to serve without a key")


class _Guard:
    """ASGI middleware, before routing and body parsing: the API key, then the body size and read time.

    The key is checked first so an unauthenticated caller learns nothing about bodies; the body is
    read here (counting bytes, so a chunked body without Content-Length is bounded too; a body not whole
    within body_timeout_s is answered 408 and its connection closed, so it cannot hold one open) and
    replayed to the app, whose later `receive` calls (disconnect checks) go to the client."""

    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...], max_request_bytes: int,
                 body_timeout_s: float = Limits.body_timeout_s):
        self.app, self.open_paths, self.limit = app, open_paths, max_request_bytes
        self.api_key = None if api_key is None else api_key.encode("utf-8")
        self.body_timeout_s = body_timeout_s

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
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                slow = APIError(408, f"the request body did not arrive whole within {self.body_timeout_s:g} s "
                                     "(--body-timeout); send the whole body without pauses",
                                headers={"Connection": "close"})
                return await slow.response()(scope, receive, send)
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
        """The header's raw bytes (a UTF-8 client's non-ASCII key arrives as its UTF-8 bytes) against the
        key's UTF-8 bytes, in constant time."""
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
