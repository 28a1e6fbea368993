"""A verifiers trace branch -> one training sample (megatron_s2/posttrain/rollout/vf_trace.py):
a two-turn session keeps exactly its token ids, masks the environment's tokens between and after
the assistant turns, keeps the engine's log-probs on sampled tokens only, and turns the per-token
routed experts (last row a placeholder) into the R3 record of every fed position; collated, the
loss mask covers exactly the assistant turns' labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_s2.posttrain.batch import collate
from megatron_s2.posttrain.rollout.vf_trace import branch_sample, sampled_spans

LAYERS = [4, 5, 6]
TOPK = 2
#         system/user prompt | turn 1 (sampled) | user follow-up | turn 2 (sampled) | trailing tool output
IDS = [1, 7, 8, 9] + [20, 21, 2] + [3, 30, 31] + [22, 2] + [40, 41]
MASK = [False] * 4 + [True] * 3 + [False] * 3 + [True] * 2 + [False] * 2
LOGPROBS = [0.0] * 4 + [-0.5, -1.25, -0.125] + [0.0] * 3 + [-2.0, -0.25] + [0.0] * 2


def _routed(n: int) -> np.ndarray:
    rows = np.arange(n * len(LAYERS) * TOPK, dtype=np.int16).reshape(n, len(LAYERS), TOPK) % 8
    rows[3, 2] = -1  # a decoder layer the engine skipped (bounded replay)
    return rows


def test_two_turn_branch_becomes_one_sample_with_environment_tokens_masked():
    routed = _routed(len(IDS))
    s = branch_sample(5, IDS, MASK, LOGPROBS, routed, version=3, layer_ids=LAYERS, reward=0.75)
    end = 12  # trailing environment tokens carry no loss: dropped
    assert s.tokens == IDS[:end] and s.policy_mask == MASK[:end]
    assert s.spans == [(4, 7), (10, 12)] and s.prompt_length == 4 and s.process_weights == [1.0, 1.0]
    assert s.logprobs == LOGPROBS[:end]
    assert s.versions == [-1] * 4 + [3] * 3 + [-1] * 3 + [3] * 2
    assert s.reward == 0.75 and s.num_generated == 5 and s.finish_reason == "stop"
    rec = s.routing
    assert (rec.start, rec.end) == (0, end - 1)  # every fed position; the last token was never fed
    assert torch.equal(rec.versions, torch.full((end - 1,), 3, dtype=torch.int32))
    for i, layer in enumerate(LAYERS):
        want = torch.from_numpy(routed[:end - 1, i].astype(np.int32))
        if i == 2:
            want[3] = torch.arange(TOPK, dtype=torch.int32)  # -1 -> any valid ids (a dead end in training)
        assert torch.equal(rec.layers[layer], want)
    batch = collate([s], [1.0], seq_length=16)
    assert batch.loss_mask[0, :end - 1].tolist() == MASK[1:end]  # label j+1 bears loss iff it was sampled
    assert batch.tokens[0, :end - 1].tolist() == IDS[:end - 1] and batch.labels[0, :end - 1].tolist() == IDS[1:end]
    assert batch.behaviour_logprobs[0, :end - 1].tolist() == LOGPROBS[1:end]
    assert batch.advantages[0, :end - 1].tolist() == [1.0 if m else 0.0 for m in MASK[1:end]]


def test_branch_without_routing_when_r3_is_off():
    s = branch_sample(0, IDS, MASK, LOGPROBS, None, version=0, layer_ids=None)
    assert s.routing is None and s.spans == [(4, 7), (10, 12)]


@pytest.mark.parametrize("case, message", [
    ("no_sampled", "no sampled tokens"),
    ("no_routing", "no routed experts"),
    ("bad_logprob", "log-probability"),
    ("short_routing", "do not cover"),
    ("lengths", "mask entries"),
])
def test_malformed_traces_are_refused(case, message):
    ids, mask, lps, routed = list(IDS), list(MASK), list(LOGPROBS), _routed(len(IDS))
    if case == "no_sampled":
        mask = [False] * len(ids)
    elif case == "no_routing":
        routed = None
    elif case == "bad_logprob":
        lps[5] = float("nan")
    elif case == "short_routing":
        routed = routed[:5]
    else:
        mask = mask[:-1]
    with pytest.raises(ValueError, match=message):
        branch_sample(1, ids, mask, lps, routed, version=0, layer_ids=LAYERS)


def test_sampled_spans():
    assert sampled_spans([]) == []
    assert sampled_spans([True, True, False, True]) == [(0, 2), (3, 4)]
    assert sampled_spans([False, False]) == []
