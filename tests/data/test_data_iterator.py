"""The trainer-facing iterator: batch layout, determinism, dp sharding, epochs, blending, resume."""

import time

import numpy as np
import pytest
import torch

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data import batch_fingerprint, build_data_iterator, build_tokenizer
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDatasetWriter
from megatron_s2.data.sample_order import BlendedSampleOrder, blend_counts

TOK = build_tokenizer(DataConfig())
SMALL = DataConfig(num_documents=1500)


def _iterator(cfg=SMALL, *, seq_length=32, gbs=8, mbs=2, dp_rank=0, dp_size=1, seed=3, phase="pretrain"):
    return build_data_iterator(cfg, seq_length=seq_length, global_batch_size=gbs, micro_batch_size=mbs,
                               dp_rank=dp_rank, dp_size=dp_size, seed=seed, phase=phase, tokenizer=TOK)


def _rows(micro_batches) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for batch in micro_batches for row in batch["tokens"]]


def test_micro_batch_layout():
    it = _iterator(gbs=12, mbs=3, dp_size=2, dp_rank=1)
    batches = it.next_step()
    assert len(batches) == it.num_micro_batches == 2
    expected = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
                "doc_ids": torch.int64, "position_ids": torch.int64}
    for batch in batches:
        assert {k: v.dtype for k, v in batch.items()} == expected
        assert all(v.shape == (3, 32) for v in batch.values())
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert torch.equal(batch["position_ids"], torch.arange(32).expand(3, 32))
        assert int(batch["tokens"].max()) < TOK.vocab_size


def test_same_arguments_give_the_same_stream_and_seed_changes_it():
    a, b, c = _iterator(), _iterator(), _iterator(seed=4)
    stream_a = [batch_fingerprint(a.next_step()) for _ in range(5)]
    assert stream_a == [batch_fingerprint(b.next_step()) for _ in range(5)]
    assert stream_a != [batch_fingerprint(c.next_step()) for _ in range(5)]
    assert len(set(stream_a)) == 5


def test_dataset_seed_pins_the_documents_while_the_run_seed_shuffles():
    pinned = DataConfig(num_documents=1500, dataset_seed=0)
    one, two = _iterator(pinned, seed=1), _iterator(pinned, seed=2)
    assert one.state_dict()["sizes_sha256"] == two.state_dict()["sizes_sha256"]
    assert batch_fingerprint(one.next_step()) != batch_fingerprint(two.next_step())


def test_dp_ranks_split_the_global_batch_disjointly():
    reference = _iterator(gbs=8, mbs=2)
    ranks = [_iterator(gbs=8, mbs=1, dp_size=4, dp_rank=r) for r in range(4)]
    for _ in range(3):
        per_rank = [_rows(r.next_step()) for r in ranks]
        combined = [row for rows in per_rank for row in rows]
        assert combined == _rows(reference.next_step())
        assert len(set(combined)) == len(combined) == 8


def test_every_epoch_covers_every_row_in_a_new_order():
    probe = _iterator()
    rows = probe.num_sequences
    it = _iterator(gbs=rows, mbs=1)
    epoch_0, epoch_1 = _rows(it.next_step()), _rows(it.next_step())
    assert sorted(epoch_0) == sorted(epoch_1) and len(set(epoch_0)) == rows
    assert epoch_0 != epoch_1
    # Steps straddling the epoch boundary keep going (infinite iteration).
    straddle = _iterator(gbs=rows - 1, mbs=1)
    for _ in range(3):
        assert len(straddle.next_step()) == rows - 1


@pytest.mark.parametrize("save_at", [3, 7])
def test_resume_reproduces_the_uninterrupted_stream(save_at):
    uninterrupted = _iterator()
    expected = [batch_fingerprint(uninterrupted.next_step()) for _ in range(2 * save_at)]
    first = _iterator()
    got = [batch_fingerprint(first.next_step()) for _ in range(save_at)]
    state = first.state_dict()
    del first
    resumed = _iterator()
    resumed.load_state_dict(state)
    got += [batch_fingerprint(resumed.next_step()) for _ in range(save_at)]
    assert got == expected


