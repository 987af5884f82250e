"""vLLM's structured-output extras over HTTP: `structured_outputs` and `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, sent as vLLM users send them (the official openai client's extra_body)
to `python -m tritonq.serve` on the shipped model. Every output is checked by an independent reference:
re.fullmatch for a regex and for a grammar (written again as a regex), membership for choices, json.loads +
jsonschema for schemas. Two constraints in one request, or a malformed one, is a 400 naming the field.
"""
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serve_util import MODEL_NAME, Server  # noqa: E402

from tritonq.demo import DEFAULT_MODEL  # noqa: E402

SPEAKER = {"type": "object", "properties": {"speaker": {"enum": ["ROMEO", "JULIET"]},
                                            "act": {"type": "integer", "minimum": 1, "maximum": 5}},
           "required": ["speaker", "act"]}
REGEX = r"(ROMEO|JULIET): [a-z]{1,8}"
CHOICES = ["Montague", "Capulet", "neither"]
GRAMMAR = 'root ::= ("to be" | "not to be") " " word\nword ::= [a-z] [a-z]?'  # xgrammar EBNF, vLLM's syntax
GRAMMAR_AS_REGEX = r"(to be|not to be) [a-z][a-z]?"


def _valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SPEAKER)
    return True


# (structured_outputs member, guided_* field, value, check of one output)
KINDS = [("json", "guided_json", SPEAKER, _valid_json),
         ("regex", "guided_regex", REGEX, lambda text: re.fullmatch(REGEX, text) is not None),
         ("choice", "guided_choice", CHOICES, lambda text: text in CHOICES),
         ("grammar", "guided_grammar", GRAMMAR, lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) is not None)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(DEFAULT_MODEL, tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _chat(**options) -> dict:
    return dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Who speaks?"}], temperature=1.0,
                max_tokens=60, n=6, seed=1) | options


@pytest.mark.parametrize("member, guided, value, check", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("spelling", ["structured_outputs", "guided"])
def test_chat_follows_each_vllm_constraint(client, spelling, member, guided, value, check):
    extra = {"structured_outputs": {member: value}} if spelling == "structured_outputs" else {guided: value}
    reply = client.chat.completions.create(**_chat(), extra_body=extra)
    assert len(reply.choices) == 6
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice


def test_completions_take_the_extras_too(client):
    reply = client.completions.create(model=MODEL_NAME, prompt="ROMEO:", max_tokens=40, temperature=1.0, n=4,
                                      seed=2, extra_body={"guided_regex": REGEX})
    assert all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in reply.choices), reply.choices


def test_json_object_is_response_formats_and_a_schema_may_be_json_text(client):
    """structured_outputs {"json_object": true} runs response_format json_object's constraint (same seeded texts;
    the shipped model rarely closes an object within max_tokens, so the texts are compared, each begun with
    "{"); guided_json may be the schema's JSON text."""
    given = client.chat.completions.create(**_chat(), extra_body={"structured_outputs": {"json_object": True}})
    same = client.chat.completions.create(**_chat(), response_format={"type": "json_object"})
    texts = [c.message.content for c in given.choices]
    assert texts == [c.message.content for c in same.choices] and all(t.startswith("{") for t in texts)
    reply = client.chat.completions.create(**_chat(), extra_body={"guided_json": json.dumps(SPEAKER)})
    assert all(_valid_json(c.message.content) for c in reply.choices)


def test_streamed_choice_is_one_of_the_choices(client):
    stream = client.chat.completions.create(**_chat(n=1), stream=True, extra_body={"guided_choice": CHOICES})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text in CHOICES


@pytest.mark.parametrize("body, param, phrase", [
    ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice both constrain the output; pass one of them"),
    ({"response_format": {"type": "json_object"}, "guided_json": SPEAKER}, "guided_json",
     "response_format and guided_json both constrain the output"),
    ({"structured_outputs": {"regex": "a"}, "guided_grammar": GRAMMAR}, "guided_grammar",
     "structured_outputs and guided_grammar both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs sets regex and choice; set exactly one of json, regex, choice, grammar or json_object"),
    ({"structured_outputs": {}}, "structured_outputs", "structured_outputs sets none; set exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "unknown field 'whitespace_pattern'; this server accepts: choice, grammar, json, json_object, regex"),
    ({"guided_choice": []}, "guided_choice", "guided_choice=[]; send at least one choice"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "guided_json is a JSON list; send a JSON schema object"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled into a grammar"),
    ({"structured_outputs": {"grammar": "root ::= oops"}}, "structured_outputs", "cannot be compiled into a grammar"),
])
def test_conflicting_or_malformed_extras_are_400_naming_the_field(server, body, param, phrase):
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=_chat() | body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and phrase in error["message"], error
