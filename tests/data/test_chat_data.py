"""Chat conversations from local jsonl / parquet (via datasets) with role loss masks, packed with
document boundaries; pretraining preprocessing with the BPE tokenizer; malformed rows named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data import build_data_iterator
from megatron_s2.data.chat import load_chat_documents, tokenize_conversation
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDataset
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import load_tokenizer
from tests.data.test_hf_tokenizer import CONVERSATION, TINY_BPE, TOOLS


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(TINY_BPE)


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _write_parquet(path: Path, records) -> Path:
    from datasets import Dataset

    Dataset.from_list([{"messages": json.dumps(r["messages"])} for r in records]).to_parquet(str(path))
    return path


def test_chat_jsonl_and_parquet_give_the_same_documents(bpe, tmp_path):
    records = [{"messages": CONVERSATION, "tools": TOOLS, "reasoning_effort": 60},
               {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}]
    [store] = load_chat_documents([_write_jsonl(tmp_path / "c.jsonl", records)], bpe)
    ids, target = tokenize_conversation(bpe, CONVERSATION, tools=TOOLS, reasoning_effort=60)
    assert np.array_equal(store.tokens(0), ids) and np.array_equal(store.targets(0), target)
    # parquet through datasets: messages stored as a JSON string column are not valid messages
    with pytest.raises(DataError, match=r"c.parquet:row 1: no non-empty 'messages' list"):
        load_chat_documents([_write_parquet(tmp_path / "c.parquet", records)], bpe)
    from datasets import Dataset

    Dataset.from_list([{"messages": r["messages"]} for r in records[1:]] * 2).to_parquet(str(tmp_path / "d.parquet"))
    [parquet] = load_chat_documents([tmp_path / "d.parquet"], bpe)
    assert len(parquet) == 2 and np.array_equal(parquet.tokens(0), store.tokens(1))
    assert np.array_equal(parquet.targets(1), store.targets(1))


def test_malformed_rows_stop_or_are_counted(bpe, tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = _write_jsonl(tmp_path / "mixed.jsonl", [good, "{not json", {"messages": []}, good,
                                                   {"messages": [{"role": "wizard", "content": "x"}]},
                                                   {"messages": [{"role": "user", "content": "no answer"}]}])
    with pytest.raises(DataError, match=r"mixed.jsonl:2: not valid JSON"):
        load_chat_documents([path], bpe)
    logged = []
    [store] = load_chat_documents([path], bpe, on_bad_record="skip", log=logged.append)
    assert len(store) == 2
    assert len(logged) == 1 and "skipped 4 malformed record(s)" in logged[0] and "mixed.jsonl:5: messages[0].role" \
        in logged[0]


@pytest.mark.parametrize("message, reason", [
    ({"content": "4"}, r"messages\[1\]\.role: None is not one of"),
    ({"role": "assistant"}, r"messages\[1\]\.content: expected a string"),
    ("4", r"messages\[1\]: expected an object"),
])
def test_a_malformed_later_message_is_named_by_file_and_line(bpe, tmp_path, message, reason):
    """A message without 'role' after a good one was a KeyError traceback from the chat-template
    tokenizer (it indexed each message by role before checking it); now the same file:line error
    as every other malformed record, and counted under on_bad_record=skip."""
    good = {"messages": [{"role": "user", "content": "1+3"}, {"role": "assistant", "content": "4"}]}
    path = _write_jsonl(tmp_path / "roles.jsonl", [good, {"messages": [{"role": "user", "content": "1+3"}, message]}])
    with pytest.raises(DataError, match=r"roles.jsonl:2: " + reason):
        load_chat_documents([path], bpe)
    logged = []
    [store] = load_chat_documents([path], bpe, on_bad_record="skip", log=logged.append)
    assert len(store) == 1 and "skipped 1 malformed record(s)" in logged[0]


def test_sft_iterator_trains_only_assistant_tokens_across_packed_conversations(bpe, tmp_path):
    second = [{"role": "user", "content": "Sort: cba"}, {"role": "assistant", "content": "abc"},
              {"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ba"}]
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}, {"messages": second}] * 4)
    cfg = DataConfig(kind="chat", tokenizer=str(TINY_BPE), paths=(str(path),))
    it = build_data_iterator(cfg, seq_length=128, global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1,
                             seed=3, phase="sft", tokenizer=bpe)
    batch = it.next_step()[0]
    assistant, eos = bpe.special_ids["assistant"], bpe.eos_id
    for row in range(2):
        tokens, labels, mask, docs = (batch[k][row].numpy() for k in ("tokens", "labels", "loss_mask", "doc_ids"))
        trained = labels[mask > 0]
        assert len(trained) > 0 and assistant not in trained and bpe.special_ids["user"] not in trained
        # every trained label belongs to the same document as its input (boundaries respected)
        segment = np.concatenate([docs[1:], [docs[-1] + 1]])
        assert np.all(docs[mask > 0] == segment[mask > 0])
        # every assistant turn's closing eos is trained
        assert (np.flatnonzero((labels == eos) & (mask > 0))).size >= 1
    pretrain = build_data_iterator(cfg, seq_length=128, global_batch_size=2, micro_batch_size=2, dp_rank=0,
                                   dp_size=1, seed=3, phase="pretrain", tokenizer=bpe).next_step()[0]
    assert pretrain["loss_mask"].sum() > batch["loss_mask"].sum()  # pretraining trains every role


def test_an_assistant_message_of_weight_0_is_context_only(bpe, tmp_path):
    """OpenAI's fine-tuning field: ``"weight": 0`` keeps an assistant turn (a retry conversation's
    wrong first answer) in the context and out of the targets; only a number >= 0, and only on an
    assistant turn."""
    retry = [{"role": "system", "content": "Reply with the answer only."}, {"role": "user", "content": "1+63"},
             {"role": "assistant", "content": "66", "weight": 0}, {"role": "user", "content": "Wrong. Try again."},
             {"role": "assistant", "content": "64"}]
    ids, target = tokenize_conversation(bpe, retry)
    plain_ids, plain_target = tokenize_conversation(bpe, [{k: v for k, v in m.items() if k != "weight"}
                                                          for m in retry])
    assert np.array_equal(ids, plain_ids)  # the same tokens: the template ignores the field
    assert bpe.decode(ids[target].tolist()) == bpe.decode(bpe.encode("64")) + bpe.decode([bpe.eos_id])
    assert plain_target.sum() > target.sum() and not (target & ~plain_target).any()
    for message, bad in (({"role": "assistant", "content": "4", "weight": -0.5}, "-0.5"),
                         ({"role": "user", "content": "4", "weight": 0}, "user"),
                         ({"role": "user", "content": "4", "weight": 2}, "user"),
                         ({"role": "assistant", "content": "4", "weight": "2"}, "'2'"),
                         ({"role": "assistant", "content": "4", "weight": True}, "True"),
                         # beyond float32 (a hostile try-out: passed the check, then inf in the loss and a traceback)
                         ({"role": "assistant", "content": "4", "weight": 1e39}, "1e\\+39"),
                         ({"role": "assistant", "content": "4", "weight": 10 ** 400}, r"0{30}\.\.\. on")):
        with pytest.raises(DataError, match=r"messages\[1\]\.weight: expected a number from 0 to 1e\+06 on an "
                                            r"assistant .*" + bad):
            tokenize_conversation(bpe, [{"role": "user", "content": "2+2"}, message])
    with pytest.raises(DataError, match="no tokens of the trained roles"):  # only context: nothing to train
        load_chat_documents([_write_jsonl(tmp_path / "w.jsonl", [{"messages": retry[:3]}])], bpe)


def test_an_assistant_message_of_weight_4_counts_four_times_in_the_loss_mask(bpe, tmp_path):
    """A weight other than 0 / 1 turns the target flags into float32 loss weights, kept through
    the document store, packing and the loader's loss_mask (the loss is sum(w * ce) / sum(w))."""
    chat = [{"role": "user", "content": "1+63"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "so?"}, {"role": "assistant", "content": "64", "weight": 4}]
    ids, weights = tokenize_conversation(bpe, chat)
    _, flags = tokenize_conversation(bpe, [{k: v for k, v in m.items() if k != "weight"} for m in chat])
    assert weights.dtype == np.float32 and flags.dtype == bool
    assert np.array_equal(weights > 0, flags) and set(weights[flags].tolist()) == {1.0, 4.0}
    assert bpe.decode(ids[weights == 4].tolist()) == bpe.decode(bpe.encode("64")) + bpe.decode([bpe.eos_id])
    [store] = load_chat_documents([_write_jsonl(tmp_path / "w.jsonl", [{"messages": chat}])], bpe)
    assert np.array_equal(store.targets(0), weights)
    cfg = DataConfig(kind="chat", tokenizer=str(TINY_BPE), paths=(str(tmp_path / "w.jsonl"),))
    [batch] = build_data_iterator(cfg, seq_length=len(ids) - 1, global_batch_size=1, micro_batch_size=1, dp_rank=0,
                                  dp_size=1, seed=0, phase="sft", tokenizer=bpe).next_step()
    assert np.array_equal(batch["loss_mask"][0].numpy(), weights[1:])


