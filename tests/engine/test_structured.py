"""Structured outputs (tritonq.engine.structured): every output of a constrained request parses and validates.

The references are independent of our code: `json.loads` + `jsonschema.validate` for JSON schemas,
`re.fullmatch` for regexes, membership for choices, xgrammar's own `apply_token_bitmask_inplace` for
our bitmask op and xgrammar's matcher fed the tokenizer's own encoding for the tokenizer mapping.
Models: a random tiny Llama (byte tokenizer, write_tiny_llama) and the shipped default model (byte-level
BPE, 2048 tokens), both sampled at temperature 1 so the grammar, not the model, keeps the output valid.
"""
import json
import re
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import tritonq  # noqa: E402
from tritonq.demo import DEFAULT_MODEL, write_tiny_llama  # noqa: E402
from tritonq.engine.sampler import Sampler, SamplingParams  # noqa: E402
from tritonq.api.model import GenerationConfig  # noqa: E402
from tritonq.engine.structured import Grammars, apply_token_bitmask, constraint_of, token_bitmask  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Bounded schemas (string patterns, array sizes, number ranges): every sampled output can end within
# MAX_NEW_TOKENS, so each one must finish on EOS with a complete, valid document. (Strings bounded by
# minLength / maxLength have their own test: xgrammar admits overlong UTF-8 there, see below.)
SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z ,.!?']{0,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "ok": {"type": "boolean"}},
        "required": ["name", "age", "kind", "score", "ok"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
              "minItems": 1, "maxItems": 6},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "tags": {"type": "array", "maxItems": 3,
                                                           "items": {"enum": ["a", "b", "c"]}}},
                 "required": ["id", "tags"]},
        "active": {"type": "boolean"}},
        "required": ["user", "active"]},
}
GENERATIONS = 50
MAX_NEW_TOKENS = 160


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


@pytest.fixture(scope="module", params=["random", "shipped"])
def model(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        if request.param == "random":
            folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=1)
        else:
            folder = DEFAULT_MODEL
        yield tritonq.load(folder, max_num_seqs=GENERATIONS, max_seq_len=256)


