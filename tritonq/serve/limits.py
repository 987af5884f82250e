"""The server's fairness caps: what one request may ask for, so that it cannot slow or hold the others
(docs/server_limits.md). `serve --help` states the defaults; `create_app(limits=...)` sets them.

- Stop strings are matched against every new piece of text on the engine thread, which every stream
  shares: their number and total length are capped (5000 long ones made every other stream ~9x slower).
- The tokens a request asks to generate, prompts x n x max_tokens (max_tokens left out: the rest of the
  context), are capped (one 81-byte request with n=128 held a server for 12 minutes).
- A request body must arrive whole within body_timeout_s, else 408 and the connection is closed (a body
  that never completes would hold its connection forever).
Past a cap the request is refused with a 400 (408 for the body) naming the cap and the option that sets it.
No torch, no pydantic: the command line reads the defaults before the serve extra is imported.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_stop_strings: int = 32
    max_stop_chars: int = 4096
    max_request_tokens: int | None = None  # None: no cap (the command line's default: 16 x max_seq_len)
    body_timeout_s: float = 30.0  # 2 MiB (the default body size cap) in 30 s is ~70 KB/s, slower than any client

    def refusal(self, stops: tuple[str, ...], n: int, max_tokens: list[int], given: bool) -> tuple[str, str] | None:
        """(param, message) of the first cap a request breaks, or None. stops: its stop strings; n: choices per
        prompt; max_tokens: per prompt, the most tokens a choice may generate; given: max_tokens was set (else
        each prompt's is the rest of the context)."""
        if len(stops) > self.max_stop_strings:
            return "stop", (f"stop has {len(stops)} strings; this server takes at most {self.max_stop_strings} per "
                            "request (--max-stop-strings): each is matched against every new piece of text; send fewer")
        chars = sum(map(len, stops))
        if chars > self.max_stop_chars:
            return "stop", (f"the stop strings have {chars} characters in all; this server takes at most "
                            f"{self.max_stop_chars} per request (--max-stop-chars); send shorter or fewer ones")
        total = n * sum(max_tokens)
        if self.max_request_tokens is not None and total > self.max_request_tokens:
            asked = f"max_tokens={max_tokens[0]}" if given else "max_tokens left out: the rest of the context"
            return "max_tokens" if given else "n", (
                f"this request may generate up to {total} tokens ({len(max_tokens)} prompt(s) x n={n} x {asked}); "
                f"this server allows at most {self.max_request_tokens} per request (--max-request-tokens); "
                f"{'lower n or max_tokens' if given else 'set max_tokens or lower n'}")
        return None
