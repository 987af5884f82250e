"""The recurrent-state cache of hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers beside attention).

A linear-attention layer keeps, per sequence, a state of fixed size instead of per-token KV: its conv window and
its delta-rule state (tritonq.models.common.StateLayout). The pool (`allocate_states`) holds num_slots of them
per layer beside the paged KV cache, plus one scratch slot that the padding rows of a static decode step name:
the state update then has fixed shapes and indices, and a captured CUDA graph replays it on any batch.

Lifecycle, the same host bookkeeping as KV blocks (`StateSlots`, no torch): a sequence gets a slot on admission
(the scheduler admits no one while none is free), gives it back when it finishes or is preempted. A sequence
whose step computes from position 0 starts from zero: the runner zeroes its slot first (`RecurrentState.zero`),
so a reused slot never shows its previous owner's state. Preemption recomputes: the slot goes with the blocks
and the sequence, resumed, prefills again from position 0 into a zeroed slot. Prefix caching is off for hybrid
models (the engine says so once): a cached block holds its tokens' KV but not the state after them.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def is_hybrid(model) -> bool:
    """Whether the model keeps recurrent state (a `state_layout`) besides its paged KV cache."""
    return getattr(model, "state_layout", None) is not None


def allocate_states(model, num_slots: int):
    """The zeroed state pool of num_slots sequences + the scratch slot (index num_slots); None for models without
    recurrent state."""
    if not is_hybrid(model):
        return None
    return model.state_layout.allocate(num_slots + 1, model.dtype, model.device)


def state_pool_bytes(model, num_slots: int) -> int:
    """What allocate_states(model, num_slots) takes (0 without recurrent state): the KV sizing pays it first."""
    return (num_slots + 1) * model.state_layout.bytes_per_slot(model.dtype) if is_hybrid(model) else 0


class StateSlots:
    """Which pool slots are free; sequences carry theirs in `state_slot` (None: none)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}; expected at least one recurrent-state slot.")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, seq) -> None:
        """Give seq a free slot (the caller checked num_free)."""
        if seq.state_slot is not None:
            raise RuntimeError(f"{seq} already holds recurrent-state slot {seq.state_slot}.")
        if not self._free:
            raise RuntimeError(f"no free recurrent-state slot for {seq}: all {self.num_slots} are held.")
        seq.state_slot = self._free.pop()

    def free(self, seq) -> None:
        """Take seq's slot back (a no-op when it holds none)."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
