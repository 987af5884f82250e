"""Serving a tensor-parallel model: rank 0 answers HTTP, every rank steps the same schedule.

Under torchrun (`torchrun --nproc-per-node N -m tritonq.serve MODEL`; across machines add --nnodes and a shared
--rdzv-endpoint) each rank loads its shard with tritonq.load. Rank 0 serves, its engine wrapped in
`LeaderEngine`: the calls that change the schedule (add_request, add_checked, add_score, abort, step, score)
run on rank 0 and are forwarded, in order, to the other ranks, which replay them in `follow`. Adds and aborts travel with the next
step or score: one broadcast_object_list per step, over a gloo group of its own (`control_group`: host
memory, and an idle follower waits in a CPU socket read rather than a GPU collective). The same calls in the
same order on engines built alike give the same schedule on every rank, so the model's collectives line up;
sampled tokens are rank 0's (ModelRunner.sample broadcasts them). An add that rank 0 refuses raises there
and is never forwarded. A rank whose step raises out of the engine (a device error) ends its process;
torchrun then stops the others.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# How long a follower waits for rank 0's next call: a server may idle for days between requests (gloo's
# default of 30 minutes would end it). A dead rank 0 ends its process, and torchrun the rest.
IDLE_TIMEOUT = timedelta(days=365)


def control_group():
    """The gloo group the engine calls travel over; every rank creates it, after tritonq.load."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class LeaderEngine:
    """Rank 0's engine for the server: forwards the schedule-changing calls to the other ranks (see the module
    docstring); every other attribute is the engine's own."""

    def __init__(self, engine, group):
        self._engine, self._group = engine, group
        self._pending: list[tuple] = []  # successful adds / aborts not yet forwarded

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:  # the engine's own attributes stay the engine's
            setattr(self._engine, name, value)

    def add_request(self, prompt_ids: list[int], config, **options) -> int:
        request_id = self._engine.add_request(prompt_ids, config, **options)  # raises before anything changed
        self._pending.append(("add_request", (list(prompt_ids), config), options, request_id))
        return request_id

    def add_checked(self, checked, **options) -> int:
        request_id = self._engine.add_checked(checked, **options)  # validated on rank 0: the same on every rank
        self._pending.append(("add_checked", (checked,), options, request_id))
        return request_id

    def add_score(self, prompt_ids: list[int], top_logprobs: int = 0) -> int:
        request_id = self._engine.add_score(prompt_ids, top_logprobs)  # raises before anything changed
        self._pending.append(("add_score", (list(prompt_ids), top_logprobs), {}, request_id))
        return request_id

    def abort(self, request_id: int) -> None:
        self._engine.abort(request_id)
        self._pending.append(("abort", (request_id,), {}, None))

    def step(self):
        self._send(("step", (), {}, None))
        return self._engine.step()

    def score(self, prompts: list[list[int]], on_done=None, top_logprobs: int = 0):
        self._send(("score", (prompts,), {"top_logprobs": top_logprobs}, None))
        return self._engine.score(prompts, on_done=on_done, top_logprobs=top_logprobs)

    def close(self) -> None:
        """Release the followers (they return from `follow`); call once the engine thread has stopped."""
        self._send(None)

    def _send(self, call: tuple | None) -> None:
        calls, self._pending = self._pending + [call], []
        dist.broadcast_object_list([calls], src=0, group=self._group)


def follow(engine, group) -> None:
    """(ranks > 0) Replay rank 0's engine calls (over `control_group`) until it closes; returns then."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        for call in box[0]:
            if call is None:
                return
            name, args, kwargs, leader_id = call
            result = getattr(engine, name)(*args, **kwargs)
            if name in ("add_request", "add_checked", "add_score") and result != leader_id:
                raise RuntimeError(f"rank {dist.get_rank()} numbered a request {result} where rank 0 numbered it "
                                   f"{leader_id}: the ranks' engines diverged; restart the server")
