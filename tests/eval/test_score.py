"""Model.score and Model.perplexity against transformers on the same tiny Llama, and their refusals.

References are computed independently: transformers' own forward + log_softmax for per-token
log-probabilities, and the loop of the transformers perplexity guide (model(input_ids, labels=...).loss
over sliding windows) for perplexity. Both sides run float32 with the same weights; logprobs agree
to float32 rounding accumulated over two layers and a log_softmax over 258 logits: atol 1e-4.
"""
import math

import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.eval.__main__ import main
from tritonq.quantize.writer import write_quantized

from models.test_llama import dequantized_transformers_model
from tolerances import BATCH_ATOL  # batch vs single in float32: see there

ATOL = 1e-4
POSITIONS = 64  # the checkpoint's max_position_embeddings; tests load with max_seq_len = POSITIONS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def write_checkpoint(folder, seed=0) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64, GQA, untied) whose byte tokenizer prepends BOS <s> to every text, so
    add_special_tokens matters. Weights are scaled up from the default init so log-probabilities spread
    (a near-uniform model would let a wrong position or target pass)."""
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                         tie_word_embeddings=False, initializer_range=0.15, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ids = AutoTokenizer.from_pretrained(folder)("ab").input_ids
    assert len(ids) == 3 and ids[0] == 256  # BOS survives the reload
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("score") / "dense"
    return folder, write_checkpoint(folder)


def load(folder, **options) -> tritonq.Model:
    return tritonq.load(folder, max_seq_len=POSITIONS, **{"max_num_seqs": 8, "max_num_batched_tokens": 16, **options})


def reference_logprobs(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers: log p(token t | tokens < t) for t >= 1, and whether token t is the argmax there."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(ids[1:])
    return logprobs.gather(1, targets[:, None])[:, 0], logprobs.argmax(-1) == targets


def reference_perplexity(hf, texts: list[list[int]], context: int, stride: int) -> tuple[float, int]:
    """The transformers perplexity guide's loop per text (labels -100 outside the new tokens, the loss
    times the number of tokens it averages over), pooled over texts: (perplexity, tokens scored)."""
    nll_sum, n_tokens = 0.0, 0
    for ids in texts:
        ids = torch.tensor([ids])
        seq_len, prev_end = ids.shape[1], 0
        for begin in range(0, seq_len, stride):
            end = min(begin + context, seq_len)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            target_ids = input_ids.clone()
            target_ids[:, :-trg_len] = -100
            with torch.no_grad():
                loss = hf(input_ids, labels=target_ids).loss
            # the tokens the loss averages: labels past the window's first (the model shifts them by one). The
            # guide writes (labels != -100).sum() - 1, one too few for windows after the first (their first
            # label is already -100), which weighs those windows wrongly; exp(mean NLL) needs the true count.
            n = int((target_ids[:, 1:] != -100).sum())
            nll_sum += float(loss) * n
            n_tokens += n
            prev_end = end
            if end == seq_len:
                break
    return math.exp(nll_sum / n_tokens), n_tokens


def count_steps(model: tritonq.Model) -> list[int]:
    """Wrap the runner so each model step appends its number of rows to the returned list."""
    rows, run = [], model.engine.runner.run

    def counted(ctx):
        rows.append(int(ctx.input_ids.shape[0]))
        return run(ctx)
    model.engine.runner.run = counted
    return rows


TEXTS = ["", "a", "To be, or not to be: that is the question.", "x" * 3 + "Whether 'tis nobler in the mind to suffer"]


def test_score_matches_transformers(checkpoint):
    """Texts of 1..44 tokens (BOS included), several of them split over steps of 16 rows, in input order."""
    folder, hf = checkpoint
    model = load(folder)
    out = model.score(TEXTS, return_dict=True)
    ids_out = model.score([[5, 200, 17], [9]], return_dict=True)
    assert out.token_ids[0] == [256] and len(out.token_ids[1]) == 2 and ids_out.token_ids == [[5, 200, 17], [9]]
    for ids, logprobs, greedy in zip(out.token_ids + ids_out.token_ids, out.logprobs + ids_out.logprobs,
                                     out.greedy + ids_out.greedy):
        assert len(logprobs) == len(ids) == len(greedy) and logprobs[0] is None and greedy[0] is None
        if len(ids) > 1:
            expected, expected_greedy = reference_logprobs(hf, ids)
            torch.testing.assert_close(torch.tensor(logprobs[1:]), expected, atol=ATOL, rtol=0)
            assert greedy[1:] == expected_greedy.tolist()
    alone = model.score(TEXTS[2])  # a single prompt: one list; alone, its GEMMs run on fewer rows
    assert alone[0] is None and len(alone) == len(out.logprobs[2])
    torch.testing.assert_close(torch.tensor(alone[1:]), torch.tensor(out.logprobs[2][1:]), atol=BATCH_ATOL, rtol=0)
    plain = model.score(TEXTS[2], add_special_tokens=False, return_dict=True)
    assert plain.token_ids[0] == out.token_ids[2][1:]
    torch.testing.assert_close(torch.tensor(plain.logprobs[0][1:]),
                               reference_logprobs(hf, plain.token_ids[0])[0], atol=ATOL, rtol=0)


def test_score_packs_prompts_into_few_steps_and_chunks_long_ones(checkpoint):
    folder, hf = checkpoint
    model = load(folder, max_num_batched_tokens=32)
    rows = count_steps(model)
    prompts = [[(7 * i + j) % 256 for j in range(5)] for i in range(6)]  # 4 input rows each: 24 rows
    model.score(prompts)
    assert rows == [24]
    rows.clear()
    long = [(11 * j) % 256 for j in range(POSITIONS + 1)]  # the most a prompt may have: 64 input rows
    logprobs = model.score(long)
    assert rows == [32, 32]
    torch.testing.assert_close(torch.tensor(logprobs[1:]), reference_logprobs(hf, long)[0], atol=ATOL, rtol=0)
    bm = model.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block given back


def test_score_reads_prefix_cached_blocks(checkpoint):
    """A prompt whose leading blocks an earlier one cached: rows recomputed from the cache still match."""
    folder, hf = checkpoint
    model = load(folder, max_num_batched_tokens=64)
    first = [(13 * j + 1) % 256 for j in range(40)]
    second = first[:32] + [3, 1, 4, 1, 5]
    model.score(first)
    hits = model.engine.block_manager.prefix_hits
    got = model.score(second)
    assert model.engine.block_manager.prefix_hits - hits == 32  # two blocks of 16 came from the cache
    torch.testing.assert_close(torch.tensor(got[1:]), reference_logprobs(hf, second)[0], atol=ATOL, rtol=0)


def test_score_waits_for_blocks_a_stream_holds(checkpoint):
    """A stream holds every KV block (8 blocks: 2 sequences of 64): score waits for them instead of failing,
    stepping the stream meanwhile; its logprobs match transformers and the stream's text its run alone."""
    folder, hf = checkpoint
    model = load(folder, max_num_seqs=2, max_num_batched_tokens=128)  # both prompts prefill in one step
    bm = model.engine.block_manager
    prompts = [[(3 * j + i) % 256 for j in range(48)] for i in range(2)]
    alone = model.generate(prompts, max_new_tokens=16, ignore_eos=True)
    stream = model.stream(prompts, max_new_tokens=16, ignore_eos=True)
    texts = ["", ""]
    i, piece = next(stream)
    texts[i] += piece
    long = [(11 * j) % 256 for j in range(POSITIONS + 1)]
    assert bm.num_free_blocks < bm.blocks_needed(len(long) - 1)  # it cannot start now
    got = model.score(long)
    torch.testing.assert_close(torch.tensor(got[1:]), reference_logprobs(hf, long)[0], atol=ATOL, rtol=0)
    for i, piece in stream:
        texts[i] += piece
    assert texts == alone
    assert bm.num_free_blocks == bm.num_blocks


