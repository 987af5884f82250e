"""Detokenizer: streamed pieces joined equal the tokenizer's own decode() of all ids, cut before the
earliest stop string; no piece ever holds part of a stop string; each step decodes a short window.

The reference is tokenizer.decode(ids, skip_special_tokens=True) of the whole sequence (the
tokenizers library), cut with str.find: independent of the incremental logic under test. Two
tokenizers: byte-level BPE (tritonq.demo's, one token per byte: every multi-byte character is cut
by tokens) and a SentencePiece-style one (Metaspace "▁" with a leading-space strip, byte fallback).
"""
import random

import pytest

from tritonq.demo import byte_tokenizer
from tritonq.engine.detokenize import Detokenizer
from tritonq.api.model import GenerationConfig

TEXTS = ["hello world", "~!tt!!=x", "héllo wörld 日本語 🙂!= ok", "a\n\nb  c", "ééé", "🙂🙂"]


def sentencepiece_tokenizer():
    """A Llama-style fast tokenizer: a few pieces, "▁" for spaces, <0xNN> byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"helowrdabctx!=~\n", "▁h", "▁he", "ll", "!="]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("!", "=")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": byte_tokenizer(), "sentencepiece": sentencepiece_tokenizer()}


def reference(tokenizer, ids, stop=()):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def stream(tokenizer, ids, stop=()):
    """(pieces, index of the token at which the detokenizer said stopped, or None)."""
    detok = Detokenizer(tokenizer, stop)
    pieces, stopped_at = [], None
    for i, token in enumerate(ids):
        pieces.append(detok.add(token))
        if detok.stopped:
            stopped_at = i
            break
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces, stopped_at


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_decoded_text(name, text):
    tokenizer = TOKENIZERS[name]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    for end in range(len(ids) + 1):  # every prefix: many end inside a multi-byte character
        pieces, _ = stream(tokenizer, ids[:end])
        joined, expected = "".join(pieces), reference(tokenizer, ids[:end])
        if name == "sentencepiece" and expected.endswith("\ufffd"):
            # ByteFallback turns a whole run of byte tokens into U+FFFD when its last character is
            # cut, including complete characters already streamed: those stay, the cut one is U+FFFD.
            assert joined.endswith("\ufffd") and joined.rstrip("\ufffd").startswith(expected.rstrip("\ufffd"))
        else:
            assert joined == expected


@pytest.mark.parametrize("name", TOKENIZERS)
def test_cut_character_is_held_then_flushed(name):
    tokenizer = TOKENIZERS[name]
    ids = tokenizer("aé", add_special_tokens=False).input_ids
    cut = ids[:-1]  # "a" + the first byte of "é"
    assert tokenizer.decode(cut).endswith("\ufffd")
    detok = Detokenizer(tokenizer)
    assert "".join(detok.add(t) for t in cut) == "a"  # the half character is not shown...
    assert detok.flush() == "\ufffd"  # ...until the end, where it is written as decode() writes it


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_match_the_cut_reference(name, text):
    tokenizer = TOKENIZERS[name]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    full = reference(tokenizer, ids)
    stops = {full[i:i + n] for n in (1, 2, 3) for i in range(len(full) - n + 1)}
    stops |= {s[:-1] + "\x00" for s in stops if len(s) > 1}  # prefixes that occur, stops that never complete
    stops |= {"!=", "zz"}
    for stop in sorted(stops):
        for stop_set in [(stop,), (stop, full[-1:] or "q")]:
            pieces, stopped_at = stream(tokenizer, ids, stop_set)
            expected = reference(tokenizer, ids, stop_set)
            assert "".join(pieces) == expected, (stop_set, pieces)
            first_hit = next((k for k in range(1, len(ids) + 1)
                              if reference(tokenizer, ids[:k], stop_set) != reference(tokenizer, ids[:k])), None)
            assert stopped_at == (None if first_hit is None else first_hit - 1)


def test_stop_straddling_tokens_is_never_yielded():
    """The case from issue 15: stop="!=" over "~!tt!!...": the first "!" of "!!" must be shown
    (it is not followed by "="), the last "!" only once known; "!=" itself never."""
    tokenizer = byte_tokenizer()
    ids = tokenizer("~!tt!!=x", add_special_tokens=False).input_ids
    pieces, stopped_at = stream(tokenizer, ids, "!=")
    assert "".join(pieces) == "~!tt!" and stopped_at == 6
    ids = tokenizer("~!tt!!", add_special_tokens=False).input_ids
    assert "".join(stream(tokenizer, ids, "!=")[0]) == "~!tt!!"  # held "!" released by flush


def test_each_step_decodes_a_short_window():
    """Cost per token does not grow with the output: no decode() call sees more than a few ids."""
    tokenizer = byte_tokenizer()
    lengths = []

    class Counting:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    text = "héllo wörld 日本語 🙂 " * 40
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = Detokenizer(Counting(), stop=("\n\n",))
    for token in ids:
        detok.add(token)
    detok.flush()
    assert detok.text == text and len(ids) > 500
    assert max(lengths) <= 8  # a character is at most 4 bytes, plus one character of context


def test_random_ids_match_reference():
    """Random ids, special tokens included. SentencePiece ids skip the <0xNN> byte tokens: ByteFallback
    decodes an invalid run of them as all U+FFFD, valid bytes included (see the module docstring)."""
    rng = random.Random(0)
    for name, tokenizer in TOKENIZERS.items():
        choices = range(len(tokenizer)) if name == "byte_level" else [0, 1, 2, *range(259, len(tokenizer))]
        for _ in range(30):
            ids = [rng.choice(choices) for _ in range(rng.randrange(1, 25))]
            stop = ("!=", "\ufffd") if name == "byte_level" else ("ll",)
            assert "".join(stream(tokenizer, ids)[0]) == reference(tokenizer, ids)
            assert "".join(stream(tokenizer, ids, stop)[0]) == reference(tokenizer, ids, stop)


@pytest.mark.parametrize("stop", ["", ("a", ""), [""]])
def test_empty_stop_string_is_refused(stop):
    with pytest.raises(ValueError, match="non-empty"):
        Detokenizer(byte_tokenizer(), stop)
    with pytest.raises(ValueError, match="non-empty"):
        GenerationConfig(stop=(stop,) if isinstance(stop, str) else tuple(stop))


def test_decodes_through_the_tokenizers_backend_only_where_that_is_decode():
    """The backend's decode is called directly only for a fast tokenizer whose decode adds nothing to it (no
    clean-up of spaces, no overridden _decode); other tokenizers go through tokenizer.decode."""
    assert all(Detokenizer(tok)._backend is not None for tok in TOKENIZERS.values())
    cleaned = sentencepiece_tokenizer()
    cleaned.clean_up_tokenization_spaces = True
    assert Detokenizer(cleaned)._backend is None
    ids = cleaned("he ll !=", add_special_tokens=False).input_ids
    assert "".join(stream(cleaned, ids)[0]) == reference(cleaned, ids)
