"""Hugging Face tokenizers from local directories: round trip, V4-style chat template (tool turns,
§5.1.4 effort line), role loss masks, the Engram compressed token map, training reproducibility."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.chat import tokenize_conversation
from megatron_s2.data.chat_format import SPECIAL_TOKENS
from megatron_s2.data.errors import DataError
from megatron_s2.data.tokenizer import CharTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY_BPE = ROOT / "recipes" / "tokenizers" / "tiny-bpe"

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "It is 42.", "reasoning_content": "12+30=42"},
    {"role": "user", "content": "And 7*6?"},
    {"role": "assistant", "content": "Also 42."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(TINY_BPE)


def test_round_trip_and_special_ids(bpe):
    assert bpe.vocab_size == 512
    assert [bpe.bos_id, bpe.eos_id, bpe.pad_id] == [0, 1, 2]  # the released order: pad 2 = engram_pad_token_id
    assert bpe.special_ids["user"] == 3 and bpe.special_ids["assistant"] == 4 and bpe.special_ids["think_end"] == 6
    for text in ["12+30=42", "copy:HeLLo World\n\t", "Café naïve — ünïcödé 漢字 🙂", "", "   "]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
    assert bpe.encode(SPECIAL_TOKENS[3]) == [3]  # special strings map to their ids
    assert bpe.decode([0, *bpe.encode("hi"), 1]) == "hi"
    assert bpe.decode([0, *bpe.encode("hi"), 1], keep_special=True) == f"{SPECIAL_TOKENS[0]}hi{SPECIAL_TOKENS[1]}"
    assert bpe.decode([bpe.vocab_size + 3]) == "\ufffd"  # a padded model embedding may sample these


def test_chat_template_renders_tools_effort_and_tool_turns(bpe):
    text = bpe.apply_chat_template(CONVERSATION[:5], tools=TOOLS, reasoning_effort=75, tokenize=False,
                                   add_generation_prompt=False)
    assert text == (
        "<｜begin▁of▁sentence｜>Reasoning Effort: 75 (range 1–100; higher values request more thorough reasoning)\n"
        '## Tools\n{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n'
        "Be brief.<｜User｜>What is 12+30?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>"
        '{"a": 12, "b": 30}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜Assistant｜><think>12+30=42</think>It is 42.<｜end▁of▁sentence｜>")
    prompt = bpe.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)
    assert prompt[-1] == bpe.special_ids["assistant"] and prompt[0] == bpe.bos_id
    # the template renders exactly as transformers' own apply_chat_template does
    assert text == bpe._tok.apply_chat_template(CONVERSATION[:5], tools=TOOLS, reasoning_effort=75, tokenize=False)
    with pytest.raises(DataError, match=r"reasoning_effort: must be an integer in 1..100"):
        bpe.apply_chat_template(CONVERSATION[:2], reasoning_effort=101)
    with pytest.raises(DataError, match=r"messages\[0\].role: 'robot'"):
        bpe.apply_chat_template([{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_role_masks_on_a_multi_turn_conversation(bpe, tokenizer):
    tok = bpe if tokenizer == "bpe" else CharTokenizer()
    ids, target = tokenize_conversation(tok, CONVERSATION, tools=TOOLS, reasoning_effort=50)
    assert len(ids) == len(target) and ids[0] == tok.bos_id
    trained = tok.decode(ids[target], keep_special=True)
    if tokenizer == "bpe":
        assert trained == ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 12, \"b\": 30}"
                           "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
                           "<think>12+30=42</think>It is 42.<｜end▁of▁sentence｜>Also 42.<｜end▁of▁sentence｜>")
        assert tok.special_ids["assistant"] not in ids[target]  # generation prompts are never targets
    else:
        assert trained.endswith("<think>12+30=42</think>It is 42.<eos>Also 42.<eos>")
        assert tok.sep_id not in ids[target]
    assert tok.decode(ids[~target]).count("What is 12+30?") == 1
    # three assistant turns: three runs of targets, each ending with eos
    runs = np.flatnonzero(np.diff(np.concatenate([[0], target.astype(int), [0]])) == -1) - 1
    assert len(runs) == 3 and all(ids[r] == tok.eos_id for r in runs)
    # configurable: tool outputs trained as well
    same, with_tool = tokenize_conversation(tok, CONVERSATION, loss_roles=("assistant", "tool"), tools=TOOLS,
                                            reasoning_effort=50)
    assert np.array_equal(same, ids) and not (target & ~with_tool).any()
    assert "42" in tok.decode(ids[with_tool & ~target], keep_special=True)


def test_char_chat_keeps_the_single_turn_layout():
    tok = CharTokenizer()
    ids, target = tokenize_conversation(tok, [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}])
    assert ids.tolist() == [tok.bos_id, *tok.encode("1+2"), tok.sep_id, *tok.encode("3"), tok.eos_id]
    assert target.tolist() == [False] * 5 + [True, True]


def test_compressed_token_map_follows_the_reference_normalisation(bpe):
    """Ids whose surface forms normalise alike (case, accents, whitespace runs) share one id;
    byte fragments (U+FFFD when decoded alone) keep their own; ids are dense, in id order."""
    table = bpe.compressed_token_map()
    assert len(table) == bpe.vocab_size and table[:3] == [0, 1, 2]
    assert sorted(set(table)) == list(range(bpe.compressed_vocab_size))
    first = {}
    for i, c in enumerate(table):
        first.setdefault(c, i)
    assert [first[c] for c in sorted(first)] == sorted(first.values())  # numbered by first id
    single = {bpe.decode([i]): i for i in range(bpe.vocab_size)}
    for a, b in [("A", "a"), ("Z", "z"), (" ", "\n"), ("\t", " ")]:
        assert table[single[a]] == table[single[b]], (a, b)
    assert table[single["a"]] != table[single["b"]]
    fragments = [i for i in range(bpe.vocab_size) if "\ufffd" in bpe.decode([i])]
    assert len({table[i] for i in fragments}) == len(fragments) > 0
    # a model with a padded embedding: extra ids share the pad token's compressed id
    assert bpe.compressed_token_map(520)[512:] == [table[bpe.pad_id]] * 8


def test_missing_or_invalid_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=rf"data.tokenizer: {tmp_path / 'none'}: not a tokenizer directory"):
        load_tokenizer(tmp_path / "none")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")
    (broken / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ConfigError, match="has no chat_template"):
        load_tokenizer(broken)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", "x.jsonl",
                          "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert str(tmp_path / "none") in out.stderr


@pytest.mark.parametrize("shipped", [TINY_BPE, TINY_BPE.parent / "tiny-bpe-digits"], ids=["tiny-bpe", "digits"])
def test_shipped_tokenizer_is_reproduced_by_its_command(tmp_path, shipped):
    """recipes/tokenizers/<name>/README.md records the command; re-running it gives the same
    files byte for byte (training is deterministic)."""
    readme = (shipped / "README.md").read_text()
    command = next(line.strip() for line in readme.splitlines() if line.strip().startswith("python tools/"))
    args = command.split()[2:]
    args[args.index("--output") + 1] = str(tmp_path / "again")
    from megatron_s2.tools.train_tokenizer import main

    assert main(args) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (shipped / name).read_bytes(), name
    assert (shipped / "tokenizer.json").stat().st_size < 100_000


def test_split_digits_gives_every_digit_its_own_token():
    """tiny-bpe merges digit pairs ("47" is one token: a sum is a lookup of number embeddings);
    --split-digits (tiny-bpe-digits) never does, so addition can be learnt digit by digit."""
    from megatron_s2.data.tokenizer import load_tokenizer

    merged, split = (load_tokenizer(TINY_BPE.parent / n) for n in ("tiny-bpe", "tiny-bpe-digits"))
    assert len(merged.encode("47+38")) < 5
    assert [split.decode([t]) for t in split.encode("47+138")] == list("47+138")


def test_train_tokenizer_on_local_text(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 50 + "The Cat Sat\n" * 20)
    records = tmp_path / "chats.jsonl"
    records.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n")
    from megatron_s2.tools.train_tokenizer import main

    assert main(["--output", str(tmp_path / "tok"), "--vocab-size", "300", "--input", str(corpus),
                 "--input", str(records)]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat") / 2  # merges learnt
    assert main(["--output", str(tmp_path / "bad"), "--vocab-size", "100", "--input", str(corpus)]) == 2


def test_batched_prompt_answer_rendering_equals_the_chat_template(bpe):
    """Synthetic data with a Hugging Face tokenizer renders every pair through the template
    once (placeholders + one batch encode); it must equal the per-pair rendering."""
    from megatron_s2.data.documents import render_prompt_answer, render_prompt_answers

    pairs = [("12+30", "42"), ("copy:AbC d", "AbC d"), ("balanced:(()", "no"), ("sort:cba", "abc"), ("x", "")]
    batched = render_prompt_answers(bpe, pairs)
    for pair, (ids, prompt_length) in zip(pairs, batched):
        want_ids, want_length = render_prompt_answer(bpe, *pair)
        assert ids.tolist() == want_ids.tolist() and prompt_length == want_length
        assert bpe.decode(ids[prompt_length:]) == pair[1]  # targets: the answer (and eos)
        assert ids[prompt_length - 1] == bpe.special_ids["assistant"]
