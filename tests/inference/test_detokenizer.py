"""The one incremental detokenizer and stop-string scanner (engine, server, ``generate``): its
pieces join to the full decode, characters split over tokens are held until complete, stop
strings are found across step boundaries, and the work per token does not grow with the
output (the engine used to re-decode the whole output at every token)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_s2.data.tokenizer import CharTokenizer
from megatron_s2.inference.detokenizer import IncrementalDetokenizer, StopStrings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bpe():
    from megatron_s2.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(ROOT / "recipes" / "tokenizers" / "tiny-bpe")


class CountingDecode:
    """A decode that counts the tokens it was given (the detokenizer's work)."""

    def __init__(self, decode):
        self.decode, self.tokens = decode, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return self.decode(ids)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_pieces_join_to_the_decode_and_never_end_in_half_a_character(bpe, chunk):
    text = "naïve café — 東京で寿司 🍣🍣 ok, plain words and ünïcödé again " * 3
    ids = bpe.encode(text)
    detok = IncrementalDetokenizer(bpe.decode)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)


def test_the_first_tokens_read_as_they_follow_the_prompt(bpe):
    prompt, rest = bpe.encode("hello"), bpe.encode("hello world")[len(bpe.encode("hello")):]
    detok = IncrementalDetokenizer(bpe.decode, context=prompt)
    assert detok.push(rest) + detok.flush() == bpe.decode(prompt + rest)[len("hello"):]


def test_work_per_token_does_not_grow_with_the_output():
    tok = CharTokenizer()
    ids = tok.encode("abcdefghij" * 400)
    counting = CountingDecode(tok.decode)
    detok = IncrementalDetokenizer(counting)
    for t in ids:
        detok.push([t])
    assert detok.text == tok.decode(ids)
    assert counting.tokens < 16 * len(ids)  # decoding the whole output at each token: ~n^2 / 2 = 8e6


def test_stop_strings_are_found_across_steps_earliest_first():
    stops = StopStrings(["lazy dog", "fox", "zzz"])
    text, found = "", None
    for piece in ["the quick br", "own f", "ox jumps over the la", "zy dog"]:
        text += piece
        found = found or stops.find(text)
    assert found == ("fox", text.index("fox"))
    stops = StopStrings(["ab", "b"])
    assert stops.find("xxa") is None and stops.find("xxab") == ("ab", 2)  # "ab" starts before "b"
    assert StopStrings([]).find("anything") is None


def test_random_texts_find_what_a_full_search_finds():
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("abc") for _ in range(40))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        scanner, seen, found = StopStrings(stops), "", None
        cuts = sorted(rng.sample(range(1, 40), 6)) + [40]
        for cut in cuts:
            seen = text[:cut]
            found = scanner.find(seen)
            if found is not None:
                break
        first = min(((text.find(s), s) for s in stops if s in text), default=None)
        if first is None:
            assert found is None
        else:
            # the earliest stop string that has ended by the step where the scanner found one
            ended = min((seen.find(s), s) for s in stops if s in seen)
            assert found == (ended[1], ended[0])
