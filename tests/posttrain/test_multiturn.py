"""Multi-turn sessions as one training sample (token-in/token-out), and micro-batch assembly."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.posttrain.batch import collate
from megatron_s2.posttrain.multiturn import SessionBuilder, TokenMismatch
from tests.posttrain.sim_engine import routing_for

SYSTEM = [1, 2, 3, 4]
TURN1 = [10, 11, 12]
TOOL = [90, 91]  # tool observation: environment tokens
TURN2 = [20, 21]


def _record(tokens, start, version):
    return routing_for(range(start, len(tokens) - 1), tokens, version)


def two_turn_session(second_routing_from_zero=False, weights=(1.0, 1.0)):
    s = SessionBuilder(sample_id=7)
    ctx1 = SYSTEM
    s.add_model_call(ctx1, TURN1, [-0.1, -0.2, -0.3], 0, routing=_record(ctx1 + TURN1, 0, 0),
                     process_weight=weights[0])
    ctx2 = SYSTEM + TURN1 + TOOL
    full = ctx2 + TURN2
    start = 0 if second_routing_from_zero else len(SYSTEM + TURN1) - 1  # persisted KV: last token + delta
    s.add_model_call(ctx2, TURN2, [-0.5, -0.6], [1, 2], routing=_record(full, start, 1),
                     process_weight=weights[1])
    return s.build(reward=1.0)


def test_session_is_one_sample_with_environment_tokens_masked():
    (sample,) = two_turn_session()
    assert sample.tokens == SYSTEM + TURN1 + TOOL + TURN2  # exactly the ids the engine saw and produced
    assert sample.policy_mask == [False] * 4 + [True] * 3 + [False] * 2 + [True] * 2
    assert sample.versions == [-1] * 4 + [0] * 3 + [-1] * 2 + [1, 2]
    assert sample.logprobs[4:7] == [-0.1, -0.2, -0.3] and sample.logprobs[7:9] == [0.0, 0.0]
    assert sample.spans == [(4, 7), (9, 11)] and sample.prompt_length == 4 and sample.reward == 1.0
    rec = sample.routing
    assert rec.start == 0 and len(rec) == len(sample.tokens) - 1
    # positions 0..5 routed in call 1; 6 (the last turn-1 token), the tool tokens and turn 2's first token in call 2
    assert rec.versions.tolist() == [0] * 6 + [1] * 4


def test_engine_rerouting_the_whole_context_is_cut_to_new_positions():
    (a,) = two_turn_session()
    (b,) = two_turn_session(second_routing_from_zero=True)
    assert b.routing.versions.tolist() == a.routing.versions.tolist()
    for layer in a.routing.layer_ids:
        assert torch.equal(a.routing.layers[layer], b.routing.layers[layer])  # the first routing of a position wins


def test_token_mismatch_is_an_error_or_a_split():
    s = SessionBuilder(sample_id=1)
    s.add_model_call(SYSTEM, TURN1, [-0.1] * 3, 0)
    retokenised = SYSTEM + [10, 1112] + TOOL  # the harness re-encoded "10 11 12" differently
    with pytest.raises(TokenMismatch, match="differ from the session's ids at position 5"):
        s.add_model_call(retokenised, TURN2, [-0.5, -0.6], 1)
    split = SessionBuilder(sample_id=1, on_mismatch="split")
    split.add_model_call(SYSTEM, TURN1, [-0.1] * 3, 0)
    split.add_model_call(retokenised, TURN2, [-0.5, -0.6], 1)
    first, second = split.build(reward=0.0)
    assert first.tokens == SYSTEM + TURN1 and second.tokens == retokenised + TURN2
    assert second.policy_mask == [False] * len(retokenised) + [True] * 2 and first.reward == second.reward == 0.0


def test_routing_gaps_and_short_records_are_errors():
    s = SessionBuilder(sample_id=2)
    s.add_model_call(SYSTEM, TURN1, [-0.1] * 3, 0, routing=_record(SYSTEM + TURN1, 0, 0))
    ctx2 = SYSTEM + TURN1 + TOOL
    with pytest.raises(ValueError, match="never routed"):
        s.add_model_call(ctx2, TURN2, [-0.5, -0.6], 1, routing=_record(ctx2 + TURN2, 8, 1))
    s2 = SessionBuilder(sample_id=3)
    with pytest.raises(ValueError, match="ends at"):
        s2.add_model_call(SYSTEM, TURN1, [-0.1] * 3, 0, routing=routing_for(range(0, 3), SYSTEM + TURN1, 0))


def test_collate_shifts_masks_and_applies_session_credit_eq_30():
    (sample,) = two_turn_session(weights=(1.0, -0.5))
    batch = collate([sample], [0.8], seq_length=12)
    n = len(sample.tokens) - 1
    assert batch.tokens[0, :n].tolist() == sample.tokens[:-1] and batch.labels[0, :n].tolist() == sample.tokens[1:]
    assert batch.loss_mask[0].tolist() == sample.policy_mask[1:] + [False] * (12 - n)
    # labels of turn 1 carry +0.8, of turn 2 -0.4 (w = -0.5, A > 0); tool and system labels 0
    assert batch.advantages[0, :n].tolist() == pytest.approx([0, 0, 0, 0.8, 0.8, 0.8, 0, 0, -0.4, -0.4])
    assert batch.versions[0, :n].tolist() == sample.versions[1:] and batch.sequence_ids[0, n:].eq(-1).all()
    failed = collate([sample], [-0.6], seq_length=12)
    assert failed.advantages[0, :n].tolist() == pytest.approx([0, 0, 0, -0.6, -0.6, -0.6, 0, 0, -0.6, -0.6])
    assert batch.routing is not None and batch.routing.records()[1][0].shape == (1, 12, 2)
    with pytest.raises(ValueError, match="more than seq_length"):
        collate([sample], [0.8], seq_length=5)