def test_retry_conversations_answer_right_after_a_masked_near_miss(bpe):
    from megatron_s2.config.data import TaskDifficulty
    from megatron_s2.data.synthetic_chat import retry_conversations
    from megatron_s2.data.tasks import build_task

    task = build_task("addition", TaskDifficulty(addition_max_digits=2))
    records = list(retry_conversations("addition", TaskDifficulty(addition_max_digits=2), 400, 7, retry_fraction=0.3,
                                       system_prompt="S.", feedback="No."))
    assert records == list(retry_conversations("addition", TaskDifficulty(addition_max_digits=2), 400, 7,
                                               retry_fraction=0.3, system_prompt="S.", feedback="No."))
    retries = [r["messages"] for r in records if len(r["messages"]) == 5]
    assert 0.25 < len(retries) / len(records) < 0.35
    for messages in (r["messages"] for r in records):
        assert messages[0] == {"role": "system", "content": "S."} and task.verify(messages[1]["content"],
                                                                                  messages[-1]["content"])
    for system, question, miss, feedback, answer in retries:
        assert miss["weight"] == 0 and not task.verify(question["content"], miss["content"])
        assert feedback == {"role": "user", "content": "No."} and "weight" not in answer
    bare = next(retry_conversations("addition", TaskDifficulty(addition_max_digits=2), 1, 7, retry_fraction=1.0,
                                    system_prompt="", feedback="No."))
    assert [m["role"] for m in bare["messages"]] == ["user", "assistant", "user", "assistant"]


