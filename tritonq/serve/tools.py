"""Tool calls in a reply, Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Models whose chat template renders `tools` (Hermes, Qwen 2 / 2.5 / 3, ...) write each call as one JSON
object between these tags. parse_tool_calls() reads them into OpenAI `tool_calls`; text outside the tags
stays the reply's content. A block that is not a JSON object with a string "name" (and a JSON object
"arguments", or none) is left in the content, as the model wrote it: so is one JSON cannot read within
bounds (a number past Python's int-digit limit, nesting past the recursion limit, NaN / Infinity, which
would not be JSON once written back). Reading never raises on model output and takes time linear in it.
"""
from __future__ import annotations

import json
import math
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call: arguments is the JSON text of the function's arguments."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's text, or None when it is not a call read within bounds."""
    try:
        call = json.loads(block, parse_float=_finite, parse_constant=_not_json)
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # JSONDecodeError, int digit limit, non-finite, too deep
        return None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: the text outside well-formed <tool_call> blocks (stripped; None
    when only calls remain; the whole text when there are no calls) and one OpenAI tool call per block, in order.
    A block runs from an opening tag to the first closing tag after it."""
    calls, kept, at, start = [], [], 0, text.find(OPEN)
    while start >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        call = _call(text[start + len(OPEN):end])
        if call is not None:
            kept.append(text[at:start])
            at = end + len(CLOSE)
            calls.append(tool_call(*call))
        start = text.find(OPEN, end + len(CLOSE))
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip() or None, calls


def read_reply(text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a finished reply that may call tools (parse_tool_calls); a
    reply that ended on its own ("stop") with calls finishes with "tool_calls", as OpenAI's do; one with no
    readable call keeps its text as content and its finish reason ("stop" / "length")."""
    content, calls = parse_tool_calls(text)
    return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
