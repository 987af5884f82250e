"""The engine in one background thread; HTTP handlers talk to it through queues.

The engine is not thread-safe, so only this thread calls it, through the Model's Multiplexer
(tritonq.engine.multiplexer: each request's outputs go to its stream). Handlers (on the asyncio loop)
put commands (add, abort) on a thread-safe queue; the thread drains them between steps, runs
`engine.step()` while anything is unfinished, and hands each request's outputs back to its
asyncio.Queue with `loop.call_soon_threadsafe`. An abort is applied before the next step, so a
disconnected client's blocks are free within one step. Every torch op runs on this thread: `python -m
tritonq.serve` loads the model on a thread that has ended by then (serve/__main__.py says why: OpenMP).

Failures, from the smallest:
- an output with finish_reason "error" (the engine failed that request: a failed step, non-finite
  logits) ends only that request; the handler answers it with an error;
- any other exception out of `engine.step()` fails the streams whose requests were in flight (the
  scheduler's running ones; every live one if it cannot tell), aborts them, and the loop goes on:
  queued requests keep their place and commands sent meanwhile are applied;
- EngineDeadError (the device cannot go on), or the thread itself dying: `dead` says why, every
  pending and queued request gets an error, and `on_dead(reason)` is called so the process can
  exit non-zero and a supervisor restart it.
"""
from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from tritonq.engine.engine import CheckedRequest, EngineDeadError
from tritonq.engine.multiplexer import Multiplexer, Scoring
from tritonq.serve.metrics import ServerMetrics

# Events (one per engine step) a stream may hold unread; past it the client is not reading and the
# request is aborted so its KV blocks are freed. 1024 steps is seconds of tokens: a reading client
# is never near it, and the bytes held stay small (an event is one step's tokens of one request).
STREAM_BUFFER_EVENTS = 1024


class QueueFull(Exception):
    """--max-waiting requests are waiting already (429: retry later)."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take or finish requests: its loop died, the server is stopping, or it did not accept a
    request in time (503)."""


class StepFailed(RuntimeError):
    """The engine failed this request: a failed step, an output with finish_reason "error", or a stream its
    client did not read (500)."""


@dataclass
class Event:
    """What a request's queue receives: outputs of one step, or a terminal error (serve.errors maps its type to
    the HTTP status)."""
    outputs: list = field(default_factory=list)  # RequestOutput of this request's engine ids
    error: Exception | None = None               # the request cannot go on


class Stream:
    """One HTTP request's engine requests (n choices x prompts, or its prompts' scoring) and the queue their
    outputs reach."""

    def __init__(self, prompts: list[list[int]], configs: list[list[CheckedRequest | Scoring]], loop):
        self.prompts, self.configs = prompts, configs
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = loop
        self.request_ids: list[int] = []   # engine ids, prompt-major: prompt p choice c at p * n + c
        self.accepted = loop.create_future()  # set by the engine thread: None, or the exception refusing it
        self.started = time.perf_counter()
        self.unstarted = self.num_requests    # engine requests that have not produced a token yet
        self.done = False
        self.checked = time.monotonic()       # last disconnect check (handlers)

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.configs)


class _Timing:
    __slots__ = ("arrival", "first", "tokens")

    def __init__(self, arrival: float):
        self.arrival, self.first, self.tokens = arrival, None, 0