def test_long_score_runs_in_chunks_between_decode_steps(checkpoint):
    """A 64-token score in steps of 16 tokens: the running request decodes a token in every step while the
    score runs (chunked like a prefill), the score's output comes after several of them; both results match
    their references (transformers; the request alone)."""
    folder, hf = checkpoint
    model = load(folder)
    engine = model.engine
    prompt = [5, 6, 7, 8]
    alone = model.generate([prompt], max_new_tokens=12, ignore_eos=True, return_dict=True).token_ids[0]
    rid = engine.add_request(prompt, tritonq.GenerationConfig(max_new_tokens=12, ignore_eos=True))
    first = engine.step()
    long = [(11 * j) % 256 for j in range(POSITIONS + 1)]
    sid = engine.add_score(long, top_logprobs=2)
    steps = [first]
    while engine.has_unfinished():
        steps.append(engine.step())
    scored_at = next(k for k, outs in enumerate(steps) if any(o.request_id == sid for o in outs))
    assert scored_at >= 4  # 64 rows at most 15 a step beside the decode
    assert all(any(o.request_id == rid for o in outs) for outs in steps[:scored_at + 1])  # a token every step
    assert [o.token_id for outs in steps for o in outs if o.request_id == rid] == alone
    (out,) = [o for o in steps[scored_at] if o.request_id == sid]
    assert out.finish_reason == "scored"
    logprobs, greedy, (top_ids, top_logprobs) = out.scores
    expected, expected_greedy = reference_logprobs(hf, long)
    torch.testing.assert_close(logprobs, expected, atol=ATOL, rtol=0)
    assert greedy.tolist() == expected_greedy.tolist() and top_ids.shape == (POSITIONS, 2)
    torch.testing.assert_close(top_logprobs[:, 0], hf_top(hf, long), atol=ATOL, rtol=0)