def test_resume_under_another_dp_layout_keeps_the_global_order():
    single = _iterator(gbs=8, mbs=4)
    for _ in range(2):
        single.next_step()
    state = single.state_dict()
    ranks = [_iterator(gbs=8, mbs=2, dp_size=2, dp_rank=r) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    assert _rows(single.next_step()) == _rows(ranks[0].next_step()) + _rows(ranks[1].next_step())


def test_resume_onto_different_data_is_refused():
    state = _iterator().state_dict()
    with pytest.raises(DataError, match=r"seq_length \(saved 32, now 64\)"):
        _iterator(seq_length=64).load_state_dict(state)
    with pytest.raises(DataError, match="different data stream"):
        _iterator(DataConfig(num_documents=1500, tasks=("addition",))).load_state_dict(state)


def test_sft_phase_masks_prompts():
    pretrain, sft = _iterator(phase="pretrain"), _iterator(phase="sft")
    a, b = pretrain.next_step(), sft.next_step()
    assert batch_fingerprint(a) == batch_fingerprint(b)
    masked_pretrain = sum(float(m["loss_mask"].sum()) for m in a)
    masked_sft = sum(float(m["loss_mask"].sum()) for m in b)
    assert 0 < masked_sft < masked_pretrain
    for batch in b:  # every SFT target follows the separator or another answer token
        targets = batch["labels"][batch["loss_mask"] == 1]
        assert TOK.sep_id not in targets.tolist() and TOK.bos_id not in targets.tolist()


@pytest.mark.parametrize("gbs, mbs, dp_size, dp_rank, message", [
    (10, 1, 4, 0, r"global_batch_size: 10 is not divisible by dp_size x micro_batch_size = 4 x 1"),
    (8, 3, 1, 0, "global_batch_size: 8 is not divisible"),
    (8, 1, 2, 2, r"dp_rank: must be in 0..1"),
])
def test_layout_errors(gbs, mbs, dp_size, dp_rank, message):
    with pytest.raises(ConfigError, match=message):
        _iterator(gbs=gbs, mbs=mbs, dp_size=dp_size, dp_rank=dp_rank)


def test_default_synthetic_dataset_builds_quickly():
    # process CPU time, not wall time: a loaded machine (a parallel suite, other jobs) stretches
    # the wall clock of the same work past any fixed limit
    started = time.process_time()
    it = _iterator(DataConfig(), seq_length=128, gbs=16)
    it.next_step()
    assert time.process_time() - started < 5.0
    assert it.packed[0].fill_ratio > 0.95


def test_blend_counts_follow_weights():
    assert blend_counts([10, 30], None).tolist() == [10, 30]
    assert blend_counts([10, 30], [3.0, 1.0]).tolist() == [30, 10]
    assert blend_counts([100, 1], [1.0, 1e-9]).tolist() == [101, 1]
    order = BlendedSampleOrder([7, 3], [1.0, 1.0], seed=0)
    datasets, rows = order.lookup(np.arange(3 * order.epoch_length))
    per_epoch = datasets.reshape(3, -1)
    assert (per_epoch == 0).sum(axis=1).tolist() == [5, 5, 5]
    # The down-weighted dataset still visits all its rows: 15 draws of 7 rows.
    assert set(rows[datasets == 0].tolist()) == set(range(7))


def test_indexed_blend_end_to_end(tmp_path):
    for name, token in (("a", 10), ("b", 20)):
        with IndexedDatasetWriter(tmp_path / name, TOK.vocab_size) as writer:
            for n in range(40):
                writer.add_document(np.array([TOK.bos_id] + [token] * (3 + n % 5) + [TOK.eos_id]))
    cfg = DataConfig(kind="indexed", paths=(str(tmp_path / "a"), str(tmp_path / "b")), weights=(3.0, 1.0))
    it = _iterator(cfg, seq_length=15, gbs=16, mbs=4)
    tokens = torch.cat([b["tokens"] for _ in range(10) for b in it.next_step()])
    share_a = int((tokens == 10).any(dim=1).sum()) / tokens.shape[0]
    assert 0.65 < share_a < 0.85
    with IndexedDatasetWriter(tmp_path / "big_vocab", 200) as writer:
        writer.add_document(np.array([1, 150, 2]))
    with pytest.raises(DataError, match="200-token vocabulary but the 'char' tokenizer has 102"):
        _iterator(DataConfig(kind="indexed", paths=(str(tmp_path / "big_vocab"),)))
    with pytest.raises(DataError, match="missing.idx: index file not found"):
        _iterator(DataConfig(kind="indexed", paths=(str(tmp_path / "missing"),)))
