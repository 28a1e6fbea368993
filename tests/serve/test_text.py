"""Incremental detokenisation of streamed completions (no server): the streamed pieces join to
the full text, a stop string is cut and never leaks while streaming, held-back text is released
at the end, and decoding only a window of recent tokens gives the same text as decoding all."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_s2.data.tokenizer import CharTokenizer
from megatron_s2.serve.text import TextStream


def stream(tok, ids, stop=(), chunk=1):
    text, pieces = TextStream(tok, stop), []
    for i in range(0, len(ids), chunk):
        pieces.append(text.push(ids[i:i + chunk], last=i + chunk >= len(ids)))
    return pieces


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_pieces_join_to_the_text(chunk):
    tok = CharTokenizer()
    ids = [random.Random(s).randrange(5, 200) for s in range(300)]  # ids past the vocabulary render as U+FFFD
    assert "".join(stream(tok, ids, chunk=chunk)) == tok.decode(ids)


def test_a_stop_string_is_cut_and_never_streamed():
    tok = CharTokenizer()
    text = "the quick brown fox jumps over the lazy dog " * 4
    ids = tok.encode(text)
    for stop in ("fox", "lazy dog", "q", "over the"):
        end = text.index(stop) + len(stop)  # the engine stops at the token completing the stop string
        pieces = stream(tok, tok.encode(text[:end]), stop=(stop, "never"))
        assert "".join(pieces) == text[:text.index(stop)]
        sent = ""
        for piece in pieces[:-1]:
            sent += piece
            assert stop not in sent and len(sent) <= text.index(stop)
    assert "".join(stream(tok, ids, stop=("zzz",))) == text  # held-back text comes out at the end


def test_multi_byte_characters_are_held_until_complete():
    """Byte-level BPE splits characters outside ASCII over several tokens: a streamed piece
    never ends in half a character, and the pieces join to the text."""
    from megatron_s2.data.hf_tokenizer import HFTokenizer

    root = Path(__file__).resolve().parents[2]
    tok = HFTokenizer(root / "recipes" / "tokenizers" / "tiny-bpe")
    text = "naïve café — 東京で寿司 🍣🍣 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2 and tok.decode(ids) == text
    pieces = stream(tok, ids)
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def test_special_tokens_and_stop_strings_in_the_text_on_request():
    """vLLM's ``skip_special_tokens: false`` keeps special tokens' text; its
    ``include_stop_str_in_output`` ends the text after the stop string instead of before."""
    from megatron_s2.data.hf_tokenizer import HFTokenizer

    root = Path(__file__).resolve().parents[2]
    tok = HFTokenizer(root / "recipes" / "tokenizers" / "tiny-bpe")
    ids = [tok.bos_id] + tok.encode("one two three") + [tok.eos_id]
    assert TextStream(tok).push(ids, last=True) == "one two three"
    kept = TextStream(tok, keep_special=True).push(ids, last=True)
    assert kept == tok.decode([tok.bos_id], keep_special=True) + "one two three" + tok.decode([tok.eos_id],
                                                                                               keep_special=True)
    stopped = [tok.bos_id] + tok.encode("one two")  # the engine stops at the token completing " tw"
    for chunk in (1, 4):
        pieces, text = [], TextStream(tok, (" tw",), include_stop=True)
        for i in range(0, len(stopped), chunk):
            pieces.append(text.push(stopped[i:i + chunk], last=i + chunk >= len(stopped)))
        assert "".join(pieces) == "one tw"
