"""Structured outputs and tools over HTTP: `python -m tritonq.serve` on 127.0.0.1, the official openai client.

The server runs a random tiny Llama (byte tokenizer) whose chat template renders `tools` the Hermes / Qwen
way. Every output is checked with independent references: json.loads + jsonschema for response_format
and for the arguments of a named tool call.
"""
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serve_util import MODEL_NAME, Server  # noqa: E402

from tritonq.serve.tools import parse_tool_calls  # noqa: E402

# A Qwen-style template: tools listed in a system turn, calls written as <tool_call>{json}</tool_call>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<s>system: tools (call as <tool_call>{json}</tool_call>):\n"
    "{% for tool in tools %}{{ tool.function.name }} {{ tool.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{%- for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,9}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "none"]},
    "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 3}},
    "required": ["name", "age", "pet", "scores"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["C", "F"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    from tritonq.demo import write_tiny_llama
    folder = write_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny", hidden_size=64, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    s = Server(folder, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "50")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _chat(**options):
    """Chat arguments; max_tokens leaves room for the tools in the prompt (max_seq_len 512, byte tokens)."""
    return dict(model=MODEL_NAME, messages=[{"role": "user", "content": "a person, please"}], temperature=1.0,
                **{"max_tokens": 120 if "tools" not in options else 60} | options)


def test_chat_json_schema_outputs_parse_and_validate(client):
    reply = client.chat.completions.create(**_chat(n=50, response_format=_person_format()))
    assert len(reply.choices) == 50
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in reply.choices}) > 10  # sampled, not forced


def test_chat_json_schema_streamed_outputs_parse_and_validate(client):
    texts, finished = {}, {}
    for chunk in client.chat.completions.create(**_chat(n=50, response_format=_person_format(), stream=True)):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert len(texts) == 50 and set(finished.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_json_schema_and_json_object(client):
    reply = client.completions.create(model=MODEL_NAME, prompt="{", max_tokens=120, temperature=1.0, n=50,
                                      extra_body={"response_format": _person_format()})
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)
    # json_object: any object. A random model writes long free keys, so some run out of tokens; every one
    # that ended on its own is a JSON object, and every one is a prefix the grammar allowed.
    reply = client.chat.completions.create(**_chat(n=20, response_format={"type": "json_object"}))
    done = [c for c in reply.choices if c.finish_reason == "stop"]
    assert done
    for choice in done:
        assert isinstance(json.loads(choice.message.content), dict)
    assert all(c.message.content.startswith("{") for c in reply.choices)


def test_named_tool_choice_gives_valid_tool_calls(client):
    parameters = WEATHER["function"]["parameters"]
    reply = client.chat.completions.create(**_chat(n=20, tools=[CLOCK, WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_named_tool_choice_streamed_as_tool_call_deltas(client):
    parameters = WEATHER["function"]["parameters"]
    calls = {}
    for chunk in client.chat.completions.create(**_chat(n=5, stream=True, tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "get_weather"}})):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {"name": None, "arguments": ""})
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert len(calls) == 5
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), parameters)


def test_tools_auto_renders_them_into_the_prompt_and_reads_replies(client):
    plain = client.chat.completions.create(**_chat())
    auto = client.chat.completions.create(**_chat(tools=[WEATHER]))
    # the tools' JSON is in the prompt (the byte tokenizer: one token per byte)
    assert auto.usage.prompt_tokens - plain.usage.prompt_tokens > len(json.dumps(WEATHER["function"]["name"]))
    # a random model writes no <tool_call>: the reply is text, as it came
    assert auto.choices[0].message.tool_calls is None and isinstance(auto.choices[0].message.content, str)
    # a conversation that already called a tool renders and runs
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param,phrase", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
     "response_format", "cannot be compiled into a grammar: Unsupported type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a \"json_schema\""),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, "response_format", "pass one of them"),
])
def test_bad_structured_requests_are_400_naming_the_field(server, body, param, phrase):
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=_chat() | body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and phrase in error["message"], error


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema, part", [
    ({"$ref": "https://example.com/person.json"}, "but got https://example.com/person.json"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}, "but got other.json#/a"),
    ({"type": "string", "pattern": "a^b"}, "Anchor '^' in the middle of regex is ignored: a^b"),
    ({"type": "string", "pattern": "ab$c"}, "'$'"),
    ({"type": "string", "pattern": "(?=a)[a-z]"}, "Lookahead assertion is not supported and is ignored"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 4}, "ignoring minLength/maxLength"),
    ({"type": "number", "multipleOf": 0.5}, "ignoring multipleOf"),
])
def test_a_constraint_xgrammar_would_loosen_is_400_naming_the_part(client, schema, part):
    """xgrammar compiles these with a warning and drops the part (an unconstrained object for a remote $ref, `ab`
    for a^b): refused, never answered under a looser constraint."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_chat(response_format=_schema_format(schema)))
    assert info.value.status_code == 400 and info.value.param == "response_format"
    assert "cannot be compiled exactly" in info.value.message and part in info.value.message, info.value.message


def test_a_named_tool_with_a_remote_ref_is_400_naming_tool_choice(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/f.json"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_chat(tools=[tool], tool_choice={"type": "function",
                                                                          "function": {"name": "f"}}))
    assert info.value.param == "tool_choice" and "https://example.com/f.json" in info.value.message


def test_a_grammar_past_its_budget_is_400_and_plain_requests_do_not_wait_for_it(client):
    """Nested bounded repeats build an automaton cubic in the bounds (four groups: minutes): two such schemas (distinct, so neither is
    the other's cached refusal) are refused past structured.COMPILE_TIMEOUT_S each, one after the other on the
    compiler process; plain requests sent meanwhile are answered before the second refusal (they are tokenized
    and checked on another pool). An order, not a time: the second refusal comes after two budgets."""
    import threading

    from tritonq.engine.structured import COMPILE_TIMEOUT_S
    slow = [{"type": "string", "pattern": "".join(f"({a}{{0,128}}{b}{{0,128}}){{0,128}}" for a, b in pairs)}
            for pairs in (["ab", "cd", "ef", "gh"], ["ij", "kl", "mn", "op"])]  # one group: ~7 s on 2 loaded cores
    events, errors = [], []

    def refused(schema):
        try:
            client.chat.completions.create(**_chat(response_format=_schema_format(schema)))
        except openai.BadRequestError as e:
            errors.append(e.message)
        events.append("refused")
    threads = [threading.Thread(target=refused, args=(schema,)) for schema in slow]
    for t in threads:
        t.start()
    threads[0].join(1.0)  # a head start, not a bound
    for _ in range(3):
        reply = client.chat.completions.create(**_chat(max_tokens=4))
        assert reply.choices[0].finish_reason in ("stop", "length")
        events.append("plain")
    for t in threads:
        t.join()
    assert events[-1] == "refused" and events.count("plain") == 3, events
    assert len(errors) == 2 and all(f"took longer than {COMPILE_TIMEOUT_S:g} s" in m for m in errors), errors
    reply = client.chat.completions.create(**_chat(response_format=_person_format()))  # the compiler restarted
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_parse_tool_calls_reads_hermes_blocks():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    # not a call: malformed JSON, no name, arguments not an object -> left in the content
    for bad in ('<tool_call>{"name": "f", </tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "no call at all"):
        assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None
