"""Which sequences run in the next step: admission, chunked prefill, decode, preemption. No torch.

One step holds every running sequence's next tokens within one budget of `max_num_batched_tokens`,
as vLLM's scheduler does, so arrivals never stall running requests:
1. decode first: every running sequence ready to decode computes its one last token (they always
   fit: max_num_seqs <= max_num_batched_tokens). If one needs a new block and none is free, the
   newest running sequence is preempted: its blocks are freed and it goes back to the front of the
   waiting queue; it later resumes by prefilling everything again (its own freed blocks are often
   still prefix-cached), which yields the same tokens.
2. then running sequences still prefilling (a long prompt split into chunks) continue, oldest first,
3. then waiting sequences are admitted in arrival order while `max_num_seqs`, the budget left and
   the free blocks allow (none in a step that preempted: the blocks just freed are for decoding).
A sequence computes `token_ids[num_computed_tokens : num_computed_tokens + n]`; n is cut to the
budget left, so a prompt longer than the budget is prefilled over several steps. A step whose
sequences all decode is a decode step (`StepKind.DECODE`: one query each, the static CUDA-graph
path); any other step, mixed ones included, runs the varlen prefill attention, where a decoding
sequence is a query of length 1 after its cached context.

Hybrid models (recurrent state beside the KV cache, tritonq.engine.state_cache): admission also takes a
state slot and waits while none is free; finishing and preemption give it back with the blocks.

A sequence is ready to decode when exactly its last token lacks KV (num_computed == num_tokens - 1);
after a step the token sampled from the logits at its last token is appended.

Scoring (`Engine.add_score`): a scoring sequence (`Sequence(..., scoring=True)`) is queued and admitted like
a prompt, in the same budget as generation, but only ever prefills, with logits at every position it
computes (`ScheduledStep.logits_for`) and no sampled token; it finishes (blocks freed, full blocks
prefix-cached) once every position has its logits. Its prefix-cache hits are recomputed for their logits
but not rewritten (`ScheduledStep.start`). Scoring sequences compute at most `max_num_scored_tokens` tokens
per step (each has a full row of logits), so a long one runs in chunks between other requests' decodes.

Speculative decoding (tritonq.engine.speculative): a decoding sequence with num_speculative_tokens > 0
also gets KV slots (and budget) for `lookahead(seq)` tokens after its last one; the engine then puts
up to that many proposals in the step (`ScheduledStep.with_proposals`), and `postprocess` takes the
tokens the verification emitted: the accepted proposals (whose KV is now valid) and the target's
own next token. Blocks past what the new tokens need are given back (`BlockManager.trim`); blocks
only become prefix-cache entries once full of computed, accepted tokens, so rejected proposals never
reach a hash. A sequence whose lookahead does not fit the free blocks decodes without it (speculation
never preempts).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, replace

from tritonq.engine.block_manager import BlockManager
from tritonq.engine.sequence import Sequence, SequenceStatus
from tritonq.engine.state_cache import StateSlots

class StepKind(enum.Flag):
    """What a step holds; a step may hold several (DECODE | PREFILL is a mixed step). A plain DECODE step (one
    query per sequence) is the static decode path; any other kind runs the varlen prefill attention, except
    a VERIFY step whose proposer proposed nothing."""
    DECODE = enum.auto()   # sequences computing their last token
    PREFILL = enum.auto()  # prompt chunks (new prompts, long prompts split, preempted sequences recomputing)
    VERIFY = enum.auto()   # decoding sequences with lookahead slots for proposals (`with_proposals`) to verify
    SCORE = enum.auto()    # scoring sequences (`start` holds every sequence's first position)
    MIXED = DECODE | PREFILL


@dataclass(frozen=True)
class ScheduledStep:
    """One model step. Sequence i computes token_ids[c : c + num_new_tokens[i]] with c its
    num_computed_tokens (read before `postprocess`); it samples when c + n == num_tokens. Decoding
    sequences come first, then prefill chunks. kind: what it holds (StepKind).
    start (SCORE): each sequence's first position, its `next_position`, which may lie below
    num_computed_tokens (recomputed, not rewritten). lookahead (VERIFY): KV slots reserved past each
    sequence's tokens; proposals: the draft tokens computed after each one's last token."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    kind: StepKind
    lookahead: list[int] | None = None
    proposals: list[list[int]] | None = None
    start: list[int] | None = None

    @property
    def is_prefill(self) -> bool:
        """Whether the step runs the varlen prefill attention: anything but one query per sequence."""
        return bool(self.kind & (StepKind.PREFILL | StepKind.SCORE)) or any(self.proposals or ())

    def logits_for(self) -> list[int]:
        """Rows of logits per sequence, its last ones: a scoring sequence's positions not scored yet, 1 +
        its proposals for a sequence that samples, 0 for a prompt chunk short of its end. Read before
        `postprocess`."""
        if self.kind == StepKind.DECODE:  # one row each
            return [1] * len(self.seqs)
        proposals = self.proposals or [[]] * len(self.seqs)
        start = self.start or [seq.num_computed_tokens for seq in self.seqs]
        return [max(0, c + n - seq.num_scored) if seq.scoring
                else 1 + len(p) if c + n - len(p) == seq.num_tokens else 0
                for seq, c, n, p in zip(self.seqs, start, self.num_new_tokens, proposals)]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def with_proposals(self, proposals: list[list[int]]) -> ScheduledStep:
        """The step with proposals[i] (at most lookahead[i] tokens) computed after sequence i's last token:
        those sequences compute 1 + len(proposals[i]) tokens and get that many logits rows. A step with
        any proposal is a prefill step (varlen attention: a query of 1 + d tokens per sequence)."""
        room = self.lookahead or [0] * len(self.seqs)
        for seq, p, r in zip(self.seqs, proposals, room, strict=True):
            if len(p) > r:
                raise ValueError(f"{seq}: {len(p)} proposals but {r} lookahead slots were reserved.")
        return replace(self, num_new_tokens=[n + len(p) for n, p in zip(self.num_new_tokens, proposals)],
                       proposals=proposals)


