"""Malformed jsonl rows that used to escape the file:line policy with a traceback (review 13):
bytes that are not UTF-8, a lone surrogate escape the tokenizer cannot take, JSON nested past
the parser's recursion limit, and a ``tools`` field that is not a list of tool objects. Each is
one malformed record: named ``file:line`` under ``stop``, counted under ``skip``."""

from __future__ import annotations

import json

import pytest

from megatron_s2.data.chat import load_chat_documents
from megatron_s2.data.errors import DataError
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import load_tokenizer
from tests.data.test_hf_tokenizer import TINY_BPE

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_LINES = {
    "not UTF-8": b"\xff\xfe{}",
    "lone surrogate": b'{"messages": [{"role": "user", "content": "\\udc80"}, {"role": "assistant", "content": "x"}]}',
    "too deeply": b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "tools": json.dumps({**GOOD, "tools": "x"}).encode(),
}


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(TINY_BPE)


@pytest.mark.parametrize("words", list(BAD_LINES))
def test_a_malformed_chat_row_is_named_or_counted(bpe, tmp_path, words):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + BAD_LINES[words] + b"\n" + json.dumps(GOOD).encode() + b"\n")
    with pytest.raises(DataError, match=rf"chat.jsonl:2: .*{words}"):
        load_chat_documents([path], bpe)
    logged = []
    [store] = load_chat_documents([path], bpe, on_bad_record="skip", log=logged.append)
    assert len(store) == 2 and "skipped 1 malformed record(s)" in logged[0]


@pytest.mark.parametrize("words", ["not UTF-8", "lone surrogate"])
def test_preprocess_names_a_bad_text_row(bpe, tmp_path, words):
    path = tmp_path / "text.jsonl"
    line = {"not UTF-8": b'{"text": "caf\xe9"}', "lone surrogate": b'{"text": "\\ud800"}'}[words]
    path.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    with pytest.raises(DataError, match=rf"text.jsonl:2: .*{words}"):
        preprocess_jsonl([path], tmp_path / "out", bpe)


def test_the_preprocess_tool_names_its_own_flags(tmp_path, capsys):
    """Its refusals named the recipe key data.on_bad_record; a missing --input exited 1."""
    from tools.preprocess_data import main

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n\xff\n')
    assert main(["--tokenizer", str(TINY_BPE), "--input", str(bad), "--output-prefix", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2: not UTF-8" in err[0] and "--on-bad-record skip" in err[0], err
    assert main(["--tokenizer", str(TINY_BPE), "--input", str(tmp_path / "none.jsonl"), "--output-prefix",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input" in err[0] and "none.jsonl" in err[0], err


def test_train_tokenizer_refuses_an_empty_corpus(tmp_path, capsys):
    """Empty input files exited 0 with a 300-id tokenizer learnt from the chat format's fixed
    strings alone; the corpus holding no text is refused (exit 2, one line, nothing written)."""
    from tools.train_tokenizer import main

    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n\n")
    assert main(["--output", str(tmp_path / "tok"), "--vocab-size", "300", "--input", str(empty),
                 "--input", str(blank)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input" in err[0] and "empty.txt" in err[0] and "no text" in err[0], err
    assert not (tmp_path / "tok").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.txt"]  # no staging left


def test_train_tokenizer_says_when_the_corpus_cannot_reach_the_vocab_size(tmp_path, capsys):
    """--vocab-size 10000000 on a small corpus silently wrote a 330-id tokenizer. Far below the
    request (under half) it is refused, naming the size reached; a little below it is written
    with a note naming the size reached."""
    from tools.train_tokenizer import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 20)
    assert main(["--output", str(tmp_path / "huge"), "--vocab-size", "10000000", "--input", str(corpus)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vocab-size" in err[0] and "10000000" in err[0], err
    reached = int(err[0].split(" ids")[0].split()[-1])  # "... reaches only N ids ..."
    assert 270 <= reached < 400 and not (tmp_path / "huge").exists()
    assert main(["--output", str(tmp_path / "near"), "--vocab-size", str(reached + 10), "--input", str(corpus)]) == 0
    captured = capsys.readouterr()
    assert f"{reached} ids" in captured.out
    notes = captured.err.strip().splitlines()
    assert len(notes) == 1 and "note" in notes[0] and f"{reached + 10}" in notes[0] and f"{reached}" in notes[0], notes
    assert main(["--output", str(tmp_path / "exact"), "--vocab-size", str(reached), "--input", str(corpus)]) == 0
    assert capsys.readouterr().err == ""
    assert ((tmp_path / "exact" / "tokenizer.json").read_bytes() == (tmp_path / "near" / "tokenizer.json").read_bytes())


def test_train_tokenizer_refusals(tmp_path, capsys):
    """An --output that is a file was a FileExistsError traceback; an --output holding another
    tokenizer was overwritten (runs trained with it then refuse to resume); a missing --input
    and a too small --vocab-size exited 1; a .txt that is not UTF-8 was a traceback."""
    from tools.train_tokenizer import main

    def refused(args, code, *words):
        assert main(args) == code, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 20)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(["--output", str(blocker), "--vocab-size", "300", "--synthetic", "5"], 2, "--output", "is a file")
    refused(["--output", str(tmp_path / "o"), "--vocab-size", "300", "--input", str(tmp_path / "none.txt")], 2,
            "--input", "none.txt")
    refused(["--output", str(tmp_path / "o"), "--vocab-size", "100", "--synthetic", "5"], 2, "--vocab-size")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"ok\ncaf\xe9\n")
    refused(["--output", str(tmp_path / "o"), "--vocab-size", "300", "--input", str(latin1)], 1, "latin1.txt:2",
            "not UTF-8")
    first = ["--output", str(tmp_path / "tok"), "--vocab-size", "300", "--input", str(corpus)]
    assert main(first) == 0 and main(first) == 0  # the same command again: the same files, allowed
    before = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    capsys.readouterr()
    refused(["--output", str(tmp_path / "tok"), "--vocab-size", "290", "--input", str(corpus)], 2,
            "--output", "another tokenizer")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left
