"""`python -m tritonq.serve MODEL`: an OpenAI-compatible HTTP server on the continuous-batching engine.

    app.py          create_app: the app's state, its guard (API key, body size), error handlers, the router
    routes.py       the routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    protocol.py     pydantic request models and the OpenAI error (APIError)
    responses.py    pydantic response bodies (completions, chat, their chunks, models, errors)
    dispatch.py     a request through the engine loop: submit, read its events into choices, collect
    replies.py      whole response bodies; sse.py: server-sent events and their chunks
    logprobs.py     the logprobs objects; tools.py: tool calls read from replies; errors.py: error bodies
    engine_loop.py  the engine in one background thread; requests stream from it through asyncio queues
    metrics.py      Prometheus gauges, counters and latency histograms
    limits.py       the fairness caps: stop strings, tokens per request, body read time
    ranks.py        tensor parallel: rank 0 serves, the other ranks replay its engine calls
    __main__.py     command line, uvicorn, Ctrl-C / SIGTERM handling

A request never ends the server: bad input is a 4xx naming the culprit, a failed engine step fails
only its requests (500); if the engine cannot continue, /health answers 503 and the process exits
with status 1 for a supervisor to restart it.

Needs the `serve` extra: pip install -e ".[serve]".
"""
__all__ = ["create_app"]


def __getattr__(name: str):
    """create_app is imported on first use: `python -m tritonq.serve --help` runs without the extra installed."""
    if name == "create_app":
        from tritonq.serve.app import create_app
        return create_app
    raise AttributeError(f"module 'tritonq.serve' has no attribute {name!r}")
