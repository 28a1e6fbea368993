"""The character tokenizer: ids, round trips, JSON, Engram compression map."""

import string

import pytest

from megatron_s2.config.data import DataConfig
from megatron_s2.data.errors import DataError
from megatron_s2.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer, build_tokenizer


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return build_tokenizer(DataConfig())


def test_vocab_fits_tiny_model_and_special_ids_are_fixed(tok):
    assert tok.vocab_size == 5 + len(DEFAULT_ALPHABET) == 102
    assert tok.vocab_size <= 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.unk_id) == (0, 1, 2, 3, 4)


def test_round_trip_of_every_alphabet_character(tok):
    text = "Sum: 123+4567=4690\n\t[(a<b) && {c!=d}] ~`'\"^_|\\@#$%"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(tok.unk_id < i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(DEFAULT_ALPHABET)) == DEFAULT_ALPHABET
    unknown = [c for c, i in zip(string.printable, tok.encode(string.printable)) if i == tok.unk_id]
    assert unknown == ["\r", "\x0b", "\x0c"]  # the only printable characters outside the alphabet


def test_unknown_characters_and_special_tokens(tok):
    assert tok.encode("é€") == [tok.unk_id, tok.unk_id]
    assert tok.encode("aé") == [tok.encode("a")[0], tok.unk_id]
    ids = [tok.bos_id, *tok.encode("1+2"), tok.sep_id, *tok.encode("3"), tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "1+23"
    assert tok.decode(ids, keep_special=True) == "<bos>1+2<sep>3<eos><pad>"
    # A model with a 128-entry head may sample ids the tokenizer does not have.
    assert tok.decode([tok.unk_id, 127, -1]) == "\ufffd" * 3


def test_json_round_trip(tok):
    restored = CharTokenizer.from_json(tok.to_json())
    assert restored == tok
    assert restored.encode("Hello, World!") == tok.encode("Hello, World!")
    custom = CharTokenizer("ab\n")
    assert CharTokenizer.from_json(custom.to_json()).encode("ba\n") == [6, 5, 7]


@pytest.mark.parametrize("payload, message", [
    ("{not json", "not valid JSON"),
    ('{"kind": "bpe", "version": 1}', "expected kind 'char'"),
    ('{"kind": "char", "version": 9}', "unsupported version"),
    ('{"kind": "char", "version": 1, "special_tokens": ["<pad>"], "alphabet": "a"}', "special_tokens"),
])
def test_json_errors(payload, message):
    with pytest.raises(DataError, match=message):
        CharTokenizer.from_json(payload)


def test_duplicate_alphabet_characters_are_rejected():
    with pytest.raises(DataError, match="more than once"):
        CharTokenizer("abca")


def test_compressed_token_map_folds_case_and_whitespace(tok):
    table = tok.compressed_token_map()
    assert len(table) == tok.vocab_size
    assert sorted(set(table)) == list(range(tok.compressed_vocab_size))  # dense ids
    assert table[: tok.unk_id + 1] == [0, 1, 2, 3, 4]  # specials keep their ids; pad stays 0

    def compress(text):
        return [table[i] for i in tok.encode(text)]

    assert compress("The Cat") == compress("tHE\tcAT") == compress("the\ncat")
    assert compress("abc") != compress("abd")
    assert len(set(compress(string.digits + string.punctuation))) == 10 + len(string.punctuation)
    assert tok.compressed_vocab_size == tok.vocab_size - 26 - 2


def test_compressed_token_map_covers_a_larger_model_vocabulary(tok):
    table = tok.compressed_token_map(num_ids=128)  # the tiny model's embedding rows
    assert len(table) == 128
    assert table[: tok.vocab_size] == tok.compressed_token_map()
    assert set(table[tok.vocab_size:]) == {table[tok.unk_id]}
    with pytest.raises(DataError, match="must cover all 102 tokenizer ids"):
        tok.compressed_token_map(num_ids=64)