def hf_top(hf, ids: list[int]) -> torch.Tensor:
    """transformers: the largest log-probability at each position but the last."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1).max(-1).values


@pytest.mark.parametrize("context, stride", [(16, 8), (16, 16), (13, 5), (POSITIONS, 32)])
def test_perplexity_matches_transformers_guide(checkpoint, context, stride):
    """Overlapping, disjoint and odd windows, a last window shorter than the rest, and (64, 32) where the
    short texts fit one window; pooled over texts."""
    folder, hf = checkpoint
    model = load(folder)
    texts = TEXTS[2:] + ["The rest is silence." * 3]
    out = model.perplexity(texts, context=context, stride=stride, return_dict=True)
    encoded = [hf_ids for hf_ids in (AutoTokenizer.from_pretrained(folder)(t).input_ids for t in texts)]
    expected, n_tokens = reference_perplexity(hf, encoded, context, stride)
    assert out.num_tokens == n_tokens and out.perplexity == pytest.approx(expected, rel=1e-4)
    if stride < context:  # overlapping windows score every token but each text's first
        assert n_tokens == sum(len(ids) - 1 for ids in encoded)
    assert model.perplexity(texts, context=context, stride=stride) == out.perplexity


@pytest.mark.parametrize("fmt, options", [("awq", {"group_size": 32}), ("gptq", {"group_size": 32, "sym": False})])
def test_quantized_score_matches_transformers_on_dequantized_weights(checkpoint, tmp_path, fmt, options):
    folder, _ = checkpoint
    write_quantized(folder, tmp_path / fmt, fmt, **options)
    model = load(tmp_path / fmt)
    hf = dequantized_transformers_model(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                                        tmp_path / fmt)
    out = model.score(TEXTS[2:], return_dict=True)
    for ids, logprobs in zip(out.token_ids, out.logprobs):
        torch.testing.assert_close(torch.tensor(logprobs[1:]), reference_logprobs(hf, ids)[0], atol=ATOL, rtol=0)
    assert model.perplexity(TEXTS[2:], context=16, stride=8) == pytest.approx(
        reference_perplexity(hf, out.token_ids, 16, 8)[0], rel=1e-4)


@pytest.mark.parametrize("call, phrase", [
    (lambda m: m.perplexity(""), "text 0 has 1 token(s); perplexity needs at least 2"),
    (lambda m: m.perplexity(["fine text", "b"], add_special_tokens=False), "text 1 has 1 token(s)"),
    (lambda m: m.perplexity([]), "texts is an empty list"),
    (lambda m: m.perplexity("some text", context=16, stride=17), "stride=17 > context=16"),
    (lambda m: m.perplexity("some text", context=POSITIONS + 1), f"context={POSITIONS + 1} > max_seq_len={POSITIONS}"),
    (lambda m: m.perplexity("some text", context=1), "context=1; expected an int >= 2"),
    (lambda m: m.perplexity("some text", stride=0), "stride=0; expected a positive int"),
    (lambda m: m.score(["ok", ""], add_special_tokens=False), "prompt 1 has no tokens"),
    (lambda m: m.score([[1, 2], [3, 999]]), "prompt 1 has token id 999 outside the vocabulary"),
    (lambda m: m.score(list(range(POSITIONS + 2))), f"max_seq_len={POSITIONS}"),
])
def test_bad_input_is_refused_before_any_step(checkpoint, call, phrase):
    model = load(checkpoint[0])
    rows = count_steps(model)
    with pytest.raises(ValueError) as error:
        call(model)
    assert phrase in str(error.value) and rows == []
    with pytest.raises(TypeError, match="prompts must be"):
        model.score(3.5)


def test_cli_prints_perplexity_and_refuses_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    folder, hf = checkpoint
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent\nMade glorious summer by this sun of York.")
    main(["perplexity", str(folder), str(text), "--context", "16", "--stride", "8", "--max-seq-len", str(POSITIONS),
          "--json", str(tmp_path / "out.json")])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    expected, _ = reference_perplexity(hf, [AutoTokenizer.from_pretrained(folder)(text.read_text()).input_ids], 16, 8)
    assert line.startswith(f"perplexity {expected:.4f} ") and '"num_windows"' in (tmp_path / "out.json").read_text()
    (tmp_path / "empty.txt").write_text("  \n")
    cases = [([str(text), "--context", "16", "--stride", "32"], "stride=32 > context=16"),
             ([str(tmp_path / "missing.txt")], "is not a file"),
             ([str(tmp_path / "empty.txt")], "has no text to score"),
             ([str(text), "--context", "100", "--max-seq-len", str(POSITIONS)], "context=100 > max_seq_len=64")]
    for argv, phrase in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["perplexity", str(folder), *argv])
        err = capsys.readouterr().err  # loading progress bars may come first
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("python -m tritonq.eval perplexity: error: ") and phrase in err, err
