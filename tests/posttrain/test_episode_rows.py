"""Multi-branch agentic episodes as training rows (issue 25; megatron_s2/posttrain/episode_rows.py).

A hand-built PrefixTree of one session with three branches — one that continues the first
response verbatim, one whose harness re-rendered that response as its own text (smolagents' way),
one that continues the first response verbatim but takes another turn — read the way the trainer
reads a finished episode (``session_samples`` -> ``episode_sample``) and laid out as the step's
micro-batches: every branch ending in policy tokens is a row, every policy segment is trained in
exactly one row with the engine's ids and log-probs, the re-rendered text is masked, the episode's
advantage and Eq. 30 weights land on every trained segment, and each aggregation weighs a sampled
token (token_mean) or an episode (sequence_mean) once."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_s2.config.posttrain.loss import LossConfig
from megatron_s2.posttrain.agentic.gateway_episode import HarnessEpisode, session_samples
from megatron_s2.posttrain.episode_rows import training_rows
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.rollout.agentic_trace import episode_sample
from megatron_s2.posttrain.train_batch import build_micro_batches
from megatron_s2.serve.gateway.traces import CONTEXT, RESPONSE, ROOT, Call, TraceStore

SESSION = "task@0"
SYSTEM, OBS_A, RERENDERED, OBS_C = [1, 2, 3], [4, 5], [20, 21, 22], [6]
R1, R2, R3, R4 = [10, 11], [12, 13, 14], [15, 16], [17]
"""The four sampled responses (one per model call) and the context between them."""


def _logprobs(ids):
    return -0.01 * np.arange(1, len(ids) + 1, dtype=np.float32) - 0.001 * ids[0]


def _tree(directory) -> TraceStore:
    """system+task -> R1 -> obs -> R2 (call 2, verbatim history); system+task -> R1 re-rendered by the
    harness + obs -> R3 (call 3); system+task -> R1 -> another obs -> R4 (call 4)."""
    store = TraceStore(directory)

    def response(parent, ids):
        return store.add_node("task", parent, RESPONSE, f"r{ids[0]}", ids, _logprobs(np.array(ids)))

    def call(k, context, resp, n):
        store.add_call(Call(SESSION, k, context, resp, n, len(store.tree("task").nodes[resp].token_ids), "stop", "chat"))

    c0 = store.add_node("task", ROOT, CONTEXT, "sys", SYSTEM)
    r1 = response(c0, R1)
    call(0, c0, r1, 3)
    oa = store.add_node("task", r1, CONTEXT, "obs-a", OBS_A)
    call(1, oa, response(oa, R2), 7)
    x = store.add_node("task", c0, CONTEXT, "R1 as the harness wrote it", RERENDERED)
    call(2, x, response(x, R3), 6)
    oc = store.add_node("task", r1, CONTEXT, "obs-c", OBS_C)
    call(3, oc, response(oc, R4), 6)
    return store


def _episode(tmp_path, reward=1.0, weights=(1.0, 0.5, -0.5, 1.0)) -> HarnessEpisode:
    _tree(tmp_path)
    samples = session_samples(tmp_path, SESSION)
    return HarnessEpisode("copy_word", "smolagents", SESSION, reward, "passed", "submitted", samples,
                          weights=list(weights))


def test_each_branch_is_a_row_and_each_segment_trains_once(tmp_path):
    sample = episode_sample(_episode(tmp_path), 7, version=2, layer_ids=None)
    rows = sample.rows
    assert [r.tokens for r in rows] == [SYSTEM + R1 + OBS_A + R2, SYSTEM + RERENDERED + R3, SYSTEM + R1 + OBS_C + R4]
    trained = [[t for t, m in zip(r.tokens, r.policy_mask) if m] for r in rows]
    assert trained == [R1 + R2, R3, R4]  # R1 lies on two branches: trained in the first only
    assert [r.spans for r in rows] == [[(3, 5), (7, 10)], [(6, 8)], [(6, 7)]]
    # the harness's re-rendering of R1 (never sampled there) and the shared R1 of the third branch: context
    assert rows[1].policy_mask[3:6] == [False] * 3 and rows[2].policy_mask[3:5] == [False, False]
    for row in rows:  # the engine's log-probs on exactly the trained tokens, nothing elsewhere
        for (start, end) in row.spans:
            assert np.allclose(row.logprobs[start:end], _logprobs(np.array(row.tokens[start:end])))
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(row.logprobs, row.versions, row.policy_mask) if not m)
        assert {v for v, m in zip(row.versions, row.policy_mask) if m} == {2}
        assert row.sample_id == 7 and row.reward == 1.0 and row.finish_reason == "submitted"
    assert [r.process_weights for r in rows] == [[1.0, 0.5], [-0.5], [1.0]]  # dealt out in segment order
    assert sample.num_generated == len(R1 + R2 + R3 + R4)
    restored = RolloutSample.from_state_dict(sample.state_dict())  # checkpoints carry the branches
    assert [r.tokens for r in restored.rows] == [r.tokens for r in rows] and restored.branches[0].spans == [(6, 8)]


def _one_branch(sample_id, reward):
    tokens = [1, 2, 3, 30, 31, 32]
    mask = [False] * 3 + [True] * 3
    return RolloutSample(sample_id, tokens, mask, [-0.1 if m else 0.0 for m in mask], [2 if m else -1 for m in mask],
                         prompt_length=3, reward=reward, spans=[(3, 6)], process_weights=[1.0])


@pytest.mark.parametrize("micro_batch_size, dp_size", [(1, 1), (2, 2)])
def test_micro_batches_credit_every_trained_segment_once(tmp_path, micro_batch_size, dp_size):
    """A batch of four episodes (the multi-branch one solved, advantage +1; three one-branch ones,
    -1): the rows' advantages are Eq. 30 per segment, token_mean weighs each sampled token once,
    and with 2 ranks x 2 rows the 6 rows are padded with 2 filler rows that train nothing."""
    sample = episode_sample(_episode(tmp_path), 0, version=2, layer_ids=None)
    episodes = [sample, *(_one_branch(k, 0.0) for k in (1, 2, 3))]
    mbs = [mb for rank in range(dp_size)
           for mb in build_micro_batches(episodes, [1.0, -1.0, -1.0, -1.0], seq_length=12,
                                         micro_batch_size=micro_batch_size, dp_rank=rank, dp_size=dp_size, pad_id=0,
                                         loss_config=LossConfig(aggregation="token_mean"))]
    rows = 6 if dp_size == 1 else 8
    assert sum(mb["tokens"].shape[0] for mb in mbs) == rows
    assert len({len(build_micro_batches(episodes, [0.0] * 4, seq_length=12, micro_batch_size=micro_batch_size,
                                        dp_rank=rank, dp_size=dp_size, pad_id=0, loss_config=LossConfig()))
                 for rank in range(dp_size)}) == 1  # every rank runs as many micro-batches
    cat = {k: np.concatenate([mb[k].numpy() for mb in mbs]) for k in ("labels", "loss_mask", "advantages", "weights")}
    trained = 2 + 3 + 2 + 1 + 3 * 3
    assert cat["loss_mask"].sum() == trained and np.isclose(cat["weights"].sum(), 1.0)
    assert np.allclose(cat["weights"][cat["loss_mask"] > 0], 1.0 / trained)
    # labels are shifted by one: the trained labels of each row and their advantages
    got = [(cat["labels"][i][cat["loss_mask"][i] > 0].tolist(), cat["advantages"][i][cat["loss_mask"][i] > 0].tolist())
           for i in range(rows)]
    assert got[:6] == [(R1 + R2, [1.0] * 2 + [0.5] * 3), (R3, [-0.5] * 2), (R4, [1.0]),
                       *[([30, 31, 32], [-1.0] * 3)] * 3]
    assert all(not labels for labels, _ in got[6:])  # fillers
    assert (cat["weights"][6:] == 0).all() and (cat["advantages"][6:] == 0).all()


def test_interleaved_pipelines_get_a_multiple_of_pp_micro_batches(tmp_path):
    sample = episode_sample(_episode(tmp_path), 0, version=2, layer_ids=None)
    episodes = [sample, *(_one_branch(k, 0.0) for k in (1, 2, 3))]
    mbs = build_micro_batches(episodes, [0.0] * 4, seq_length=12, micro_batch_size=1, dp_rank=0, dp_size=1, pad_id=0,
                              loss_config=LossConfig(), micro_batch_multiple=4)
    assert len(mbs) == 8 and sum(float(mb["loss_mask"].sum()) for mb in mbs[6:]) == 0


def test_sequence_mean_counts_an_episode_once(tmp_path):
    sample = episode_sample(_episode(tmp_path), 0, version=2, layer_ids=None)
    mbs = build_micro_batches([sample, _one_branch(1, 0.0)], [1.0, -1.0], seq_length=12, micro_batch_size=1,
                              dp_rank=0, dp_size=1, pad_id=0, loss_config=LossConfig(aggregation="sequence_mean"))
    per_row = [float(mb["weights"].sum()) for mb in mbs]
    assert np.isclose(sum(per_row[:3]), 0.5) and np.isclose(per_row[3], 0.5)  # the 3-row episode weighs as one
    assert np.allclose(per_row[:3], [5 / 16, 2 / 16, 1 / 16])  # each of its 8 trained tokens alike


def test_per_turn_credit_of_a_multi_branch_episode_is_refused(tmp_path):
    sample = episode_sample(_episode(tmp_path), 0, version=2, layer_ids=None)
    with pytest.raises(ValueError, match="credit: turn"):
        training_rows([sample], [[1.0, 1.0]])
