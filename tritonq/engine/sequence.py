"""One request as the scheduler sees it: its token ids, how many have KV in the cache, its blocks.

Plain Python, no torch. The engine keeps its own per-request state (sampling, text, timing) in
`extra` (typed by the Sequence's parameter R); the scheduler and block manager never look at it.
"""
from __future__ import annotations

import enum
from typing import Generic, TypeVar

R = TypeVar("R")  # what the engine keeps for a request (Sequence.extra)


class RequestTooLong(ValueError):
    """check_fits' refusal of a request whose prompt + max_new_tokens does not fit (a ValueError: callers that
    need not tell it apart catch that); the server answers it naming max_tokens."""


def check_fits(name: str, num_prompt_tokens: int, max_new_tokens: int, *, num_blocks: int, block_size: int,
               max_seq_len: int | None = None) -> None:
    """The one request-fit rule (`Engine.check_request`, the one validation of a request; `Scheduler.add` asserts it):
    ValueError, naming the numbers, unless the request has a token, and RequestTooLong unless
    num_prompt_tokens + max_new_tokens fits max_seq_len (None: no limit) and a KV cache of num_blocks blocks
    of block_size tokens. name says what is checked ("the prompt", "prompt 3", "sequence 7")."""
    if num_prompt_tokens == 0:
        raise ValueError(f"{name} has no tokens; give at least one token.")
    total = num_prompt_tokens + max_new_tokens
    if max_seq_len is not None and total > max_seq_len:
        raise RequestTooLong(f"{name} has {num_prompt_tokens} tokens + max_new_tokens={max_new_tokens} = "
                             f"{total} > max_seq_len={max_seq_len}; shorten the prompt, lower max_new_tokens "
                             "or load with a larger max_seq_len.")
    needed = -(-total // block_size)
    if needed > num_blocks:
        raise RequestTooLong(f"{name} has {num_prompt_tokens} tokens + max_new_tokens={max_new_tokens} = "
                             f"{total} tokens, which need {needed} KV blocks of {block_size}, "
                             f"but the cache has {num_blocks} ({num_blocks * block_size} tokens); shorten the "
                             "request or give the KV cache more memory (kv_cache_gb / gpu_memory_utilization).")


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # queued, holds no blocks (new, or preempted and waiting to recompute)
    RUNNING = enum.auto()   # holds blocks; being prefilled (possibly in chunks) or decoded
    FINISHED = enum.auto()  # done or aborted; blocks freed


class Sequence(Generic[R]):
    """A prompt plus the tokens generated so far.

    token_ids: prompt + generated ids. The last one's KV is not yet in the cache during decode:
        `num_computed_tokens == num_tokens - 1` means "ready for a decode step".
    num_computed_tokens: tokens whose KV is in the cache (prefix-cache hits included).
    num_cached_tokens: tokens served from the prefix cache at the last admission.
    block_table: KV block ids, block i holds positions [i * block_size, (i + 1) * block_size).
    arrival: admission order, set by `Scheduler.add` (lower = older).
    extra: the engine's state of the request (R: engine.Request or ScoreRequest); the scheduler and the block
        manager never read it, the sampler reads what `sampler.SamplingState` names.
    state_slot: a hybrid model's recurrent-state slot (tritonq.engine.state_cache), held while it runs; None.
    num_speculative_tokens: the most draft tokens a step may verify for it (0: no speculation); the
        scheduler reserves KV slots for them (see tritonq.engine.speculative).
    scoring: a scoring request (`Engine.score`): prefill only, logits at every one of its positions, no
        token sampled (max_new_tokens 0). Positions its admission found prefix-cached are recomputed (their
        logits are needed) but not rewritten; num_scored counts the positions whose logits were computed.
    """

    def __init__(self, seq_id: int, token_ids: list[int], max_new_tokens: int, extra: R | None = None, *,
                 scoring: bool = False):
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id}: the prompt is empty; pass at least one token id.")
        if scoring and max_new_tokens != 0:
            raise ValueError(f"sequence {seq_id}: a scoring sequence generates nothing; max_new_tokens is "
                             f"{max_new_tokens}, expected 0.")
        if max_new_tokens < 1 and not scoring:
            raise ValueError(f"sequence {seq_id}: max_new_tokens is {max_new_tokens}, expected >= 1 "
                             "(a request that generates nothing needs no scheduling).")
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_new_tokens = max_new_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.state_slot: int | None = None
        self.status = SequenceStatus.WAITING
        self.arrival = 0
        self.extra = extra
        self.num_speculative_tokens = 0
        self.scoring = scoring
        self.num_scored = 0

    @property
    def next_position(self) -> int:
        """The first position the next step computes: num_computed_tokens, or for a scoring sequence the
        first position without logits (prefix-cached positions are recomputed for theirs) unless its KV
        is missing further back (its blocks were freed by a preemption)."""
        return min(self.num_scored, self.num_computed_tokens) if self.scoring else self.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
