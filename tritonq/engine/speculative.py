"""Speculative decoding: proposers of draft tokens, the acceptance rule and its counters.

Each step, every running sequence ready to decode may get up to k proposed tokens (the scheduler
reserved KV slots for them); the target model scores the last token and the proposals as one query
of length 1 + d after the sequence's cached context (the varlen prefill attention), which gives
1 + d next-token distributions p_0 .. p_d in one step.

Acceptance (`accept`): the target draws its own token t_j from p_j at each position, exactly as a
non-speculative step would (argmax for greedy rows; the Gumbel-max sample with the engine's
counter-based noise of (seed, sequence length) for sampled rows). Proposals are kept while x_j ==
t_j; at the first mismatch t_j is emitted instead, and after d matches t_d is the bonus token. For
a deterministic proposer (both here propose greedily: q_j is one-hot at x_j) this is the rejection
rule of speculative sampling (Leviathan et al. 2023): accept x_j with probability min(1, p_j(x_j) /
q_j(x_j)) = p_j(x_j) = P(t_j == x_j), and on rejection emit a sample of norm(max(0, p_j - q_j)) = p_j
without x_j, which is the law of t_j given t_j != x_j. So the output has the target's distribution,
and as the noise depends only on (seed, length), a seeded request emits the same tokens with and
without speculation (up to floating-point differences between the two kinds of step).

KV of rejected proposals was written at positions past the sequence's num_computed_tokens: the
scheduler gives back the blocks that only they used, and the next step overwrites the rest.

Proposers (`NgramProposer`, `DraftProposer`): propose(seqs, limits) -> one list of at most limits[i]
token ids per sequence (possibly empty). `make_proposer` builds one from a `SpeculativeConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tritonq.config import SpeculativeConfig
from tritonq.engine.block_manager import BlockManager
from tritonq.engine.runner import ModelRunner
from tritonq.engine.sequence import Sequence, SequenceStatus

@dataclass
class SpeculativeStats:
    """Counters since start: proposed / accepted draft tokens and verifications (a sequence's step that
    scored >= 1 proposal). acceptance_rate = accepted / proposed; mean_accepted_length = tokens emitted
    per verification (accepted + the target's own token: 1 .. k + 1)."""
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return (self.accepted + self.verifications) / self.verifications if self.verifications else None


def accept(proposal: list[int], target: list[int]) -> list[int]:
    """The tokens a verification emits: the longest prefix of proposal [d] equal to the target's own tokens
    target [d + 1] (drawn from p_0 .. p_d, see the module docstring), then the target's token after it."""
    m = 0
    while m < len(proposal) and proposal[m] == target[m]:
        m += 1
    return proposal[:m] + [target[m]]


def verify(proposal: list[int], drawn: list[tuple], stats: tuple[SpeculativeStats, ...]) -> list[tuple]:
    """What a sequence emits from a verification step: drawn[j] = (token, logprob, top) sampled at row j (after
    its tokens + proposal[:j]); the accepted proposals, then the target's own token (`accept`), each with its
    row's logprob and top. Counted into every one of stats."""
    emitted = accept(proposal, [t for t, _, _ in drawn])
    for counter in stats:
        counter.add(len(proposal), len(emitted) - 1)
    return [(t, lp, top) for t, (_, lp, top) in zip(emitted, drawn)]  # t: also the drawn token


class Proposer(Protocol):
    """What the engine calls on a proposer (NgramProposer, DraftProposer)."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def release(self, seq_id: int) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n = max_n down to
    min_n, the longest match wins) and propose the tokens that followed it. Plain Python over the id list."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) if k > 0 else [] for seq, k in zip(seqs, limits)]

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def lookup(self, ids: list[int], k: int) -> list[int]:
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = ids[L - n:]
            last = suffix[-1]
            # an earlier occurrence ends at i (i < L - 1): scan candidate ends from the latest backwards
            i = L - 2
            while i >= n - 1:
                if ids[i] == last and ids[i - n + 1:i + 1] == suffix:
                    return ids[i + 1:i + 1 + k]
                i -= 1
        return []


class DraftProposer:
    """A draft model with its own paged cache of num_blocks blocks (no prefix caching) and one draft
    sequence per running target sequence, proposing greedily k tokens ahead.

    Per step: each draft sequence is synced to its target's tokens (its computed prefix is cut back to
    where the two agree: rejected proposals are forgotten), computes the tokens it lacks in one batched
    prefill (chunked to max_num_batched_tokens; its argmax is proposal 1), then runs limit - 1 batched
    decode steps. Draft sequences of
    targets no longer running (finished, aborted, preempted) are freed first, so the draft never holds
    more than the target's running sequences do (+ k tokens each); a sequence the draft cache cannot hold
    is simply not proposed for."""

    def __init__(self, model, num_blocks: int, block_size: int, max_seq_len: int, vocab_size: int,
                 max_num_batched_tokens: int):
        self.vocab_size = vocab_size  # the target's: a draft with padded rows never proposes past it
        self.max_num_batched_tokens = max_num_batched_tokens
        self.runner = ModelRunner(model, num_blocks, block_size, max_seq_len=max_seq_len)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.states: dict[int, tuple] = {}  # target seq_id -> (target Sequence, draft Sequence)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        bm = self.block_manager
        for seq_id, (target, draft) in list(self.states.items()):
            if target.status is not SequenceStatus.RUNNING:
                self._drop(seq_id)
        active: list[tuple[int, Sequence, int]] = []  # (index in seqs, draft, proposals it makes)
        proposals: list[list[int]] = [[] for _ in seqs]
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            if k <= 0:
                continue
            state = self.states.get(seq.seq_id)
            if state is None:
                draft = Sequence(seq.seq_id, seq.token_ids, 1)
                state = self.states[seq.seq_id] = (seq, draft)
            draft = state[1]
            draft.num_computed_tokens = min(_common_prefix(draft.token_ids, seq.token_ids, draft.num_computed_tokens),
                                            seq.num_tokens - 1)
            draft.token_ids = list(seq.token_ids)
            if not bm.can_append(draft, k - 1):
                self._drop(seq.seq_id)
                continue
            bm.append_slot(draft, k - 1)
            active.append((i, draft, k))
        if not active:
            return proposals
        drafts = [d for _, d, _ in active]
        self._catch_up(drafts)  # appends each draft's first proposal
        for step in range(1, max(k for _, _, k in active)):  # one decode step over those still proposing
            live = [j for j, (_, _, k) in enumerate(active) if k > step]
            rows = [drafts[j] for j in live]
            logits = self.runner.run(self.runner.prepare(rows, [1] * len(rows), False))
            assert logits is not None  # no logits_for: every row has logits
            for draft, token in zip(rows, logits[:, :self.vocab_size].argmax(-1).tolist()):
                draft.num_computed_tokens += 1
                draft.token_ids.append(token)
        for i, draft, k in active:
            proposals[i] = draft.token_ids[-k:]
        return proposals

    def _catch_up(self, drafts: list[Sequence]) -> None:
        """Compute every draft's tokens lacking KV, in prefill steps of at most max_num_batched_tokens tokens
        (as the target's scheduler chunks prompts), and append the argmax after each one's last token."""
        pending = list(drafts)  # those still without their first proposal
        while pending:
            seqs, counts, budget = [], [], self.max_num_batched_tokens
            for draft in pending:
                if budget == 0:
                    break
                counts.append(min(draft.num_tokens - draft.num_computed_tokens, budget))
                seqs.append(draft)
                budget -= counts[-1]
            ends: list[bool | int] = [d.num_computed_tokens + n == d.num_tokens for d, n in zip(seqs, counts)]
            logits = self.runner.run(self.runner.prepare(seqs, counts, True, logits_for=ends))
            tokens = iter(() if logits is None else logits[:, :self.vocab_size].argmax(-1).tolist())
            for draft, n, end in zip(seqs, counts, ends):
                draft.num_computed_tokens += n
                if end:
                    draft.token_ids.append(next(tokens))
            done = {id(d) for d, end in zip(seqs, ends) if end}
            pending = [d for d in pending if id(d) not in done]

    def release(self, seq_id: int) -> None:
        """A request ended: free its draft sequence's blocks (a no-op if it has none)."""
        if seq_id in self.states:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        _, draft = self.states.pop(seq_id)
        self.block_manager.free(draft)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most limit (they usually differ only near the end)."""
    n = min(limit, len(a), len(b))
    start = max(0, n - 64)
    if a[:start] != b[:start]:
        start = 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


def make_proposer(config: SpeculativeConfig, draft_model=None, *, num_blocks: int = 0, block_size: int = 16,
                  max_seq_len: int = 0, vocab_size: int = 0, max_num_batched_tokens: int = 2048) -> Proposer:
    """The proposer of a config: NgramProposer, or DraftProposer over draft_model (a loaded model module)
    with a cache of num_blocks blocks of block_size, proposing ids below vocab_size (the target's), its
    prefill steps at most max_num_batched_tokens tokens."""
    if config.method == "ngram":
        return NgramProposer(config.min_n, config.max_n)
    return DraftProposer(draft_model, num_blocks, block_size, max_seq_len, vocab_size, max_num_batched_tokens)
