"""The tool-call reader on hostile model output: unit tests of tritonq.serve.tools, and a real server
(tests/serve/serve_scripted.py: its sampler writes a given reply) through the official openai client and httpx.

A reply whose <tool_call> block cannot be read (a number past the int-digit limit, nesting past the recursion
limit) is text, as OpenAI answers a reply without a call: content is the text, finish_reason "stop" or
"length", streamed ones end with [DONE].
"""
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import MODEL_NAME, ROOT, Server  # noqa: E402

from tritonq.serve.tools import parse_tool_calls, read_reply  # noqa: E402

TEMPLATE = ("{%- if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
DEEP = '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 1000 + "}}</tool_call>"  # RecursionError first
BIG = '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 700 + "}}</tool_call>"  # the server: 640-digit limit


def test_reader_returns_unreadable_blocks_as_text():
    huge = '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>"  # past 4300 digits
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    for text in (huge, deep, DEEP,
                 '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',   # inf: not JSON once written
                 '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
                 "<tool_call>" * 100_000,                                              # no closing tag
                 '<tool_call>{"name": "f", "arguments": {}}'):
        assert parse_tool_calls(text) == (text, [])
        assert read_reply(text, "stop") == (text, [], "stop")
    # a readable call next to an unreadable one: the call is read, the rest stays content
    content, calls = parse_tool_calls(huge + ' <tool_call>{"name": "g", "arguments": {"y": 1.5}}</tool_call>')
    assert content == huge and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("g", {"y": 1.5})]
    # a block ends at the first closing tag after its opening one
    assert parse_tool_calls('<tool_call><tool_call>{"name": "f"}</tool_call>')[1] == []
    assert read_reply('<tool_call>{"name": "f"}</tool_call>', "length")[2] == "length"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from transformers import AutoTokenizer

    from tritonq.demo import write_tiny_llama
    folder = write_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny", hidden_size=64, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())  # room for the 1000-bracket reply (random weights)
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    script = tmp_path_factory.mktemp("script") / "script.json"
    script.write_text("[0]")
    server = Server(folder, tmp_path_factory.mktemp("log") / "server.log", "--max-seq-len", "2048",
                    entry=[str(ROOT / "tests" / "serve" / "serve_scripted.py")], env={"TRITONQ_TEST_SCRIPT_FILE": str(script)})

    def say(text: str) -> None:
        """The server's next replies: text, then EOS."""
        script.write_text(json.dumps(tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]))
    yield server, say, tokenizer
    server.stop()


def _chat(**extra) -> dict:
    return dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=[TOOL], **extra)


@pytest.mark.parametrize("text", [DEEP, BIG], ids=["deep", "big-int"])
def test_unreadable_tool_call_is_text_whole_and_streamed(scripted, text):
    server, say, _ = scripted
    say(text)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)
    reply = client.chat.completions.create(**_chat())
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == text and reply.choices[0].message.tool_calls is None
    # cut by max_tokens: "length", the text so far
    cut = client.chat.completions.create(**_chat(max_tokens=50))
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == text[:50]
    # streamed: the text in content deltas, "stop", then [DONE]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=_chat(stream=True), timeout=300) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]


def test_readable_tool_call_is_a_call(scripted):
    server, say, _ = scripted
    say('<tool_call>{"name": "f", "arguments": {"x": [[1]]}}</tool_call>')
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
    reply = client.chat.completions.create(**_chat())
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"x": [[1]]}
    streamed = list(client.chat.completions.create(**_chat(stream=True)))
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert streamed[-1].choices[0].delta.tool_calls[0].function.name == "f"


def test_a_reply_whose_chunks_fail_to_build_still_ends_with_an_error_and_done():
    """Whatever goes wrong writing a streamed reply (here a chunker that raises), the stream ends with an
    error chunk and [DONE], never cut off."""
    import asyncio
    from types import SimpleNamespace

    from tritonq.serve.engine_loop import EngineLoop, Event, Stream
    from tritonq.serve.sse import stream_response

    class Broken:
        include_usage = False

        def chunks(self, choice, text, out, first):
            raise RecursionError("too deep")

    class Connected:
        async def is_disconnected(self):
            return False

    async def run():
        engine_loop = EngineLoop(None, metrics=None)
        stream = Stream([[1]], [[None]], asyncio.get_running_loop())
        stream.request_ids = [0]
        out = SimpleNamespace(request_id=0, token_id=5, logprob=0.0, top_logprobs=None, text="x", finished=True,
                              finish_reason="stop")
        stream.queue.put_nowait(Event(outputs=[out]))
        response = stream_response(engine_loop, stream, Connected(), 1, Broken())
        return [piece async for piece in response.body_iterator]
    pieces = asyncio.run(run())
    assert pieces[-1] == "data: [DONE]\n\n" and len(pieces) == 2
    error = json.loads(pieces[0][len("data: "):])["error"]
    assert error["code"] == 500 and "RecursionError: too deep" in error["message"]
