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
