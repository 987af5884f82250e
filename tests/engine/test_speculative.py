"""Speculative decoding (tritonq.engine.speculative) on tiny Llamas through the torch references.

References: greedy runs of the same model without speculation (tokens equal up to a near tie, see
tolerances.assert_greedy_equal), the target's own softmax for the sampled distribution (chi-square),
a brute-force n-gram search written independently of the proposer, and the block manager's accounting
recomputed from the sequences' block tables and token ids after every step."""
import random
import shutil

import pytest
import torch
from engine.test_scheduler import BS, Simulator, assert_all_blocks_free, fake_kv, fake_next_token, reference_tokens
from tolerances import assert_greedy_equal, first_near_tie

import tritonq
from tritonq.demo import DEFAULT_MODEL, HELDOUT_TEXT
from tritonq.engine.block_manager import BlockManager, chained_hash
from tritonq.engine.scheduler import Scheduler
from tritonq.engine.sequence import Sequence, SequenceStatus
from tritonq.config import SpeculativeConfig
from tritonq.engine.speculative import NgramProposer, accept

pytestmark = pytest.mark.usefixtures("one_thread")

# The shipped default model (a trained 1M-parameter Llama: random tiny models repeat one token under greedy
# decoding, which would make output equality trivial) in float32: 4 layers x (k, v) x 2 kv heads x 32 x 4 bytes.
PER_TOKEN = 4 * 2 * 2 * 32 * 4
ENGINE = dict(max_seq_len=256, max_num_seqs=4, max_num_batched_tokens=64, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The target (the default model) and an unrelated random draft with its tokenizer (1 layer, seed 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    draft = tmp_path_factory.mktemp("random_draft")
    config = LlamaConfig.from_pretrained(DEFAULT_MODEL)
    config.num_hidden_layers = 1
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(draft)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEFAULT_MODEL / name, draft / name)
    return DEFAULT_MODEL, draft


# ---- proposer, acceptance rule, config ---------------------------------------------------------------

def brute_force_lookup(ids, k, min_n, max_n):
    """For n from max_n down: every start s < len - n whose n tokens equal the last n; the latest wins."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
        if starts:
            s = max(starts)
            return ids[s + n:s + n + k]
    return []


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    rng = random.Random(0)
    proposer = NgramProposer(min_n=1, max_n=3)
    for _ in range(500):
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 5)
        assert proposer.lookup(ids, k) == brute_force_lookup(ids, k, 1, 3), ids
    assert proposer.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # "2 3" last followed by 7 5
    assert NgramProposer(2, 2).lookup([5, 1, 2, 3], 4) == []  # no earlier "2 3"


def test_accept_keeps_the_matching_prefix_then_the_targets_token():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]   # all accepted + the bonus token
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]         # the first mismatch: the target's token
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accept([], [3]) == [3]


@pytest.mark.parametrize("budget", [7, 4096])
def test_draft_proposals_are_the_draft_models_greedy_continuation(folders, budget):
    """DraftProposer over the default model (trained: its argmax depends on the context, so stale KV shows)
    proposes, for several sequences at once (their catch-up prefill
    chunked to `budget` tokens a step), exactly what the draft model generates greedily on its own; a second
    round re-syncs after the targets grew by an accepted proposal, their own token, and one more token from a
    step that proposed nothing (the draft's KV of its rejected proposals must be recomputed)."""
    from tritonq.engine.sequence import Sequence
    from tritonq.engine.speculative import DraftProposer
    draft_model = tritonq.load(folders[0], **ENGINE)
    proposer = DraftProposer(draft_model.model, 64, 16, 256, draft_model.model.config.vocab_size, budget)
    seqs = [Sequence(i, p, 32) for i, p in enumerate(repetitive_prompts(3, seed=5))]
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    for round_ in range(2):
        limits = [3, 1, 4]
        got = proposer.propose(seqs, limits)
        want = [draft_model.generate(seq.token_ids, max_new_tokens=k, ignore_eos=True, return_dict=True,
                                     progress=False).token_ids[0] for seq, k in zip(seqs, limits)]
        assert got == want, f"round {round_}"
        for seq, p in zip(seqs, got):
            seq.token_ids += p[:1] + [(p[0] + 1) % 2048, (p[0] + 2) % 2048]


@pytest.mark.parametrize("value, message", [

    ({"method": "eagle", "num_tokens": 2}, "method"), ({"method": "ngram"}, "num_tokens"),
    ({"method": "ngram", "num_tokens": 0}, "num_tokens"),
    ({"method": "ngram", "num_tokens": 2, "min_n": 3, "max_n": 2}, "min_n"),
    ({"method": "draft", "num_tokens": 2}, "model"), ({"method": "ngram", "num_tokens": 2, "k": 1}, "unknown"),
    ('{"method": ', "JSON"), (4, "dict")])
def test_bad_speculative_config_is_refused_naming_the_problem(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SpeculativeConfig.parse(value)


def test_load_refuses_a_draft_with_another_vocabulary(folders, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {chr(97 + i): i for i in range(20)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="b")
    LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 eos_token_id=1)).save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        tritonq.load(folders[0], speculative={"method": "draft", "model": str(tmp_path), "num_tokens": 2}, **ENGINE)


# ---- the scheduler's lookahead and rollback, without a model ------------------------------------------

class SpeculativeSimulator(Simulator):
    """test_scheduler's fake model and paged cache, verifying proposals: each proposal is the reference's next
    token or, with probability wrong_rate, another one; the step writes the fake KV of the last token and the
    proposals, reads every cached position back (stale KV of rejected proposals taken as computed fails
    here), and emits `accept(proposals, the fake model's token at each row)`."""

    def __init__(self, scheduler, seed: int, wrong_rate: float):
        super().__init__(scheduler)
        self.rng, self.wrong_rate = random.Random(seed), wrong_rate

    def propose(self, step):
        proposals = []
        for seq, room in zip(step.seqs, step.lookahead or [0] * len(step.seqs)):
            right = reference_tokens(seq.token_ids, room)[seq.num_tokens:]
            proposals.append([t if self.rng.random() > self.wrong_rate else (t + 1) % 50
                              for t in right[:self.rng.randint(0, room)]])
        return step.with_proposals(proposals)

    def run_step(self, step):
        bm = self.scheduler.block_manager
        sampled = []
        for seq, n, p in zip(step.seqs, step.num_new_tokens, step.proposals or [[]] * len(step.seqs)):
            ids, start = seq.token_ids + p, seq.num_computed_tokens
            assert start + n <= len(seq.block_table) * bm.block_size
            kv = self.pages[self.slot(seq, start - 1)] if start else 0
            targets = []
            for pos in range(start, start + n):
                block = bm.blocks[seq.block_table[pos // bm.block_size]]
                assert block.ref_count == 1 and block.hash is None, "writing into a shared/registered block"
                kv = fake_kv(kv, ids[pos])
                self.pages[self.slot(seq, pos)] = kv
                if pos >= seq.num_tokens - 1:
                    targets.append(fake_next_token(kv))
            expected = 0
            for pos in range(start + n):
                expected = fake_kv(expected, ids[pos])
                assert self.pages[self.slot(seq, pos)] == expected, f"position {pos} of {seq} holds other KV"
            sampled.append(accept(p, targets) if p else targets[-1] if targets else None)
        return sampled

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            step = self.scheduler.schedule()
            if step is None:
                return
            step = self.propose(step)
            self.scheduler.postprocess(step, self.run_step(step))
            check_blocks(self.scheduler.block_manager, list(self.scheduler.seqs.values()))
        raise AssertionError("did not finish")


@pytest.mark.parametrize("wrong_rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("num_blocks", [12, 64])
def test_scheduler_lookahead_and_rollback_give_the_reference_tokens(wrong_rate, num_blocks):
    """40 requests sharing prefixes, k = 4: in a 12-block cache sequences are preempted (and the lookahead
    often does not fit), in 64 they are not; every request produces the reference tokens, every block is
    accounted for after every step and free at the end, and blocks fill the prefix cache only with
    accepted tokens (check_blocks recomputes their hashes)."""
    rng = random.Random(num_blocks)
    sched = Scheduler(BlockManager(num_blocks, BS), max_num_seqs=4, max_num_batched_tokens=48)
    prefix = [rng.randrange(50) for _ in range(20)]
    seqs = []
    for i in range(40):
        seq = Sequence(i, prefix[:rng.randint(1, 20)] + [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                       max_new_tokens=rng.randint(1, 40))
        seq.num_speculative_tokens = 4
        sched.add(seq)
        seqs.append(seq)
    sim = SpeculativeSimulator(sched, seed=num_blocks, wrong_rate=wrong_rate)
    sim.run()
    for seq in seqs:
        assert seq.token_ids == reference_tokens(seq.token_ids[:seq.num_prompt_tokens], seq.max_new_tokens), seq
    assert_all_blocks_free(sched.block_manager)
    assert (sched.num_preemptions > 0) == (num_blocks == 12)


def test_lookahead_never_preempts_and_takes_only_blocks_left_over():
    """Two running sequences whose next tokens fit their blocks and one free block: the lookahead of the first
    takes it, the second decodes without (no preemption), and postprocess gives the unused block back."""
    sched = Scheduler(BlockManager(5, BS), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(2):
        seq = Sequence(i, [i + 1] * 30, max_new_tokens=10)
        seq.num_speculative_tokens = 4
        sched.add(seq)
    step = sched.schedule()  # both prompts: 2 blocks each, 1 block free
    sched.postprocess(step, [7, 8])
    step = sched.schedule()
    assert step.lookahead == [4, 0] and sched.num_preemptions == 0
    assert [len(s.block_table) for s in step.seqs] == [3, 2] and sched.block_manager.num_free_blocks == 0
    step = step.with_proposals([[9, 9], []])
    assert step.num_new_tokens == [3, 1] and step.is_prefill
    sched.postprocess(step, [[9, 5], 6])  # the first proposal accepted, the second rejected (5 instead)
    first, second = step.seqs
    assert first.token_ids[-3:] == [7, 9, 5] and first.num_computed_tokens == 32 and len(first.block_table) == 3
    assert second.token_ids[-2:] == [8, 6] and second.num_computed_tokens == 31 and len(second.block_table) == 2
    with pytest.raises(ValueError, match="lookahead"):
        sched.schedule().with_proposals([[1] * 5, []])


# ---- block accounting --------------------------------------------------------------------------------

def check_blocks(bm, seqs) -> None:
    """The block manager's state equals what the sequences' tables and tokens imply: reference counts are
    the number of tables naming a block, the free list holds exactly the unreferenced blocks, a running
    sequence holds slots for its computed tokens and none past its tokens, every registered block of a table is full of
    computed tokens and hashed from that sequence's tokens (the chain recomputed here), and the hash map
    points only at blocks carrying that hash."""
    refs = [0] * bm.num_blocks
    for seq in seqs:
        if seq.status is not SequenceStatus.RUNNING:
            assert not seq.block_table, seq
            continue
        for b in seq.block_table:
            refs[b] += 1
        # its computed tokens have slots; nothing past its tokens is held (lookahead slots were given back)
        held = len(seq.block_table)
        assert bm.blocks_needed(seq.num_computed_tokens) <= held <= bm.blocks_needed(seq.num_tokens), seq
        assert seq.num_computed_tokens < seq.num_tokens, seq
        prev = None
        for i, b in enumerate(seq.block_table):
            block = bm.blocks[b]
            if block.hash is None:
                break
            tokens = tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
            assert (i + 1) * bm.block_size <= seq.num_computed_tokens, f"{seq}: block {i} registered before computed"
            assert block.token_ids == tokens and block.hash == chained_hash(prev, tokens), f"{seq}: block {i}"
            prev = block.hash
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_blocks) == {i for i, r in enumerate(refs) if r == 0}
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())


def run_checked(model, prompts, **options):
    """model.generate with the block accounting checked after every engine step (target and draft caches)."""
    engine = model.engine
    step = engine.step

    def checked_step():
        outs = step()
        check_blocks(engine.block_manager, list(engine.scheduler.seqs.values()))
        states = getattr(engine.proposer, "states", None)
        if states is not None:  # the draft's cache: one reference per table entry, only running targets
            bm = engine.proposer.block_manager
            refs = [0] * bm.num_blocks
            for target, draft in states.values():  # a preempted target's draft is dropped at the next proposal
                assert target.status is not SequenceStatus.FINISHED
                for b in draft.block_table:
                    refs[b] += 1
            assert [b.ref_count for b in bm.blocks] == refs
            assert set(bm.free_blocks) == {i for i, r in enumerate(refs) if r == 0}
        return outs
    engine.step = checked_step
    try:
        return model.generate(prompts, return_dict=True, progress=False, **options)
    finally:
        del engine.step


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Passages of 8..20 tokens of the held-out play, each repeated 2..3 times: the n-gram proposer finds matches."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(HELDOUT_TEXT.read_text()[:4000]).input_ids
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start, length = rng.randrange(len(ids) - 20), rng.randint(8, 20)
        prompts.append(ids[start:start + length] * rng.randint(2, 3))
    return prompts


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_random"])
def test_greedy_outputs_equal_those_without_speculation_under_preemption(folders, method):
    """Eight prompts in a 12-block cache (4 running sequences need more): sequences are preempted and resumed,
    proposals are verified and rolled back, and every greedy output equals the run without speculation.
    A draft that is the target accepts (nearly) everything; an unrelated random draft accepts little."""
    target, random_draft = folders
    spec = {"ngram": {"method": "ngram", "num_tokens": 4, "min_n": 1, "max_n": 3},
            "draft_self": {"method": "draft", "model": str(target), "num_tokens": 3},
            "draft_random": {"method": "draft", "model": str(random_draft), "num_tokens": 3}}[method]
    prompts = repetitive_prompts(8)
    # the draft's cache (as many blocks; the random draft has 1 layer of the target's 4) shares the budget
    caches = {"ngram": 1, "draft_self": 2, "draft_random": 1.25}[method]
    model = tritonq.load(target, speculative=spec, kv_cache_gb=caches * 12 * 16 * PER_TOKEN / 2 ** 30, **ENGINE)
    assert model.engine.block_manager.num_blocks == 12
    got = run_checked(model, prompts, max_new_tokens=24, ignore_eos=True)
    engine = model.engine
    assert engine.scheduler.num_preemptions > 0
    for bm in (engine.block_manager, getattr(engine.proposer, "block_manager", engine.block_manager)):
        assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()
    plain = tritonq.load(target, **ENGINE)
    want = plain.generate(prompts, max_new_tokens=24, ignore_eos=True, return_dict=True, progress=False)
    assert_greedy_equal(plain, prompts, got, want)
    stats = engine.speculation
    assert stats.verifications > 0 and got.acceptance_rate == stats.acceptance_rate
    assert 1 <= got.mean_accepted_length <= spec["num_tokens"] + 1
    if method == "draft_self":
        assert stats.acceptance_rate > 0.95
    if method == "draft_random":
        assert stats.acceptance_rate < 0.3


def test_sampled_next_token_follows_the_target_distribution(folders):
    """2000 seeded requests (temperature 1) generate 3 tokens with a draft (the target itself) proposing 2
    tokens at the second: for each first token a, the second tokens' counts are compared with
    count(a) * p(. | prompt, a) from the target's own logits; chi-square over all (a, b) cells with expected
    count >= 5 (the rest pooled per a), df = cells - groups. The test fails when P(chi2 >= observed) < 1e-3
    (a false alarm once in 1000 runs of a correct sampler; seeds are fixed, so the run is deterministic).
    The run must have accepted and rejected proposals, so both branches of the rule are exercised."""
    target, _ = folders
    temperature, n = 1.0, 2000
    spec = {"method": "draft", "model": str(target), "num_tokens": 2}
    model = tritonq.load(target, speculative=spec, max_seq_len=64, max_num_seqs=64, max_num_batched_tokens=512)
    prompt = repetitive_prompts(1, seed=4)[0]
    out = model.generate([prompt] * n, max_new_tokens=3, temperature=temperature, ignore_eos=True, return_dict=True,
                         progress=False, seed=None)
    stats = model.engine.speculation
    assert stats.verifications >= n and 0.05 < stats.acceptance_rate < 0.95
    pairs = [tuple(ids[:2]) for ids in out.token_ids]
    chi2, df = 0.0, 0
    for a in sorted({p[0] for p in pairs}):
        seconds = [b for x, b in pairs if x == a]
        probs = (model.engine.prompt_logits(prompt + [a])[-1] / temperature).softmax(-1).double()
        observed = torch.bincount(torch.tensor(seconds), minlength=probs.numel()).double()
        expected = probs * len(seconds)
        big = expected >= 5
        if big.sum() == 0:
            continue
        obs = torch.cat([observed[big], observed[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        chi2 += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        df += int(keep.sum()) - 1
    assert df > 10, "too few cells: the test would have no power"
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi2={chi2:.1f} with df={df}: p={p_value:.2e}"


def test_seeded_sampling_is_the_same_with_and_without_speculation(folders):
    """The verification draws each position's token with the counter-based noise of (seed, length), as a
    plain step does: a seeded request emits the same tokens with speculation (and is reproducible)."""
    target, _ = folders
    prompts = repetitive_prompts(3, seed=2)
    options = dict(max_new_tokens=20, temperature=0.8, top_k=20, seed=11, ignore_eos=True, return_dict=True,
                   progress=False)
    spec = tritonq.load(target, speculative={"method": "ngram", "num_tokens": 3}, **ENGINE).generate(prompts, **options)
    plain = tritonq.load(target, **ENGINE).generate(prompts, **options)
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance_rate is not None and plain.acceptance_rate is None


# ---- server: the option and the Prometheus counters ----------------------------------------------------

def test_server_option_is_checked_at_parse_and_metrics_report_the_engines_counters(folders):
    pytest.importorskip("prometheus_client")
    from tritonq.serve.__main__ import parse_args
    from tritonq.serve.metrics import ServerMetrics
    with pytest.raises(SystemExit):
        parse_args(["m", "--speculative-config", '{"method": "ngram"}'])  # no num_tokens
    _, args = parse_args(["m", "--speculative-config", '{"method": "ngram", "num_tokens": 2}'])
    assert args.speculative
    model = tritonq.load(folders[0], speculative={"method": "ngram", "num_tokens": 3}, **ENGINE)
    model.generate(repetitive_prompts(2), max_new_tokens=16, ignore_eos=True)
    metrics = ServerMetrics("m")
    metrics.update_engine(model.engine)
    stats = model.engine.speculation
    text = metrics.render().decode()
    label = '{model_name="m"}'
    assert f"tritonq:spec_decode_num_draft_tokens_total{label} {float(stats.proposed)}" in text
    assert f"tritonq:spec_decode_num_accepted_tokens_total{label} {float(stats.accepted)}" in text
    assert f"tritonq:spec_decode_num_drafts_total{label} {float(stats.verifications)}" in text
    assert f"tritonq:spec_decode_acceptance_rate{label} {stats.accepted / stats.proposed}" in text


def test_eos_and_stop_strings_inside_the_accepted_tokens_end_the_request_as_without_speculation(folders):
    """An EOS id, a stop string or a stop token met among several tokens one verification emits ends the request
    there: the tokens after it are dropped, and tokens, text, finish reason and top logprobs' ids equal the run
    without speculation."""
    target, _ = folders
    prompts = repetitive_prompts(4, seed=3)
    plain = tritonq.load(target, **ENGINE)
    spec = tritonq.load(target, speculative={"method": "draft", "model": str(target), "num_tokens": 4}, **ENGINE)
    free = plain.generate(prompts, max_new_tokens=24, ignore_eos=True, return_dict=True, progress=False)
    eos = free.token_ids[0][9]  # a token the first prompt's greedy run emits mid-way
    stop = plain.tokenizer.decode(free.token_ids[1][12:14])
    for model in (plain, spec):
        model.eos_token_ids = {eos}
    stop_token = free.token_ids[3][6]  # the fourth prompt never meets the EOS id chosen above
    for options in ({}, {"stop": [stop]}, {"stop_token_ids": (stop_token,), "top_logprobs": 2}):
        want = plain.generate(prompts, max_new_tokens=24, return_dict=True, progress=False, **options)
        got = spec.generate(prompts, max_new_tokens=24, return_dict=True, progress=False, **options)
        # exact equality across step shapes (k + 1 verified rows vs one decode row) holds on any BLAS path only
        # where no greedy token won by less than GREEDY_TIE: these prompts have none
        assert all(first_near_tie(plain, p, ids) == len(ids) for p, ids in zip(prompts, want.token_ids))
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reasons == want.finish_reasons
        assert [[list(t) for t in tops] for tops in got.top_logprobs] == \
            [[list(t) for t in tops] for tops in want.top_logprobs]  # one entry per token, the same ids
        assert "eos" in want.finish_reasons and ("stop" in want.finish_reasons or not options)
        assert got.mean_accepted_length > 1.5  # several tokens per verification: EOS / stop met inside them
