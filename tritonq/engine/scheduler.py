"""Which sequences run in the next step: admission, chunked prefill, decode, preemption. No torch.

Each step is either all prefill or all decode, never mixed. Prefill goes first, but never starves
decode: a running sequence ready to decode advances at least once every DECODE_EVERY (4) steps,
whatever arrives. After DECODE_EVERY - 1 prefill steps in a row during which some running sequence
was ready to decode, the next step is a decode step (of every ready sequence).
- prefill: sequences still prefilling (a long prompt split into chunks) continue, oldest first,
  then waiting sequences are admitted in arrival order while `max_num_seqs`, the
  `max_num_batched_tokens` budget and the free blocks allow. A sequence computes
  `token_ids[num_computed_tokens : num_computed_tokens + n]`; n is cut to the budget left, so a
  prompt longer than the budget is prefilled over several steps.
- decode: otherwise every running sequence ready to decode computes its one last token. If one needs a new block
  and none is free, the newest running sequence is preempted: its blocks are freed and it goes
  back to the front of the waiting queue; it later resumes by prefilling everything again
  (its own freed blocks are often still prefix-cached), which yields the same tokens.

A sequence is ready to decode when exactly its last token lacks KV (num_computed == num_tokens - 1);
after a step the token sampled from the logits at its last token is appended.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tritonq.engine.block_manager import BlockManager
from tritonq.engine.sequence import Sequence, SequenceStatus

DECODE_EVERY = 4  # a sequence ready to decode waits at most DECODE_EVERY - 1 prefill steps (see above)


def _ready_to_decode(seq: Sequence) -> bool:
    return seq.num_computed_tokens == seq.num_tokens - 1


@dataclass(frozen=True)
class ScheduledStep:
    """One model step. Sequence i computes token_ids[c : c + num_new_tokens[i]] with c its
    num_computed_tokens (read before `postprocess`); it samples when c + n == num_tokens."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Waiting / running queues over a BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_seqs is {max_num_seqs} and max_num_batched_tokens is "
                             f"{max_num_batched_tokens}; expected 1 <= max_num_seqs <= "
                             "max_num_batched_tokens (a decode step batches one token per sequence).")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []    # admission order: the newest is last
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self.num_preemptions = 0
        self._arrivals = 0
        self._prefills_while_ready = 0  # prefill steps in a row while some running sequence could decode

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; it runs when blocks and the budget allow.

        Raises ValueError, before queueing, if it could never fit: prompt + max_new_tokens needs
        more blocks than the cache has.
        """
        bm = self.block_manager
        total = seq.num_prompt_tokens + seq.max_new_tokens
        if bm.blocks_needed(total) > bm.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id}: {seq.num_prompt_tokens} prompt tokens + {seq.max_new_tokens} "
                f"max_new_tokens = {total} tokens need {bm.blocks_needed(total)} KV blocks of "
                f"{bm.block_size}, but the cache has {bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} "
                "tokens); shorten the request or give the KV cache more memory.")
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already queued or running; ids must be unique.")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_generated:
            raise ValueError(f"add expects a new sequence, got {seq}.")
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when nothing is left to run."""
        while self.has_unfinished():
            ready = any(_ready_to_decode(seq) for seq in self.running)
            if ready and self._prefills_while_ready >= DECODE_EVERY - 1:
                step = self._schedule_decode() or self._schedule_prefill()
            else:
                step = self._schedule_prefill() or self._schedule_decode()
            if step is not None:
                self._prefills_while_ready = self._prefills_while_ready + 1 if step.is_prefill and ready else 0
                return step
            if not self.running and self.waiting and not self._can_admit(self.waiting[0]):
                raise RuntimeError(f"scheduler stalled: nothing running and {self.waiting[0]} cannot be "
                                   f"admitted with {self.block_manager.num_free_blocks} free blocks.")
        return None

    def postprocess(self, step: ScheduledStep, sampled: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance num_computed_tokens, append sampled tokens, register full
        blocks. sampled[i] is the token from sequence i's last new token, None for a chunk that
        stopped short of it. Sequences reaching max_new_tokens are finished (blocks freed) and
        returned; sequences aborted since `schedule` are skipped."""
        if len(sampled) != len(step.seqs):
            raise ValueError(f"postprocess: {len(sampled)} sampled tokens for {len(step.seqs)} sequences.")
        for seq, n, token in zip(step.seqs, step.num_new_tokens, sampled):   # check all, then apply
            reached_end = seq.num_computed_tokens + n == seq.num_tokens
            if not seq.is_finished and reached_end != (token is not None):
                raise ValueError(f"postprocess: {seq} {'needs' if reached_end else 'must not get'} a "
                                 f"sampled token after computing {n} tokens, got {token}.")
        finished = []
        for seq, n, token in zip(step.seqs, step.num_new_tokens, sampled):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += n
            if token is not None:
                seq.append_token(token)
            self.block_manager.mark_computed(seq)
            if seq.num_generated >= seq.max_new_tokens:
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        """Stop a sequence (EOS, stop string, length) and free its blocks; a no-op if already finished."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        del self.seqs[seq.seq_id]

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is (waiting or running) and free its blocks; None if unknown/finished."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq)
        return seq

    def _can_admit(self, seq: Sequence) -> bool:
        return len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(seq)

    def _schedule_prefill(self) -> ScheduledStep | None:
        seqs, counts = [], []
        budget = self.max_num_batched_tokens
        for seq in self.running:     # unfinished chunked prefills first
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and budget > 0:
                seqs.append(seq)
                counts.append(min(remaining, budget))
                budget -= counts[-1]
        while self.waiting and budget > 0 and self._can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(min(seq.num_tokens - seq.num_computed_tokens, budget))
            budget -= counts[-1]
        return ScheduledStep(seqs, counts, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledStep | None:
        bm = self.block_manager
        seqs = []
        for seq in list(self.running):  # victims come from the end: never one already scheduled
            if seq.status is not SequenceStatus.RUNNING or not _ready_to_decode(seq):
                continue  # preempted in this loop, or still prefilling (a decode step forced by DECODE_EVERY)
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.append_slot(seq)
                seqs.append(seq)
        return ScheduledStep(seqs, [1] * len(seqs), is_prefill=False) if seqs else None

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first; it resumes by recomputing its KV."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
