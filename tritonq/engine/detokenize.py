"""Incremental detokenization with stop strings, one Detokenizer per sequence.

    detok = Detokenizer(tokenizer, stop=("\\n\\n",))
    for token in generated:            # one call per generated token
        piece = detok.add(token)       # text that is now final ("" while undecided)
        if detok.stopped: break        # a stop string appeared: stop generating this sequence
    piece = detok.flush()              # the rest, once the sequence has ended
    detok.text                         # every piece joined

The joined pieces equal `tokenizer.decode(ids, skip_special_tokens=True)` cut before the earliest
stop string (the text a non-streamed call returns), so streaming and non-streaming agree exactly:
- Each add() decodes only a short window of the newest ids (the tokens since the last clean
  character boundary plus one token of context, so a SentencePiece "▁" keeps its space), never the
  whole output: cost per token does not grow with the output length.
- A window that ends in U+FFFD (a multi-byte character cut by a token) is held back until its
  remaining bytes arrive; flush() emits it as decode() would if they never do. (One exception:
  a SentencePiece ByteFallback decoder turns a whole run of <0xNN> byte tokens into U+FFFD when
  the run is not valid UTF-8, e.g. ends in a cut character, complete characters included; those
  were streamed already and stay; add_many() over the whole output, as the engine does for a request
  neither streamed nor stopped by strings, gives decode()'s text there.)
- Text that could be the start of a stop string is held back until it is known not to be one, so
  no character of a stop string is ever yielded.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"  # what decode() writes for bytes that do not (yet) form a character


class Detokenizer:
    """Turns one sequence's generated token ids into text pieces; see the module docstring.

    tokenizer: a transformers tokenizer (only .decode(ids, skip_special_tokens=True) is used).
    stop: stop strings (a str or an iterable of str), each non-empty; the text ends before the earliest.
    min_tokens: no stop string ends the text before this many tokens were added (GenerationConfig.min_tokens);
        text that could start one is still held back, so a stop that completes at or after it does end it.
    """

    def __init__(self, tokenizer, stop: str | tuple[str, ...] | list[str] = (), min_tokens: int = 0):
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str; got {stop!r}. Drop the empty string "
                                 "(an empty stop would end every sequence before its first character).")
        self.tokenizer, self.stop, self.min_tokens = tokenizer, stop, min_tokens
        self.ids: list[int] = []
        self.stopped = False  # True once a stop string has appeared; add() then ignores further tokens
        self._pieces: list[str] = []  # text already returned
        self._held = ""  # final text not returned yet: it could be the start of a stop string
        # The window ids[context:] is re-decoded at each step. ids[context:boundary] were decoded and
        # committed before (context for the tokenizer); `committed` = how many characters of the
        # window's decoded text are already committed (returned or held).
        self._context = self._boundary = self._committed = 0

        self._backend = _backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that became final with it (often "")."""
        return self.add_many((token_id,))

    def add_many(self, token_ids) -> str:
        """Append several generated tokens with one decode of the window (a request whose text is only
        read at its end: one call instead of one per token); return the text that became final."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in token_ids)
        window = self._decode(self.ids[self._context:])
        complete = window.rstrip(_REPLACEMENT)
        new = complete[self._committed:] if len(complete) > self._committed else ""
        self._committed = max(self._committed, len(complete))
        if complete == window:  # ends on a character boundary: the next window can start later
            context = self._decode(self.ids[self._boundary:])
            if context:  # keep a context that decodes to something (not only skipped special tokens)
                self._context, self._committed = self._boundary, len(context)
            self._boundary = len(self.ids)
        return self._release(new)

    def flush(self) -> str:
        """The sequence has ended: return the remaining text (a cut character as decode() writes it)."""
        if self.stopped:
            return ""
        window = self._decode(self.ids[self._context:])
        piece = self._release(window[self._committed:], final=True)
        self._context = self._boundary = len(self.ids)
        self._committed = 0
        return piece

    @property
    def text(self) -> str:
        """Every piece returned so far, joined (after flush(): the whole text)."""
        return "".join(self._pieces)

    def _release(self, new: str, final: bool = False) -> str:
        """Append new final text; return what can be shown: all of it up to a stop string, less any
        tail that could still grow into one (none when final)."""
        if not self.stop:  # nothing held back, nothing to look for
            if new:
                self._pieces.append(new)
            return new
        text = self._held + new
        armed = len(self.ids) >= self.min_tokens  # before min_tokens, stop strings do not end the text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1) if armed else -1
        if cut >= 0:  # a stop string can only start in the held tail or the new text: earlier text was checked
            self.stopped, self._held, text = True, "", text[:cut]
        else:
            keep = 0 if final else self._stop_prefix_length(text)
            self._held, text = text[len(text) - keep:], text[:len(text) - keep]
        if text:
            self._pieces.append(text)
        return text

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string (0 if none)."""
        for n in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0


def _backend_decoder(tokenizer):
    """The `tokenizers` Tokenizer under a transformers fast tokenizer whose decode(ids, skip_special_tokens=True)
    is exactly that Tokenizer's decode (transformers' own _decode, no clean-up of spaces), else None. Decoding
    through it skips transformers' argument conversion: 0.5 us a call instead of 2 (a streamed token is decoded
    once or twice, every step, for every sequence)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode
        return None
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is TokenizersBackend.decode and tokenizer.clean_up_tokenization_spaces is False):
        return tokenizer._tokenizer
    return None
