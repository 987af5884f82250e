"""Many callers over one engine, each getting exactly its own requests' outputs: Model's generate / stream /
chat (tritonq.api.model) and the server's engine thread (tritonq.serve.engine_loop) share one Multiplexer.

The engine is not thread-safe, so every call that changes it (add, abort, step) is made under `lock`, by one
caller at a time. A caller adds its requests with a sink; whoever steps the engine hands each output to the sink
of its request (a finished request's sink is dropped with it). A caller done with its requests releases them:
they are aborted now when the lock is free, else by the next lock holder, so release never waits (a generator
closed by the garbage collector inside a locked section of its own thread must not wait for the lock).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tritonq.engine.engine import CheckedRequest, Engine, RequestOutput


@dataclass(frozen=True)
class Scoring:
    """A scoring request to add (Engine.add_score: the prompt's logprobs, with the top_logprobs most likely
    tokens at each position); its one output carries `scores`."""
    prompt_ids: list[int]
    top_logprobs: int = 0


class Multiplexer:
    """Routes one engine's outputs to the callers whose requests they are; see the module docstring."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()  # held while the engine is changed: one add, abort, step or score at a time
        self._sinks: dict[int, Callable[[RequestOutput], None]] = {}  # request id -> its caller's sink
        self._to_abort: deque[int] = deque()  # released requests the next lock holder aborts

    def add(self, requests: Iterable[CheckedRequest | Scoring], sink: Callable[[RequestOutput], None], *,
            stream: bool = True) -> list[int]:
        """Queue every request (checked by Engine.check_request, or a Scoring), all or none: if one cannot be
        added the ones before it are aborted and the exception raised. Returns their ids in order; their
        outputs go to sink. stream: as Engine.add_request's."""
        with self.lock:
            self._apply_aborts()
            ids: list[int] = []
            try:
                for request in requests:
                    ids.append(self.engine.add_score(request.prompt_ids, request.top_logprobs)
                               if isinstance(request, Scoring) else self.engine.add_checked(request, stream=stream))
                    self._sinks[ids[-1]] = sink
            except BaseException:
                for rid in ids:
                    self._sinks.pop(rid, None)
                    self.engine.abort(rid)
                raise
        return ids

    def step(self, unless: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Step the engine once and hand each output to its request's sink (an output whose request was released
        or added to the engine directly has none); returns the outputs. unless: checked once the lock is held,
        True skips the step (another caller's step gave this one what it waited for)."""
        with self.lock:
            if unless is not None and unless():
                return []
            self._apply_aborts()
            outputs = self.engine.step()
            sinks = self._sinks
            for out in outputs:
                sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
            return outputs

    def release(self, request_ids: Iterable[int]) -> None:
        """A caller is done with these requests (finished ones are ignored): their outputs are dropped and
        they are aborted, now when the lock is free, else by the next lock holder (never waits)."""
        for rid in request_ids:
            self._sinks.pop(rid, None)
            self._to_abort.append(rid)
        if self.lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self.lock.release()

    @contextmanager
    def exclusive(self) -> Iterator[Engine]:
        """The engine, for a call that steps it itself (Engine.score), with no other caller adding or stepping
        meanwhile; released requests are aborted first. Other callers' outputs of those steps reach them from
        the next step."""
        with self.lock:
            self._apply_aborts()
            yield self.engine

    def _apply_aborts(self) -> None:
        """Abort the released requests; call with the lock held."""
        while self._to_abort:
            self.engine.abort(self._to_abort.popleft())