def test_chat_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="paths: kind 'chat' needs at least one"):
        DataConfig(kind="chat")
    with pytest.raises(ConfigError, match=r"paths: 'x.txt' is not a .jsonl or .parquet file"):
        DataConfig(kind="chat", paths=("x.txt",))
    with pytest.raises(ConfigError, match="loss_roles"):
        DataConfig(loss_roles=("wizard",))


def test_preprocess_with_the_bpe_tokenizer(bpe, tmp_path):
    texts = [{"text": "The cat sat on the mat."}, {"prompt": "12+30", "answer": "42"}, {"text": "Café ünïcödé"}]
    jsonl = _write_jsonl(tmp_path / "pre.jsonl", texts)
    from datasets import Dataset

    Dataset.from_list([{"text": "parquet text one"}, {"text": "two"}]).to_parquet(str(tmp_path / "pre.parquet"))
    stats = preprocess_jsonl([jsonl, tmp_path / "pre.parquet"], tmp_path / "out", bpe)
    assert (stats.documents, stats.prompt_answer_documents, stats.unknown_tokens) == (5, 1, 0)
    data = IndexedDataset(tmp_path / "out")
    assert data.vocab_size == bpe.vocab_size and len(data) == 5
    assert data.tokens(0).tolist() == [bpe.bos_id, *bpe.encode("The cat sat on the mat."), bpe.eos_id]
    assert bpe.decode(data.tokens(2)) == "Café ünïcödé" and bpe.decode(data.tokens(4)) == "two"
    qa, target = tokenize_conversation(bpe, [{"role": "user", "content": "12+30"},
                                             {"role": "assistant", "content": "42"}])
    assert data.tokens(1).tolist() == qa.tolist() and data.prompt_lengths[1] == int(np.argmax(target))
    assert np.array_equal(data.targets(1), target)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"txt": "typo"}, {"text": "fine"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string 'text'"):
        preprocess_jsonl([bad], tmp_path / "bad", bpe)
    assert not (tmp_path / "bad.idx").exists()
    stats = preprocess_jsonl([bad], tmp_path / "skipped", bpe, on_bad_record="skip")
    assert (stats.documents, stats.skipped_records) == (2, 1)