class EngineLoop:
    """Owns the engine thread. `submit` from the asyncio loop; `stop` from anywhere."""

    def __init__(self, multiplexer: Multiplexer, metrics: ServerMetrics, max_waiting: int | None = None,
                 on_dead=None, log_interval: float = 5.0):
        self.multiplexer, self.metrics, self.max_waiting = multiplexer, metrics, max_waiting
        self.log_interval = log_interval          # seconds between throughput log lines while busy (0: none)
        self.on_dead = on_dead                    # called (engine thread) with the reason once dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}   # engine request id -> its stream (thread-owned)
        self._timing: dict[int, _Timing] = {}
        self._stepped: dict[Stream, list] = {}   # this step's outputs by stream (the multiplexer's sinks)
        self._live: set[Stream] = set()           # streams not yet done (asyncio-owned)
        self._pending = 0                         # engine requests accepted, no token yet (asyncio-owned)
        self._stop = threading.Event()
        self.dead: str | None = None              # why the loop died, once it has
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tritonq-engine", daemon=True)

    @property
    def engine(self):
        return self.multiplexer.engine

    # ---- asyncio side -------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def why_dead(self) -> str | None:
        """Why the engine cannot serve, or None: it died, or its thread is gone."""
        if self.dead is None and self._thread.ident is not None and not self._thread.is_alive() \
                and not self._stop.is_set():
            self.dead = "the engine thread has exited"
        return self.dead

    async def submit(self, prompts: list[list[int]], configs: list[list[CheckedRequest | Scoring]],
                     timeout: float) -> Stream:
        """Queue prompts[p] once per request in configs[p] (Engine.check_request's, or a Scoring); returns when
        the engine accepted them.

        Raises QueueFull when --max-waiting requests are already waiting, EngineUnavailable when the engine
        loop is dead or does not answer within `timeout` seconds, and the engine's own exception when it
        refuses one (add_score's checks: ValueError / TypeError) or adding fails unexpectedly.
        """
        if self.why_dead() is not None:
            raise EngineUnavailable(f"the engine loop has died: {self.dead}")
        stream = Stream(prompts, configs, asyncio.get_running_loop())
        if self.max_waiting is not None and self._pending + stream.num_requests > self.max_waiting:
            raise QueueFull(f"{self._pending} requests are waiting and this one adds {stream.num_requests}; "
                            f"the server queues at most {self.max_waiting} (--max-waiting). Retry later.")
        self._pending += stream.num_requests
        self._live.add(stream)
        self._commands.put(("add", stream))
        try:
            error = await asyncio.wait_for(asyncio.shield(stream.accepted), timeout)
        except asyncio.TimeoutError:
            self.release(stream)  # the add may still be applied: the abort after it undoes it
            raise EngineUnavailable(f"the engine did not accept the request within {timeout:g} s "
                                    "(it is busy or stuck); retry later") from None
        except BaseException:     # the handler was cancelled (client gone)
            self.release(stream)
            raise
        if error is not None:
            self._finish(stream)
            raise error
        return stream

    def mark_started(self, stream: Stream) -> None:
        """A handler saw the first token of one of its engine requests: that one no longer waits."""
        if stream.unstarted > 0:
            stream.unstarted -= 1
            self._pending -= 1

    def release(self, stream: Stream) -> None:
        """The handler is done with a stream (finished, failed or client gone): abort what still runs."""
        if not stream.done:
            self._finish(stream)
            self._commands.put(("abort", stream))

    def _finish(self, stream: Stream) -> None:
        self._pending -= stream.unstarted
        stream.unstarted = 0
        stream.done = True
        self._live.discard(stream)

    def _deliver(self, stream: Stream, event: Event) -> None:
        """(asyncio loop) Put an event on a stream; a stream its client does not read is cut off."""
        if stream.done and event.error is None:
            return
        if event.error is None and stream.queue.qsize() >= STREAM_BUFFER_EVENTS:
            self.release(stream)
            event = Event(error=StepFailed(f"the client did not read its stream: {STREAM_BUFFER_EVENTS} events "
                                           "were unread, so the request was aborted; read the stream as it arrives"))
        stream.queue.put_nowait(event)

    def fail_all(self, message: str) -> None:
        """End every live stream with an error event (shutdown): their handlers send an error chunk."""
        for stream in list(self._live):
            stream.queue.put_nowait(Event(error=EngineUnavailable(message)))

    def _fail_everything(self, message: str) -> None:
        """(asyncio loop, once dead) Answer every request: accepted futures, live streams, queued adds."""
        while True:
            try:
                kind, stream = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                _resolve(stream.accepted, EngineUnavailable(f"the engine loop has died: {message}"))
        for stream in list(self._live):
            _resolve(stream.accepted, EngineUnavailable(f"the engine loop has died: {message}"))
            stream.queue.put_nowait(Event(error=EngineUnavailable(f"the engine loop has died: {message}")))

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=30)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            device = self.engine.runner.device
            if device.type == "cuda":  # the current CUDA device is per thread: this one starts on cuda:0
                torch.cuda.set_device(device)
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                try:
                    command = self._commands.get(block=not busy, timeout=None if not busy else 0)
                    self._apply(command)
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    try:
                        self._step()
                    except EngineDeadError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - one bad step must not end the server
                        traceback.print_exc()
                        self._fail_in_flight(f"{type(exc).__name__}: {exc}")
                self.metrics.update_engine(self.engine)
                self.metrics.log_throughput(time.perf_counter(), self.log_interval)
        except BaseException as exc:  # noqa: BLE001 - report any death to every waiting client
            self.dead = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_everything, self.dead)
            if self.on_dead is not None:
                self.on_dead(self.dead)

    def _apply(self, command) -> None:
        kind, stream = command
        if kind == "add":
            self._add(stream)
        elif kind == "abort":
            for rid in stream.request_ids:
                if self._streams.pop(rid, None) is not None:
                    self._timing.pop(rid, None)
                    try:
                        self.multiplexer.release([rid])
                    except Exception:  # noqa: BLE001 - one request's cleanup must not end the server
                        traceback.print_exc()

    def _add(self, stream: Stream) -> None:
        if stream.done:  # released (timed out, client gone) before the thread got to it
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, EngineUnavailable("withdrawn"))
            return
        try:
            ids = self.multiplexer.add([c for configs in stream.configs for c in configs],
                                       functools.partial(self._collect, stream))
        except Exception as exc:  # noqa: BLE001 - a request the engine cannot add must not end the server
            if not isinstance(exc, (ValueError, TypeError)):  # not a refusal: a bug, logged (answered 500)
                traceback.print_exc()
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, exc)
            return
        stream.request_ids = ids
        for rid, prompt in zip(ids, (p for p, cs in zip(stream.prompts, stream.configs) for _ in cs)):
            self._streams[rid] = stream
            self._timing[rid] = _Timing(stream.started)
            self.metrics.prompt_tokens.inc(len(prompt))
        stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)

    def _fail_in_flight(self, message: str) -> None:
        """An unexpected exception out of a step: fail and abort the streams whose requests were
        running (the step's); the waiting ones stay queued. If the engine cannot say which were
        running, fail every stream: a step that raises again and again must not loop forever."""
        running = {seq.seq_id for seq in getattr(getattr(self.engine, "scheduler", None), "running", ())}
        failed = {s for rid, s in self._streams.items() if rid in running} or set(self._streams.values())
        now = time.perf_counter()
        for stream in failed:
            for rid in stream.request_ids:
                if self._streams.pop(rid, None) is not None:
                    timing = self._timing.pop(rid)
                    self.multiplexer.release([rid])
                    self.metrics.request_finished(timing.arrival, timing.first, timing.tokens, now, "error")
            stream.loop.call_soon_threadsafe(
                self._deliver, stream, Event(error=StepFailed(f"the engine step running this request failed: "
                                                              f"{message}")))

    def _collect(self, stream: Stream, out) -> None:
        """(the multiplexer's sink of a stream's requests) An output of this step, delivered after it."""
        self._stepped.setdefault(stream, []).append(out)

    def _step(self) -> None:
        self._stepped = {}
        self.multiplexer.step()
        now = time.perf_counter()
        by_stream, self._stepped = self._stepped, {}
        for out in (out for outs in by_stream.values() for out in outs):
            timing = self._timing[out.request_id]
            if out.token_id is not None:
                timing.tokens += 1
                self.metrics.generation_tokens.inc()
                if timing.first is None:
                    timing.first = now
                    self.metrics.ttft.observe(now - timing.arrival)
            if out.finished:
                del self._streams[out.request_id], self._timing[out.request_id]
                self.metrics.request_finished(timing.arrival, timing.first, timing.tokens, now,
                                              out.finish_reason)
        for stream, outs in by_stream.items():
            stream.loop.call_soon_threadsafe(self._deliver, stream, Event(outputs=outs))


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
