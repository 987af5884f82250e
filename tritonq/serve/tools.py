"""Tool calls in a reply, Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Models whose chat template renders `tools` (Hermes, Qwen 2 / 2.5 / 3, ...) write each call as one JSON
object between these tags. parse_tool_calls() reads them into OpenAI `tool_calls`; text outside the tags
stays the reply's content. A block that is not a JSON object with a string "name" (and a JSON object
"arguments", or none) is left in the content, as the model wrote it.
"""
from __future__ import annotations

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call: arguments is the JSON text of the function's arguments."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: the text outside well-formed <tool_call> blocks (stripped; None
    when only calls remain; the whole text when there are no calls) and one OpenAI tool call per block, in order."""
    calls, kept, at = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(tool_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip() or None, calls


def read_reply(text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a finished reply that may call tools (parse_tool_calls); a
    reply that ended on its own ("stop") with calls finishes with "tool_calls", as OpenAI's do."""
    content, calls = parse_tool_calls(text)
    return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