def _generate(model, stream: bool, **options) -> list[str]:
    prompts = [f"{i}: " for i in range(GENERATIONS)]
    if not stream:
        out = model.generate(prompts, return_dict=True, progress=False, **options)
        assert out.finish_reasons == ["eos"] * GENERATIONS, out.text  # every output complete
        return out.text
    texts = [""] * GENERATIONS
    for i, piece in model.stream(prompts, **options):
        texts[i] += piece
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_json_schema_output_parses_and_validates(model, name, stream):
    schema = SCHEMAS[name]
    texts = _generate(model, stream, json_schema=schema, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 5  # sampled: the outputs differ (the grammar did not force one)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_regex_output_matches(model, stream):
    pattern = r"[A-Z][a-z]{1,6}-\d{2,4}( \((yes|no)\))?"
    for text in _generate(model, stream, regex=pattern, temperature=1.0, max_new_tokens=40):
        assert re.fullmatch(pattern, text), text


def test_every_choice_output_is_one_of_the_choices(model):
    choices = ["yes", "no", 'a "quoted" one', "two\nlines", "é"]
    texts = _generate(model, False, choice=choices, temperature=1.0, max_new_tokens=20)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_length_bounded_string_outputs_parse(model):
    """minLength / maxLength strings (rewritten as a pattern, tritonq.engine.structured) never hold a raw control
    character, which json.loads refuses (xgrammar's own lowering admits them, mlc-ai/xgrammar#800). Their
    length is checked where the text is valid UTF-8: xgrammar 0.2 admits overlong UTF-8 byte sequences,
    which a random byte-level model writes and which decode to several U+FFFD."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 8}},
              "required": ["s"]}
    texts = _generate(model, False, json_schema=schema, temperature=1.0, max_new_tokens=64)
    for text in texts:
        value = json.loads(text)  # strict: control characters refused
        if "\ufffd" not in text:
            jsonschema.validate(value, schema)


def test_special_tokens_never_allowed_inside_the_output(model):
    """xgrammar reads <s> as the text '<s>'; the engine masks special tokens (EOS aside) for every grammar."""
    out = model.generate([f"{i}" for i in range(GENERATIONS)], regex="[<>s/a-z]{1,20}", temperature=1.0,
                         max_new_tokens=30, return_dict=True, progress=False)
    special = set(model.tokenizer.all_special_ids) - model.eos_token_ids
    assert special and not any(set(ids) & special for ids in out.token_ids)


def test_tokenizer_encoding_of_valid_json_is_accepted_token_by_token(model):
    """xgrammar's view of the vocabulary (TokenizerInfo) agrees with the tokenizer: the tokenizer's own
    encoding of a valid document walks the grammar to its end, where EOS terminates it."""
    document = '{"name": "Hamlet, lord", "age": 30, "kind": "cat", "score": -0.25, "ok": true}'
    state = model.engine.grammars.matcher(constraint_of(GenerationConfig(json_schema=SCHEMAS["object"])))
    for token in model.tokenizer(document, add_special_tokens=False).input_ids:
        assert state.accept(token), model.tokenizer.decode([token])
    assert not state.terminated
    assert state.accept(next(iter(model.eos_token_ids))) and state.terminated


def test_bitmask_op_matches_xgrammar_apply_inplace():
    torch.manual_seed(0)
    for V in (31, 258, 2048, 2053):
        logits = torch.randn(5, V)
        bitmask = torch.randint(-2 ** 31, 2 ** 31, (5, -(-V // 32)), dtype=torch.int64).to(torch.int32)
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(apply_token_bitmask(logits, bitmask), expected)


def test_sampler_draws_only_allowed_tokens():
    """Sampler.sample with a bitmask: greedy rows take the argmax over the allowed tokens, sampled rows
    never leave them, unconstrained (all-ones) rows are untouched; logprobs come from the raw logits."""
    V, allowed = 300, [3, 77, 256, 299]
    bitmask = token_bitmask(4, V)
    bitmask[:2] = 0
    for t in allowed:
        bitmask[:2, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -2 ** 31
    sampler = Sampler()
    greedy, sampled = GenerationConfig(), GenerationConfig(temperature=1.0)
    for trial in range(20):
        logits = torch.randn(4, V)
        params = [SamplingParams(greedy), SamplingParams(sampled, seed=trial),
                  SamplingParams(greedy), SamplingParams(sampled, seed=trial)]
        tokens, logprobs, _ = sampler.sample(logits, params, [[1]] * 4, token_bitmask=bitmask)
        assert tokens[0] == allowed[int(logits[0, allowed].argmax())]
        assert tokens[1] in allowed
        assert tokens[2] == int(logits[2].argmax())
        assert logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[tokens[0]]), abs=1e-5)


def test_grammar_compiled_once_per_schema_lru(tmp_path):
    from tritonq.demo import byte_tokenizer
    grammars = Grammars(byte_tokenizer(), 258, [257], cache_size=2)
    a, b, c = ({"type": "integer"}, {"type": "boolean"}, {"type": "null"})
    key = {n: constraint_of(GenerationConfig(json_schema=s)) for n, s in zip("abc", (a, b, c))}
    grammars.compile(key["a"])
    grammars.compile(key["a"])
    assert grammars.compiles == 1
    grammars.compile(key["b"])
    grammars.compile(key["a"])  # a is now the most recent: c evicts b
    grammars.compile(key["c"])
    grammars.compile(key["a"])
    assert grammars.compiles == 3
    grammars.compile(key["b"])
    assert grammars.compiles == 4


def test_every_grammar_output_is_in_its_language(model):
    """An EBNF grammar (xgrammar's, vLLM's guided_grammar); reference: the same language as a regex."""
    grammar = 'root ::= ("to be" | "not to be") ", " word\nword ::= [a-z] [a-z]? [a-z]?'
    texts = _generate(model, False, grammar=grammar, temperature=1.0, max_new_tokens=30)
    assert all(re.fullmatch(r"(to be|not to be), [a-z]{1,3}", text) for text in texts), texts


def test_bad_constraints_are_refused_before_any_work(model):
    with pytest.raises(ValueError, match="json_schema .* cannot be compiled into a grammar: Unsupported type"):
        model.generate("x", json_schema={"type": "wibble"})
    with pytest.raises(ValueError, match="regex .* cannot be compiled"):
        model.generate("x", regex="(ab")
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        model.generate("x", json_schema="{nope")
    with pytest.raises(TypeError, match="expected a JSON schema"):
        model.generate("x", json_schema=[1])
    with pytest.raises(ValueError, match="json_schema and regex are both set"):
        model.generate("x", json_schema={"type": "integer"}, regex="a")
    with pytest.raises(ValueError, match="min_tokens cannot be combined with choice"):
        model.generate("x", choice=["a"], min_tokens=1)
    with pytest.raises(ValueError, match="each a non-empty str"):
        model.generate("x", choice=["a", ""])
    with pytest.raises(ValueError, match="grammar .* cannot be compiled"):
        model.generate("x", grammar="root ::= undefined_rule")
    with pytest.raises(TypeError, match="grammar=''"):
        model.generate("x", grammar="")
    with pytest.raises(ValueError, match="regex and grammar are both set"):
        model.generate("x", regex="a", grammar='root ::= "a"')
    assert not model.engine.has_unfinished()


@pytest.mark.parametrize("options, part", [
    ({"regex": "a^b"}, "'^' should be at the start of the regex"),
    ({"regex": "ab$c"}, "'$' should be at the end of the regex"),
    ({"regex": r"\Aab"}, r"Escape sequence '\A' is not recognized"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "but got https://example.com/s.json"),
    ({"json_schema": {"type": "string", "pattern": "(?!a)[a-z]"}}, "Lookahead assertion is not supported"),
])
def test_a_constraint_xgrammar_would_loosen_is_refused(model, options, part):
    """xgrammar compiles these with only a warning, dropping the part: a ValueError naming it, before any work."""
    with pytest.raises(ValueError, match="cannot be compiled exactly") as info:
        model.generate("x", max_new_tokens=4, **options)
    assert part in str(info.value)
    assert not model.engine.has_unfinished()


def test_grammar_time_and_size_budgets_and_cached_refusals():
    """A schema whose automaton explodes is refused past the budget (its compiler process killed), and at once
    when sent again (the refusal is cached); the next constraint gets a fresh compiler process. A constraint
    longer than MAX_CONSTRAINT_CHARS is refused before any compile."""
    from tritonq.demo import byte_tokenizer
    from tritonq.engine.structured import MAX_CONSTRAINT_CHARS, GrammarError
    tokenizer = byte_tokenizer()
    grammars = Grammars(tokenizer, 258, [257], compile_timeout_s=1.0)
    slow = ("json_schema", json.dumps({"type": "string", "pattern": "(x{0,128}y{0,128}){0,128}" * 2}))
    for _ in range(2):
        with pytest.raises(GrammarError, match="took longer than 1 s to compile"):
            grammars.compile(slow)
    assert grammars.compiles == 1
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    ab = constraint_of(GenerationConfig(regex="ab"))
    assert not grammars.matcher(ab).accept(b) and grammars.matcher(ab).accept(a) and grammars.compiles == 2
    with pytest.raises(GrammarError, match=f"more than the {MAX_CONSTRAINT_CHARS} a constraint may have"):
        grammars.compile(("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)))


def test_missing_xgrammar_names_the_extra(monkeypatch, tiny_llama_model):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    monkeypatch.setattr(tiny_llama_model.engine, "_grammars", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'tritonq[structured]'")):
        tiny_llama_model.generate("x", regex="a+", max_new_tokens=4)


def test_structured_requests_are_not_speculated_and_still_validate(tmp_path):
    """With n-gram speculation on, a constrained request decodes one verified token per step (its grammar
    state advances per token; unverified proposals would corrupt it) and its output still parses; an
    unconstrained request in the same batch is speculated."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        model = tritonq.load(DEFAULT_MODEL, max_num_seqs=4, max_seq_len=256, dtype=torch.float32,
                             speculative={"method": "ngram", "num_tokens": 3})
    engine = model.engine
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    constrained = engine.add_request(model.tokenizer("To be, or not to be").input_ids,
                                     GenerationConfig(max_new_tokens=64, json_schema=schema))
    free = engine.add_request(model.tokenizer("To be, or not to be, to be, or not to be").input_ids * 3,
                              GenerationConfig(max_new_tokens=40, ignore_eos=True))
    requests = {rid: engine.requests[rid] for rid in (constrained, free)}
    while engine.has_unfinished():
        engine.step()
    assert requests[constrained].speculation.proposed == 0
    assert requests[free].speculation.proposed > 0
    assert requests[constrained].finish_reason == "eos"
    text = model.tokenizer.decode(requests[constrained].token_ids, skip_special_tokens=True)
    assert isinstance(json.loads(text)["a"], bool)
