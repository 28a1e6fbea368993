"""Sampling parameters at the edges of their ranges: a positive temperature so small that
``logits / temperature`` overflows, or a nucleus so small it keeps one token, is a valid
request (the server accepts it) and must give a proper distribution — not NaNs that kill the
engine for every client."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.inference.sampling import SamplingParams, sample_next, sampling_log_probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-300),
    SamplingParams(temperature=5e-324),
    SamplingParams(temperature=1e-45, top_p=0.5),
    SamplingParams(temperature=1e-300, top_k=3),
    SamplingParams(top_p=1e-300),
    SamplingParams(temperature=1e300),
])
def test_extreme_but_valid_parameters_give_a_distribution(params):
    logits = torch.tensor([3.0, 2.0, 2.5, -1.0, float("-inf")])
    logp = sampling_log_probs(logits, params)
    assert not torch.isnan(logp).any()
    assert math.isclose(float(logp.exp().sum()), 1.0, rel_tol=1e-5)
    tok = sample_next(logits, params, torch.Generator().manual_seed(0))
    assert math.isfinite(tok.logprob) and tok.token_id != 4
    if params.temperature < 1e-30 or params.top_p < 1e-30:  # a point mass on the arg-max
        assert tok.token_id == 0 and tok.logprob == 0.0


def test_a_tiny_temperature_keeps_ties_at_the_maximum():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    logp = sampling_log_probs(logits, SamplingParams(temperature=1e-300))
    assert torch.allclose(logp.exp(), torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("greedy", [False, True])
def test_logprobs_modes_report_vllms_four_kinds_of_value(greedy):
    """vLLM's ``logprobs_mode``: raw = the model's values, before temperature / top-k / top-p;
    processed = those the token is drawn from (-inf outside the kept set). The sampled token is
    the same in every mode; only what is reported differs."""
    logits = torch.tensor([3.0, 2.0, 2.5, -1.0, 0.5])
    temperature = 0.0 if greedy else 0.7
    processed = (logits / (temperature or 1.0)).masked_fill(torch.tensor([False, True, False, True, True])
                                                            if not greedy else torch.zeros(5, dtype=torch.bool),
                                                            float("-inf"))
    expected = {"raw_logprobs": torch.log_softmax(logits, -1), "raw_logits": logits,
                "processed_logprobs": torch.log_softmax(processed, -1), "processed_logits": processed}
    tokens = set()
    for mode, values in expected.items():
        params = SamplingParams(temperature=temperature, top_k=2, logprobs=2, logprobs_mode=mode, seed=3)
        tok = sample_next(logits, params, torch.Generator().manual_seed(3))
        tokens.add(tok.token_id)
        assert math.isclose(tok.logprob, float(values[tok.token_id]), rel_tol=1e-6), mode
        assert [t for t, _ in tok.top_logprobs] == [0, 2], mode
        assert all(math.isclose(v, float(values[t]), rel_tol=1e-6) for t, v in tok.top_logprobs), mode
    assert len(tokens) == 1


def test_an_unknown_logprobs_mode_is_refused():
    with pytest.raises(Exception, match="logprobs_mode: must be one of raw_logprobs"):
        SamplingParams(logprobs_mode="raw")


def test_logprob_token_ids_report_a_fixed_label_set_in_order():
    logits = torch.tensor([3.0, 2.0, 2.5, -1.0, 0.5])
    params = SamplingParams(temperature=0, logprob_token_ids=(4, 1), logprobs_mode="raw_logprobs")
    tok = sample_next(logits, params, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, -1)
    assert [t for t, _ in tok.top_logprobs] == [4, 1]
    assert all(math.isclose(v, float(expected[t]), rel_tol=1e-6) for t, v in tok.top_logprobs)


def test_an_episode_call_seed_is_not_another_held_out_episode_s_seed():
    """Call c of held-out episode ``key`` (seeded ``episode_seed(key)``) must not draw episode
    ``key + c``'s random numbers, as ``seed + stride * c`` with the evaluation's own stride did;
    an episode's first call keeps its seed (single-call episodes sample as before)."""
    from megatron_s2.inference.sampling import call_seed
    from megatron_s2.posttrain.rollout.evaluation import episode_seed

    keys, calls = range(64), range(1, 10)
    firsts = {episode_seed(k) for k in keys}
    assert all(call_seed(episode_seed(k), 0) == episode_seed(k) for k in keys)
    later = [call_seed(episode_seed(k), c) for k in keys for c in calls]
    assert not firsts & set(later) and len(set(later)) == len(later)
    assert all(0 <= s < 2 ** 63 for s in later)
