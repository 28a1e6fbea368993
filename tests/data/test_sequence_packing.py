"""Chunking, best-fit packing and the per-position view the model trains on."""

import numpy as np
import pytest

from megatron_s2.data.documents import InMemoryDocuments
from megatron_s2.data.errors import DataError
from megatron_s2.data.loader import DataIterator
from megatron_s2.data.packing import best_fit_pack, split_into_chunks

PAD = 0


def _labelled_documents(sizes, prompt_lengths) -> InMemoryDocuments:
    """Token of document d at position p is 1000 * (d + 1) + p: each token names its origin."""
    return InMemoryDocuments.from_documents(
        (1000 * (d + 1) + np.arange(n), prompt) for d, (n, prompt) in enumerate(zip(sizes, prompt_lengths)))


def _one_epoch(store, seq_length, answer_only):
    """Every packed row exactly once: one step of global_batch_size = number of rows."""
    rows = len(best_fit_pack(store.sizes, seq_length + 1))
    it = DataIterator([store], seq_length=seq_length, global_batch_size=rows, micro_batch_size=1, dp_rank=0,
                      dp_size=1, seed=5, answer_only=answer_only, pad_id=PAD)
    return it.next_step()


def test_long_documents_split_into_one_token_overlapping_chunks():
    documents, starts, lengths = split_into_chunks(np.array([10, 4, 5, 2]), row_length=4)
    assert documents.tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert starts.tolist() == [0, 3, 6, 0, 0, 3, 0]
    assert lengths.tolist() == [4, 4, 4, 4, 4, 2, 2]
    with pytest.raises(DataError, match="at least 2 tokens"):
        split_into_chunks(np.array([3]), row_length=1)


def test_best_fit_decreasing_on_a_worked_example():
    # Longest first into the tightest row: 6 -> r0 (2 free), 5 -> r1 (3 free), 4 -> r2 (4 free),
    # 3 -> r1 (tightest fit, 0 free), 2 -> r0 (0 free).
    packed = best_fit_pack(np.array([2, 5, 3, 6, 4]), row_length=8)
    rows = [packed.segment_document[packed.row_offsets[r]:packed.row_offsets[r + 1]].tolist()
            for r in range(len(packed))]
    assert rows == [[3, 0], [1, 2], [4]]
    assert packed.fill_ratio == pytest.approx(20 / 24)


def test_packing_covers_every_chunk_once_and_is_deterministic():
    sizes = np.random.default_rng(0).integers(2, 90, size=500)
    packed = best_fit_pack(sizes, row_length=33)
    again = best_fit_pack(sizes, row_length=33)
    assert np.array_equal(packed.segment_document, again.segment_document)
    assert np.array_equal(packed.segment_start, again.segment_start)
    row_tokens = np.add.reduceat(packed.segment_length, packed.row_offsets[:-1])
    assert row_tokens.max() <= 33
    documents, starts, _ = split_into_chunks(sizes, 33)
    assert sorted(zip(packed.segment_document.tolist(), packed.segment_start.tolist())) == sorted(
        zip(documents.tolist(), starts.tolist()))
    # No two partial rows could have been merged: best fit leaves little slack.
    assert packed.fill_ratio > 0.97


@pytest.mark.parametrize("answer_only", [False, True])
def test_targets_stay_inside_documents_and_cover_each_token_once(answer_only):
    rng = np.random.default_rng(1)
    sizes = rng.integers(2, 60, size=200)
    prompts = [int(rng.integers(1, n)) for n in sizes]
    store = _labelled_documents(sizes, prompts)
    seen = []
    for batch in _one_epoch(store, seq_length=24, answer_only=answer_only):
        tokens, labels = batch["tokens"][0].numpy(), batch["labels"][0].numpy()
        mask, doc_ids = batch["loss_mask"][0].numpy(), batch["doc_ids"][0].numpy()
        assert batch["position_ids"][0].tolist() == list(range(24))
        assert np.all(np.diff(doc_ids) >= 0)
        for segment in np.unique(doc_ids):
            origin = tokens[doc_ids == segment] // 1000
            assert len(set(origin.tolist())) == 1  # one document (or padding) per segment id
            if origin[0] == 0:
                assert np.all(tokens[doc_ids == segment] == PAD) and segment == doc_ids.max()
        on = mask == 1
        assert np.array_equal(labels[on] // 1000, tokens[on] // 1000)  # never across documents
        assert np.array_equal(labels[on], tokens[on] + 1)  # the next token of the same document
        seen += labels[on].tolist()
    first_target = [p if answer_only else 1 for p in prompts]
    expected = [1000 * (d + 1) + p for d, n in enumerate(sizes) for p in range(first_target[d], n)]
    assert sorted(seen) == sorted(expected)


def test_sft_mask_trains_on_answer_and_eos_only():
    # bos 1 2 sep | 7 8 eos : prompt length 4, targets are the last three tokens.
    store = InMemoryDocuments.from_documents([(np.array([1, 10, 11, 3, 17, 18, 2]), 4)])
    (batch,) = DataIterator([store], seq_length=9, global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1,
                            seed=0, answer_only=True, pad_id=PAD).next_step()
    assert batch["tokens"][0].tolist() == [1, 10, 11, 3, 17, 18, 2, 0, 0]
    assert batch["labels"][0].tolist() == [10, 11, 3, 17, 18, 2, 0, 0, 0]
    assert batch["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert batch["doc_ids"][0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    (pretrain,) = DataIterator([store], seq_length=9, global_batch_size=1, micro_batch_size=1, dp_rank=0,
                               dp_size=1, seed=0, answer_only=False, pad_id=PAD).next_step()
    assert pretrain["loss_mask"][0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0]
