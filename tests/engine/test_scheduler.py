"""Scheduler with fake sampled tokens and a simulated paged KV cache (no model, no torch).

`Simulator` plays the model. Like real KV, the fake "KV" of position p depends on the whole prefix:
it is a rolling hash of the KV at p - 1 (read back from the pages) and token p. Each scheduled
sequence writes its new positions into the slots its block table gives, reads its whole context
back, and samples a token from the last value read. So a wrong block table, an overwritten shared
block or a bad prefix hit (right tokens after a different prefix included) changes the sampled
tokens, and `reference_tokens` (a plain loop over the prompt, no cache) says what every request
must produce whatever the schedule.
"""
import random

import pytest

from tritonq.engine.block_manager import BlockManager
from tritonq.engine.scheduler import ScheduledStep, Scheduler, StepKind
from tritonq.engine.sequence import Sequence, SequenceStatus, check_fits

BS = 16


def fake_kv(prev_kv: int, token: int) -> int:
    """The "KV" of a position from the KV before it (0 at position 0) and its token."""
    return (prev_kv * 1_000_003 + token + 1) % 2_147_483_647


def fake_next_token(last_kv: int) -> int:
    return last_kv % 50


def reference_tokens(prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens, kv = [], 0
    for token in prompt:
        tokens.append(token)
        kv = fake_kv(kv, token)
    for _ in range(max_new_tokens):
        tokens.append(fake_next_token(kv))
        kv = fake_kv(kv, tokens[-1])
    return tokens


class Simulator:
    """A fake model over a fake paged cache: slot -> the fake KV written there."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        bm = scheduler.block_manager
        self.pages: list[int | None] = [None] * (bm.num_blocks * bm.block_size)
        self.steps: list[tuple[bool, list[int], list[int]]] = []   # (is_prefill, seq ids, counts)

    def slot(self, seq: Sequence, position: int) -> int:
        bs = self.scheduler.block_manager.block_size
        return seq.block_table[position // bs] * bs + position % bs

    def run_step(self, step: ScheduledStep) -> list[int | None]:
        sched, bm = self.scheduler, self.scheduler.block_manager
        assert 0 < len(step.seqs) <= sched.max_num_seqs
        assert len(set(s.seq_id for s in step.seqs)) == len(step.seqs)
        assert step.num_batched_tokens <= sched.max_num_batched_tokens
        self.steps.append((step.is_prefill, [s.seq_id for s in step.seqs], list(step.num_new_tokens)))
        sampled = []
        for seq, n in zip(step.seqs, step.num_new_tokens):
            start = seq.num_computed_tokens
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert start + n <= seq.num_tokens <= len(seq.block_table) * bm.block_size
            if not step.is_prefill:
                assert n == 1 and start == seq.num_tokens - 1
            kv = self.pages[self.slot(seq, start - 1)] if start else 0
            assert kv is not None, "the cached prefix was never written"
            for p in range(start, start + n):
                block = bm.blocks[seq.block_table[p // bm.block_size]]
                assert block.ref_count == 1 and block.hash is None, "writing into a shared/registered block"
                kv = fake_kv(kv, seq.token_ids[p])
                self.pages[self.slot(seq, p)] = kv
            expected = 0      # attention reads every cached position: all must hold this prefix's KV
            for p in range(start + n):
                expected = fake_kv(expected, seq.token_ids[p])
                assert self.pages[self.slot(seq, p)] == expected, f"position {p} of {seq} holds other KV"
            sampled.append(fake_next_token(kv) if start + n == seq.num_tokens else None)
        return sampled

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            step = self.scheduler.schedule()
            if step is None:
                return
            self.scheduler.postprocess(step, self.run_step(step))
        raise AssertionError("did not finish")


def make(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, **bm_kwargs):
    return Scheduler(BlockManager(num_blocks, BS, **bm_kwargs), max_num_seqs, max_num_batched_tokens)


def assert_all_blocks_free(bm: BlockManager):
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert all(bm.blocks[i].hash == h for h, i in bm.hash_to_block.items())


def test_the_fit_rule_names_the_numbers_and_add_asserts_it():
    """check_fits (run once, by Engine.check_request) refuses a request that can never fit; the scheduler, given
    only checked requests, asserts it."""
    with pytest.raises(ValueError, match=r"sequence 0 has 50 tokens \+ max_new_tokens=15 = 65 tokens, which need 5 KV "
                                         r"blocks of 16, but the cache has 4 \(64 tokens\)"):
        check_fits("sequence 0", 50, 15, num_blocks=4, block_size=BS)
    sched = make(num_blocks=4)
    with pytest.raises(AssertionError):
        sched.add(Sequence(0, [1] * 50, max_new_tokens=15))
    assert not sched.has_unfinished()
    sched.add(Sequence(1, [1] * 50, max_new_tokens=14))           # exactly 64 tokens fits


def test_add_refuses_duplicate_ids_and_bad_limits():
    sched = make()
    sched.add(Sequence(3, [1, 2], 4))
    with pytest.raises(ValueError, match="sequence id 3 is already queued"):
        sched.add(Sequence(3, [5], 4))
    with pytest.raises(AssertionError):  # EngineConfig refuses it first (tests/test_bad_input.py)
        make(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        Sequence(0, [1], 0)
    with pytest.raises(ValueError, match="prompt is empty"):
        Sequence(0, [], 3)


def test_admission_stops_at_max_num_seqs():
    sched = make(max_num_seqs=3, max_num_batched_tokens=1000)
    for i in range(5):
        sched.add(Sequence(i, [i] * 10, max_new_tokens=2))
    step = sched.schedule()
    assert step.is_prefill and [s.seq_id for s in step.seqs] == [0, 1, 2] and step.num_new_tokens == [10] * 3
    assert (sched.num_running, sched.num_waiting) == (3, 2)
    sim = Simulator(sched)
    sched.postprocess(step, sim.run_step(step))
    step = sched.schedule()                                     # full: decode, nobody admitted
    assert not step.is_prefill and [s.seq_id for s in step.seqs] == [0, 1, 2] and step.num_new_tokens == [1] * 3
    sched.postprocess(step, sim.run_step(step))                 # max_new_tokens reached: all three finish
    assert sched.num_running == 0
    step = sched.schedule()
    assert step.is_prefill and [s.seq_id for s in step.seqs] == [3, 4]


def test_admission_under_token_budget_chunks_the_last_prompt():
    sched = make(max_num_batched_tokens=64)
    seqs = [Sequence(i, list(range(i, i + 30)), max_new_tokens=3) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    sim = Simulator(sched)
    step = sched.schedule()
    assert [s.seq_id for s in step.seqs] == [0, 1, 2] and step.num_new_tokens == [30, 30, 4]
    sampled = sim.run_step(step)
    assert sampled[2] is None and None not in sampled[:2]
    sched.postprocess(step, sampled)
    assert [s.num_computed_tokens for s in seqs] == [30, 30, 4, 0]
    assert [s.num_tokens for s in seqs] == [31, 31, 30, 30]
    step = sched.schedule()               # 0 and 1 decode, the chunk continues, then seq 3 within the 64
    assert step.is_prefill and [s.seq_id for s in step.seqs] == [0, 1, 2, 3]
    assert step.num_new_tokens == [1, 1, 26, 30]
    sched.postprocess(step, sim.run_step(step))
    step = sched.schedule()
    assert not step.is_prefill and [s.seq_id for s in step.seqs] == [0, 1, 2, 3]
    sched.postprocess(step, sim.run_step(step))
    sim.run()
    assert [s.token_ids for s in seqs] == [reference_tokens(s.token_ids[:30], 3) for s in seqs]
    assert_all_blocks_free(sched.block_manager)


def test_step_kind_says_what_the_step_holds():
    """StepKind: prefill alone, decode alone (the one-query path: one logits row each), decode + prefill
    (mixed), decodes with lookahead slots (verify) and scoring sequences (score), each flag from what is in
    the step, independent of which optional fields happen to be set."""
    sched = make(max_num_batched_tokens=64)
    sim = Simulator(sched)
    sched.add(Sequence(0, list(range(20)), max_new_tokens=8))
    step = sched.schedule()
    assert step.kind == StepKind.PREFILL and step.is_prefill and step.logits_for() == [1]
    sched.postprocess(step, sim.run_step(step))
    step = sched.schedule()
    assert step.kind == StepKind.DECODE and not step.is_prefill and step.logits_for() == [1]
    sched.postprocess(step, sim.run_step(step))
    sched.add(Sequence(1, list(range(5, 45)), max_new_tokens=2))
    step = sched.schedule()
    assert step.kind == StepKind.MIXED == StepKind.DECODE | StepKind.PREFILL and step.is_prefill
    assert [s.seq_id for s in step.seqs] == [0, 1] and step.logits_for() == [1, 1]
    sched.postprocess(step, sim.run_step(step))
    speculating = Sequence(2, list(range(3, 13)), max_new_tokens=6)
    speculating.num_speculative_tokens = 3
    sched.add(speculating)
    sched.add(Sequence(3, list(range(9)), 0, scoring=True))
    step = sched.schedule()  # 0 and 1 decode; 2 and the scoring 3 are admitted
    assert step.kind == StepKind.MIXED | StepKind.SCORE and step.start == [s.next_position for s in step.seqs]
    assert step.logits_for() == [1, 1, 1, 9]  # a scoring sequence: every position it computes
    sched.postprocess(step, sim.run_step(step)[:3] + [None])  # scored, not sampled
    for seq in list(sched.running):
        if seq.seq_id != 2:
            sched.finish(seq)
    step = sched.schedule()  # 2 alone decodes, with 3 lookahead slots for proposals
    assert step.kind == StepKind.DECODE | StepKind.VERIFY and step.lookahead == [3] and not step.is_prefill
    proposed = step.with_proposals([[7, 8]])
    assert proposed.kind == step.kind and proposed.is_prefill and proposed.logits_for() == [3]


def test_long_prompt_is_prefilled_in_chunks_then_decoded():
    sched = make(max_num_seqs=4, max_num_batched_tokens=64)
    prompt = [(7 * i) % 31 for i in range(150)]
    seq = Sequence(0, prompt, max_new_tokens=4)
    sched.add(seq)
    sim = Simulator(sched)
    sim.run()
    assert sim.steps == [(True, [0], [64]), (True, [0], [64]), (True, [0], [22])] + [(False, [0], [1])] * 3
    assert seq.token_ids == reference_tokens(prompt, 4) and seq.is_finished
    assert_all_blocks_free(sched.block_manager)


def test_preempted_sequence_resumes_with_the_same_tokens():
    # 4 blocks of 16: two 31-token prompts take 2 blocks each; the second decode step needs a
    # fifth block, so the newest sequence (1) is preempted, then recomputes after 0 finishes.
    # Sequence 0 needs only 3 blocks, so with prefix caching 1's first block survives it.
    for caching in (True, False):
        sched = make(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=caching)
        a = Sequence(0, [(3 * i) % 17 for i in range(31)], max_new_tokens=12)
        b = Sequence(1, [(5 * i) % 19 for i in range(31)], max_new_tokens=20)
        sched.add(a)
        sched.add(b)
        sim = Simulator(sched)
        for _ in range(2):
            step = sched.schedule()
            sched.postprocess(step, sim.run_step(step))
        assert sched.num_preemptions == 0 and b.num_tokens == 33
        step = sched.schedule()
        assert not step.is_prefill and step.seqs == [a]
        assert sched.num_preemptions == 1 and list(sched.waiting) == [b]
        assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
        sched.postprocess(step, sim.run_step(step))
        sim.run()
        assert a.token_ids == reference_tokens(a.token_ids[:31], 12)
        assert b.token_ids == reference_tokens(b.token_ids[:31], 20)
        resumed = next(counts for prefill, ids, counts in sim.steps[3:] if prefill and ids == [1])
        # resume recomputes what was lost; with caching, b's first block survived in the free list
        assert resumed == ([33 - 16] if caching else [33])
        assert_all_blocks_free(sched.block_manager)


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = make(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=False)
    seqs = [Sequence(i, [i] * 31, max_new_tokens=10) for i in range(4)]   # 2 blocks each: 3 fit
    for seq in seqs:
        sched.add(seq)
    sim = Simulator(sched)
    step = sched.schedule()
    assert [s.seq_id for s in step.seqs] == [0, 1, 2]
    sched.postprocess(step, sim.run_step(step))
    step = sched.schedule()                       # 32 tokens each: the 32nd still fits
    sched.postprocess(step, sim.run_step(step))
    step = sched.schedule()                       # each needs a third block, none free: 2 goes
    assert [s.seq_id for s in step.seqs] == [0, 1] and sched.num_preemptions == 1
    assert [s.seq_id for s in sched.waiting] == [2, 3] and [s.seq_id for s in sched.running] == [0, 1]
    assert seqs[2].block_table == [] and seqs[2].num_computed_tokens == 0
    sched.postprocess(step, sim.run_step(step))
    sim.run()
    assert all(s.token_ids == reference_tokens([s.seq_id] * 31, 10) for s in seqs)
    assert_all_blocks_free(sched.block_manager)


def test_abort_frees_blocks_wherever_the_sequence_is():
    sched = make(num_blocks=8, max_num_seqs=2)
    seqs = [Sequence(i, [i] * 20, max_new_tokens=5) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sim = Simulator(sched)
    step = sched.schedule()
    sched.postprocess(step, sim.run_step(step))
    assert sched.abort(2) is seqs[2] and seqs[2].is_finished      # waiting
    assert sched.abort(0) is seqs[0] and seqs[0].block_table == []  # running
    assert sched.abort(0) is None and sched.abort(99) is None
    step = sched.schedule()
    assert step.seqs == [seqs[1]]
    sampled = sim.run_step(step)
    sched.abort(1)                                                   # between schedule and postprocess
    assert sched.postprocess(step, sampled) == []
    assert not sched.has_unfinished() and sched.schedule() is None
    assert_all_blocks_free(sched.block_manager)


def test_finish_frees_and_is_idempotent():
    sched = make()
    seq = Sequence(0, [1, 2, 3], max_new_tokens=50)
    sched.add(seq)
    step = sched.schedule()
    sched.postprocess(step, Simulator(sched).run_step(step))
    sched.finish(seq)                      # e.g. EOS
    sched.finish(seq)
    assert seq.is_finished and not sched.has_unfinished()
    assert_all_blocks_free(sched.block_manager)


def test_postprocess_checks_sampled_tokens_match_the_step():
    sched = make(max_num_batched_tokens=16)
    seq = Sequence(0, list(range(20)), max_new_tokens=3)
    sched.add(seq)
    step = sched.schedule()
    assert step.num_new_tokens == [16]
    with pytest.raises(ValueError, match="1 sampled tokens for 2 sequences|2 sampled tokens for 1"):
        sched.postprocess(step, [None, None])
    with pytest.raises(ValueError, match="must not get a sampled token"):
        sched.postprocess(step, [5])
    assert seq.num_computed_tokens == 0 and seq.num_tokens == 20      # refused before any change
    sched.postprocess(step, [None])
    step = sched.schedule()
    assert step.num_new_tokens == [4]
    with pytest.raises(ValueError, match="needs a sampled token"):
        sched.postprocess(step, [None])


def test_prefix_hits_share_blocks_between_running_sequences():
    sched = make(num_blocks=32, max_num_batched_tokens=256)
    system = [(11 * i) % 23 for i in range(50)]                      # 3 full blocks + 2
    first = Sequence(0, system + [1, 2], max_new_tokens=3)
    sched.add(first)
    sim = Simulator(sched)
    step = sched.schedule()
    sched.postprocess(step, sim.run_step(step))
    later = [Sequence(i, system + [i] * i, max_new_tokens=3) for i in range(1, 4)]
    for seq in later:
        sched.add(seq)
    step = sched.schedule()
    assert step.is_prefill and step.seqs == [first] + later                # first decodes beside them
    assert [s.num_cached_tokens for s in later] == [48, 48, 48]
    assert step.num_new_tokens == [1] + [s.num_tokens - 48 for s in later]
    shared = first.block_table[:3]
    assert all(s.block_table[:3] == shared for s in later)
    assert [sched.block_manager.blocks[b].ref_count for b in shared] == [4, 4, 4]
    sched.postprocess(step, sim.run_step(step))
    sim.run()
    for seq in [first] + later:
        assert seq.token_ids == reference_tokens(seq.token_ids[:seq.num_prompt_tokens], 3)
    assert sched.block_manager.prefix_hits == 3 * 48
    assert_all_blocks_free(sched.block_manager)


PREFIX_CACHING = {   # name: (random seed, BlockManager options)
    "default_hash": (1, {}),
    "colliding_hash": (2, {"hash_fn": lambda prev_hash, tokens: sum(tokens) % 5}),  # ignores the chain too
    "off": (3, {"enable_prefix_caching": False}),
}


@pytest.mark.parametrize("caching", list(PREFIX_CACHING))
def test_random_requests_with_aborts_and_preemption_finish_without_leaks(caching):
    seed, options = PREFIX_CACHING[caching]
    rng = random.Random(seed)
    sched = make(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=48, **options)
    sim = Simulator(sched)
    # Prompts are a few 16-token pieces in random order plus a random tail: equal blocks follow
    # both equal prefixes (prefix hits) and different ones (must not hit, whatever the hash).
    pieces = [[rng.randrange(4) for _ in range(BS)] for _ in range(3)]
    requests = []
    for i in range(500):
        prefix = [t for _ in range(rng.randrange(5)) for t in rng.choice(pieces)]
        prompt = prefix + [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        requests.append(Sequence(i, prompt, max_new_tokens=rng.randrange(1, 40)))
    aborted = set()
    pending = list(requests)
    for _ in range(200_000):
        for _ in range(rng.randrange(3) if pending else 0):   # requests keep arriving
            sched.add(pending.pop(0))
        if sched.seqs and rng.random() < 0.02:
            victim = rng.choice(sorted(sched.seqs))
            sched.abort(victim)
            aborted.add(victim)
        step = sched.schedule()
        if step is None:
            if not pending:
                break
            continue
        sampled = sim.run_step(step)
        if rng.random() < 0.01:                               # abort while the step "runs"
            victim = rng.choice(step.seqs).seq_id
            sched.abort(victim)
            aborted.add(victim)
        sched.postprocess(step, sampled)
    assert not pending and not sched.has_unfinished() and sched.seqs == {}
    assert_all_blocks_free(sched.block_manager)
    assert sched.num_preemptions > 20 and 20 < len(aborted) < 100
    if caching != "off":
        assert sched.block_manager.prefix_hits > 1000
    for seq in requests:
        assert seq.is_finished
        if seq.seq_id not in aborted:
            assert seq.num_generated == seq.max_new_tokens
            assert seq.token_ids == reference_tokens(seq.token_ids[:seq.num_prompt_tokens], seq.max_new_tokens)


def test_decode_is_not_starved_by_a_new_request_before_every_step():
    """With a new prompt arriving before each of 100 steps, the first request still decodes in every
    step after its prefill (prefill-first scheduling gave it 1 token), and its tokens stay right."""
    sched = make(num_blocks=1024, max_num_seqs=256, max_num_batched_tokens=256)
    sim = Simulator(sched)
    first = Sequence(0, [1, 2, 3], max_new_tokens=1000)
    sched.add(first)
    steps = 100
    for i in range(1, steps + 1):
        sched.add(Sequence(i, [i % 50] * 5, max_new_tokens=1000))
        step = sched.schedule()
        sched.postprocess(step, sim.run_step(step))
    assert first.num_generated == steps
    # each step decodes every sequence already running and prefills the new arrival beside them
    assert sim.steps[0] == (True, [0, 1], [3, 5])
    for k, step in enumerate(sim.steps[1:], start=1):
        assert step == (True, list(range(k + 2)), [1] * (k + 1) + [5])
    assert first.token_ids == reference_tokens([1, 2, 3], first.num_generated)


def test_a_step_decodes_running_sequences_while_it_prefills_a_new_prompt_chunk():
    """Mixed steps: a running decode advances in the same step as a chunk of a new prompt, decodes
    first; the chunk gets what is left of the budget and continues next step beside the decode."""
    sched = make(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
    sim = Simulator(sched)
    old = Sequence(0, [4, 5, 6], max_new_tokens=10)
    sched.add(old)
    step = sched.schedule()
    sched.postprocess(step, sim.run_step(step))                        # old prefilled: its first token
    new = Sequence(1, [(3 * i) % 29 for i in range(50)], max_new_tokens=4)
    sched.add(new)
    step = sched.schedule()
    assert step.is_prefill and step.seqs == [old, new] and step.num_new_tokens == [1, 31]
    sched.postprocess(step, sim.run_step(step))
    assert old.num_generated == 2 and new.num_computed_tokens == 31 and new.num_generated == 0
    step = sched.schedule()
    assert step.is_prefill and step.seqs == [old, new] and step.num_new_tokens == [1, 19]
    sched.postprocess(step, sim.run_step(step))
    assert old.num_generated == 3 and new.num_generated == 1
    step = sched.schedule()                                             # both decode: a decode step
    assert not step.is_prefill and step.seqs == [old, new] and step.num_new_tokens == [1, 1]
    sched.postprocess(step, sim.run_step(step))
    sim.run()
    assert old.token_ids == reference_tokens([4, 5, 6], 10)
    assert new.token_ids == reference_tokens(new.token_ids[:50], 4)
    assert_all_blocks_free(sched.block_manager)


def test_no_admission_in_a_step_that_preempted():
    """Blocks freed by a preemption go to the decodes that needed them, not to a new prompt in the same step."""
    sched = make(num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b = Sequence(0, [1] * 31, max_new_tokens=8), Sequence(1, [2] * 31, max_new_tokens=8)
    sched.add(a)
    sched.add(b)
    sim = Simulator(sched)
    for _ in range(2):  # prefill, then the 32nd token each: 4 of 5 blocks held
        step = sched.schedule()
        sched.postprocess(step, sim.run_step(step))
    sched.add(Sequence(2, [3] * 5, max_new_tokens=2))             # would fit in a block b frees
    step = sched.schedule()                                      # a takes the free block, b needs one: b goes
    assert step.seqs == [a] and sched.num_preemptions == 1 and [s.seq_id for s in sched.waiting] == [1, 2]
    sched.postprocess(step, sim.run_step(step))
    sim.run()
    assert b.token_ids == reference_tokens([2] * 31, 8) and a.token_ids == reference_tokens([1] * 31, 8)
    assert_all_blocks_free(sched.block_manager)
