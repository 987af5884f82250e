"""One HTTP request's way through the engine loop: queued (`submit`), its events read (`next_event`) into its
choices (`Choice.apply`), or run to the end (`collect`); its prompts scored (`score`: echo's logprobs). Engine
refusals and failures propagate as they are raised (serve.errors maps each type to its status).

Choice i of prompt p has index p * n + i, as in vLLM. A request the engine failed (an output with
finish_reason "error") raises StepFailed (500).
"""
from __future__ import annotations

import asyncio
import time

from fastapi import Request

from tritonq.engine.multiplexer import Scoring
from tritonq.serve.engine_loop import EngineLoop, EngineUnavailable, Event, StepFailed, Stream
from tritonq.serve.errors import ClientGone, api_error
from tritonq.serve.protocol import APIError, finite_logprob
from tritonq.serve.responses import Usage

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's -> OpenAI's
DISCONNECT_POLL_S = 0.5    # how often a request checks whether its client left (busy or not)
ACCEPT_TIMEOUT_S = 60.0    # the engine thread takes commands between steps: a minute means it is stuck


class Choice:
    """Accumulated state of one choice (one engine request): its text, tokens and their logprobs."""
    __slots__ = ("index", "prompt_tokens", "text", "tokens", "token_ids", "logprobs", "tops", "finish_reason",
                 "started")

    def __init__(self, index: int, prompt_tokens: int):
        self.index, self.prompt_tokens = index, prompt_tokens
        self.text, self.tokens, self.token_ids, self.logprobs, self.tops = "", 0, [], [], []
        self.finish_reason, self.started = None, False

    def apply(self, out) -> str:
        """Record one RequestOutput; returns its new text. Raises StepFailed if the engine failed the request."""
        self.started = True
        if out.finished and out.finish_reason == "error":
            raise StepFailed(f"generation failed: {out.error or 'the engine failed this request'}")
        if out.token_id is not None:  # None: finished without a new token
            self.tokens += 1
            self.token_ids.append(out.token_id)
            self.logprobs.append(finite_logprob(out.logprob))
            self.tops.append(out.top_logprobs)
        self.text += out.text
        if out.finished:
            self.finish_reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        return out.text


def choices_of(stream: Stream, n: int) -> dict[int, Choice]:
    """The choices of a stream by engine request id."""
    rids = iter(stream.request_ids)
    return {next(rids): Choice(p * n + c, len(prompt)) for p, prompt in enumerate(stream.prompts) for c in range(n)}


def apply_output(engine_loop: EngineLoop, stream: Stream, choice: Choice, out) -> str:
    """choice.apply(out), telling the loop when the choice's first output came (it no longer waits)."""
    if not choice.started:
        engine_loop.mark_started(stream)
    return choice.apply(out)


def usage(choices: list[Choice], n: int) -> Usage:
    """Token counts of a response: each prompt counted once (not once per choice), every generated token."""
    prompt_tokens = sum(c.prompt_tokens for c in choices if c.index % n == 0)
    completion = sum(c.tokens for c in choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


async def submit(engine_loop: EngineLoop, prompts: list[list[int]], configs: list[list], n: int) -> Stream:
    """Queue prompts x n choices (configs[p]: prompt p's n checked requests) on the engine."""
    total = len(prompts) * n
    if engine_loop.max_waiting is not None and total > engine_loop.max_waiting:
        raise APIError(400, f"{len(prompts)} prompts x n={n} = {total} sequences, but this server queues at most "
                            f"{engine_loop.max_waiting} (--max-waiting), so the request can never be accepted; "
                            "send fewer prompts or a smaller n", "n")
    return await engine_loop.submit(prompts, configs, ACCEPT_TIMEOUT_S)


async def next_event(engine_loop: EngineLoop, stream: Stream, request: Request) -> Event | None:
    """The stream's next event, or None once the client has gone. The client is checked every
    DISCONNECT_POLL_S whether events flow or not (a busy request must notice too); a dead engine ends the
    wait with an error event."""
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
                return Event(error=EngineUnavailable(f"the engine loop has died: {engine_loop.dead}"))


async def collect(engine_loop: EngineLoop, stream: Stream, request: Request, n: int) -> list[Choice]:
    """Run a non-streamed request to the end, its choices in index order; aborts it if the client leaves."""
    choices = choices_of(stream, n)
    try:
        while any(c.finish_reason is None for c in choices.values()):
            event = await next_event(engine_loop, stream, request)
            if event is None:
                raise ClientGone("client disconnected")
            if event.error is not None:
                raise event.error
            for out in event.outputs:
                apply_output(engine_loop, stream, choices[out.request_id], out)
    finally:
        engine_loop.release(stream)
    return sorted(choices.values(), key=lambda c: c.index)


async def score(engine_loop: EngineLoop, prompts: list[list[int]], top_logprobs: int, request: Request) -> list[tuple]:
    """Engine.score's result per prompt (the prompt logprobs of echo), as scoring requests queued like
    generation: they wait for KV blocks and run in the steps' budget between other requests' decodes. Refusals
    and failures as `submit` / `collect`; aborted if the client leaves."""
    stream = await submit(engine_loop, prompts, [[Scoring(p, top_logprobs)] for p in prompts], 1)
    scores = {}
    try:
        while len(scores) < len(prompts):
            event = await next_event(engine_loop, stream, request)
            if event is None:
                raise ClientGone("client disconnected")
            if event.error is not None:
                raise api_error(event.error, "scoring the prompt for echo failed: ")
            for out in event.outputs:
                engine_loop.mark_started(stream)
                if out.finish_reason != "scored":
                    raise StepFailed(f"scoring the prompt for echo failed: {out.error}")
                scores[out.request_id] = out.scores
    finally:
        engine_loop.release(stream)
    return [scores[rid] for rid in stream.request_ids]