class Scheduler:
    """Waiting / running queues over a BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_scored_tokens: int | None = None, state_slots: StateSlots | None = None):
        """state_slots: a hybrid model's recurrent-state slots (None: the model has none)."""
        assert 1 <= max_num_seqs <= max_num_batched_tokens, "EngineConfig's rule (a decode step: a token per sequence)"
        if max_num_scored_tokens is not None and max_num_scored_tokens < 1:
            raise ValueError(f"max_num_scored_tokens is {max_num_scored_tokens}; expected >= 1 (or None: the "
                             "step's token budget).")
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # tokens of scoring sequences per step (each has a full row of logits): within the token budget
        self.max_num_scored_tokens = max_num_scored_tokens or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []    # admission order: the newest is last
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self.num_preemptions = 0
        self._arrivals = 0

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

        The engine validated it (`Engine.check_request`: `check_fits` among its rules), so its fit is an assert.
        """
        assert self.block_manager.blocks_needed(seq.num_prompt_tokens + seq.max_new_tokens) \
            <= self.block_manager.num_blocks, f"{seq} can never fit the cache: Engine.check_request refuses it"
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
            step = self._schedule_step()
            if step is not None:
                return step
            if not self.running and self.waiting and not self._can_admit(self.waiting[0]):
                seq, bm = self.waiting[0], self.block_manager
                raise RuntimeError(f"scheduler stalled: nothing running and {seq} needs "
                                   f"{bm.blocks_needed(seq.num_tokens)} KV blocks; {bm.num_free_blocks} are free "
                                   "while other requests hold the rest. Finish or abort them first.")
        return None

    def postprocess(self, step: ScheduledStep, sampled: list[int | list[int] | None]) -> list[Sequence]:
        """Record a finished step: advance num_computed_tokens, append sampled tokens, register full
        blocks. sampled[i] is the token from sequence i's last new token, None for a chunk that
        stopped short of it; for a sequence with proposals, the list of tokens its verification
        emitted (the accepted proposals, then the target's token: 1 .. d + 1 of them), after which
        its lookahead blocks are trimmed. Sequences reaching max_new_tokens are finished (blocks
        freed) and returned; sequences aborted since `schedule` are skipped."""
        if len(sampled) != len(step.seqs):
            raise ValueError(f"postprocess: {len(sampled)} sampled tokens for {len(step.seqs)} sequences.")
        if step.kind == StepKind.DECODE:
            return self._postprocess_decode(step.seqs, sampled)
        proposals = step.proposals or [[]] * len(step.seqs)
        for seq, n, token, p in zip(step.seqs, step.num_new_tokens, sampled, proposals):  # check all, then apply
            if seq.is_finished:
                continue
            if seq.scoring:
                if token is not None:
                    raise ValueError(f"postprocess: {seq} is scored, not sampled; expected None, got {token}.")
                continue
            reached_end = seq.num_computed_tokens + n - len(p) == seq.num_tokens
            if reached_end != (token is not None):
                raise ValueError(f"postprocess: {seq} {'needs' if reached_end else 'must not get'} a "
                                 f"sampled token after computing {n} tokens, got {token}.")
            accepted_prefix = (isinstance(token, list) and 1 <= len(token) <= len(p) + 1
                               and token[:-1] == p[:len(token) - 1])
            if p and not accepted_prefix:
                raise ValueError(f"postprocess: {seq} verified proposals {p}; expected an accepted prefix of "
                                 f"them plus one token, got {token}.")
            if not p and isinstance(token, list):
                raise ValueError(f"postprocess: {seq} had no proposals in this step; expected one token, got {token}.")
        finished = []
        bm, block_size = self.block_manager, self.block_manager.block_size
        starts = step.start or [seq.num_computed_tokens for seq in step.seqs]
        for seq, c, n, token, p in zip(step.seqs, starts, step.num_new_tokens, sampled, proposals):
            if seq.is_finished:
                continue
            before = seq.num_computed_tokens
            if seq.scoring:  # positions c .. c + n - 1 now have KV and logits
                seq.num_scored = max(seq.num_scored, c + n)
                seq.num_computed_tokens = max(before, c + n)
                if seq.num_computed_tokens // block_size != before // block_size:
                    bm.mark_computed(seq)
                if seq.num_scored == seq.num_tokens:
                    self.finish(seq)
                    finished.append(seq)
                continue
            tokens = token if isinstance(token, list) else [] if token is None else [token]
            n -= len(p) - (len(tokens) - 1 if p else 0)  # KV of rejected proposals is not computed
            seq.num_computed_tokens += n
            seq.token_ids.extend(tokens)
            if len(seq.block_table) > bm.blocks_needed(seq.num_tokens):  # lookahead left unused
                bm.trim(seq)
            if (before + n) // block_size != before // block_size:  # a block became full
                bm.mark_computed(seq)
            if seq.num_generated >= seq.max_new_tokens:
                self.finish(seq)
                finished.append(seq)
        return finished

    def _postprocess_decode(self, seqs: list[Sequence], sampled: list[int | list[int] | None]) -> list[Sequence]:
        """postprocess of a plain decode step (every sequence computed its last token, none has proposals or a
        lookahead): the same checks and updates without the per-sequence branches of mixed steps."""
        for seq, token in zip(seqs, sampled):  # check all, then apply
            if (token is None or isinstance(token, list)) and not seq.is_finished:
                raise ValueError(f"postprocess: {seq} decoded its last token in this step; expected one sampled "
                                 f"token, got {token}.")
        finished = []
        bm, block_size = self.block_manager, self.block_manager.block_size
        for seq, token in zip(seqs, sampled):
            if seq.is_finished:
                continue
            assert isinstance(token, int)  # checked above
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            if seq.num_computed_tokens % block_size == 0:  # a block became full
                bm.mark_computed(seq)
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_new_tokens:
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
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        del self.seqs[seq.seq_id]

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is (waiting or running) and free its blocks; None if unknown/finished."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq)
        return seq

    def _can_admit(self, seq: Sequence) -> bool:
        return (len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(seq)
                and (self.state_slots is None or self.state_slots.num_free > 0))

    def _free(self, seq: Sequence) -> None:
        """Give back what a sequence holds: its blocks and its recurrent-state slot."""
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)

    def _schedule_step(self) -> ScheduledStep | None:
        """Decodes, then prefill chunks, then admissions, in one budget (see the module docstring)."""
        bm, block_size = self.block_manager, self.block_manager.block_size
        seqs: list[Sequence] = []
        chunks: list[Sequence] = []
        lookaheads: list[int] = []
        preempted = False
        for seq in list(self.running):  # victims come from the end: never one already scheduled
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted in this loop
            if seq.scoring or seq.num_computed_tokens != seq.num_tokens - 1:
                chunks.append(seq)  # still prefilling: after every decode
                continue
            if seq.num_tokens > len(seq.block_table) * block_size:  # its last token starts a new block
                while not bm.can_append(seq):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                else:
                    bm.append_slot(seq)
                if seq.status is not SequenceStatus.RUNNING:
                    continue
            seqs.append(seq)
        # lookahead slots only from blocks left once every decode has its own; no pass at all without speculation
        speculating = [i for i, seq in enumerate(seqs) if seq.num_speculative_tokens]
        if speculating:
            lookaheads = [0] * len(seqs)
            for i in speculating:
                seq = seqs[i]
                room = self.lookahead(seq)
                if room and bm.can_append(seq, room):  # speculation never preempts: else decode without
                    bm.append_slot(seq, room)
                    lookaheads[i] = room
        decodes, prefills = bool(seqs), False
        counts = [1] * len(seqs)
        budget = max(0, self.max_num_batched_tokens - len(seqs) - sum(lookaheads))
        scored = self.max_num_scored_tokens  # what is left of it in this step
        for seq in chunks:
            if budget == 0:
                break
            if seq.scoring and scored == 0:
                continue
            seqs.append(seq)
            counts.append(min(seq.num_tokens - seq.next_position, budget, scored if seq.scoring else budget))
            budget -= counts[-1]
            scored -= counts[-1] if seq.scoring else 0
            prefills = prefills or not seq.scoring
        while (not preempted and self.waiting and budget > 0 and not (self.waiting[0].scoring and scored == 0)
               and self._can_admit(self.waiting[0])):
            seq = self.waiting.popleft()
            bm.allocate(seq)
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(min(seq.num_tokens - seq.next_position, budget, scored if seq.scoring else budget))
            budget -= counts[-1]
            scored -= counts[-1] if seq.scoring else 0
            if not seq.scoring:  # a preempted sequence whose blocks were all prefix-cached just decodes
                if counts[-1] == 1 and seq.num_computed_tokens == seq.num_tokens - 1:
                    decodes = True
                else:
                    prefills = True
        if not seqs:
            return None
        kind = StepKind(0)
        if decodes:
            kind |= StepKind.DECODE
        if prefills:
            kind |= StepKind.PREFILL
        lookahead = None
        if any(lookaheads):
            kind |= StepKind.VERIFY
            lookahead = lookaheads + [0] * (len(seqs) - len(lookaheads))
        start = None
        if any(seq.scoring for seq in seqs):
            kind |= StepKind.SCORE
            start = [seq.next_position for seq in seqs]
        return ScheduledStep(seqs, counts, kind, lookahead, start=start)

    def lookahead(self, seq: Sequence) -> int:
        """Proposals a decode step of seq may verify: num_speculative_tokens, fewer near max_new_tokens (the
        step emits up to lookahead + 1 tokens)."""
        return max(0, min(seq.num_speculative_tokens, seq.max_new_tokens - seq.num_generated - 1))

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first; it resumes by recomputing its KV."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
