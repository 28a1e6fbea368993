"""The time-series encoder (report §2.2.1; walkthrough Ch. 1): shapes, the mean-pooling
counter-example, retained statistics, mixed batches and linear cost in T."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_s2.models.timeseries.encoder import (SeriesInput, TimeSeriesEncoder, TimeSeriesEncoderConfig,
                                                   denormalise, normalise)


def _encoder(**overrides) -> TimeSeriesEncoder:
    torch.manual_seed(0)
    fields = dict(output_hidden=48, hidden=32, heads=4, token_budget=64, queries_per_patch=4,
                  patches_per_chunk=4, temporal_layers=1)
    return TimeSeriesEncoder(TimeSeriesEncoderConfig(**{**fields, **overrides})).eval()


def test_token_count_follows_the_plan_and_the_backbone_width():
    enc = _encoder()
    out = enc([SeriesInput(torch.randn(3, 1000), sample_rate=250.0)])
    plan = out.plans[0]
    assert (plan.patch_length, plan.num_patches, plan.num_tokens) == (63, 16, 64)   # ceil(1000 / 16)
    assert out.tokens.shape == (1, 64, 48)
    assert out.token_mask.all()
    assert torch.isfinite(out.tokens).all()


def test_mixed_lengths_rates_and_channels_in_one_batch():
    """Each series gets its own L; tokens are padded to the longest and masked; padding never
    changes a series' own tokens (its result equals encoding it alone)."""
    enc = _encoder()
    batch = [SeriesInput(torch.randn(2, 5000), 100.0), SeriesInput(torch.randn(5, 37), 1e6),
             SeriesInput(torch.randn(1, 64), None)]
    out = enc(batch)
    assert [p.patch_length for p in out.plans] == [313, 3, 4]
    assert [p.num_tokens for p in out.plans] == [64, 52, 64]
    assert out.tokens.shape == (3, 64, 48)
    assert out.token_mask.sum(1).tolist() == [64, 52, 64]
    alone = enc([batch[1]])
    torch.testing.assert_close(out.tokens[1, :52], alone.tokens[0], atol=1e-5, rtol=1e-5)
    assert [m.shape for m in out.mu] == [(2, 1), (5, 1), (1, 1)]


def test_sampling_rate_is_seen():
    enc = _encoder()
    x = torch.randn(2, 500)
    slow, fast = enc([SeriesInput(x, 1.0)]), enc([SeriesInput(x, 1e6)])
    assert not torch.allclose(slow.tokens, fast.tokens)


def test_mean_pooling_counter_example_is_told_apart():
    """Walkthrough, Worked example 2: "Take three EEG channels at one time patch, with a feature
    that is positive when the channel leads and negative when it lags ... Three physically
    distinct states, one identical pooled vector." Front-to-back propagation (+1, 0, -1),
    back-to-front (-1, 0, +1) and a centre focus (-1/2, +1, -1/2): mean pooling across channels
    (S1-Pro) maps all three to the zero vector; the channel-wise path maps them apart."""
    enc = _encoder()
    torch.manual_seed(1)
    direction = torch.randn(32)
    states = torch.tensor([[1.0, 0.0, -1.0], [-1.0, 0.0, 1.0], [-0.5, 1.0, -0.5]])
    z = states[:, :, None, None] * direction                   # [3 states, 3 channels, 1 patch, D]
    pooled = z.mean(dim=1)
    assert torch.equal(pooled[0], pooled[1]) and torch.equal(pooled[1], pooled[2])
    with torch.no_grad():
        merged = enc.channel_path(z, torch.ones(3, 3, dtype=torch.bool))[:, 0]
    scale = merged.norm(dim=-1).mean()
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert (merged[a] - merged[b]).norm() > 0.05 * scale, (a, b)   # measured 0.15-0.23 x scale
    # why the channel-index embedding: attention alone is permutation-equivariant, so the two
    # mirror-image propagations (a channel permutation of each other) would merge to one vector
    with torch.no_grad():
        enc.channel_index.weight.zero_()
        blind = enc.channel_path(z, torch.ones(3, 3, dtype=torch.bool))[:, 0]
    torch.testing.assert_close(blind[0], blind[1], atol=1e-5, rtol=1e-5)


def test_retained_statistics_round_trip():
    """The forecaster's ``* sigma + mu``: normalising and de-normalising gives the series back,
    and the encoder returns the same (mu, sigma)."""
    torch.manual_seed(2)
    x = 3.0 + 40.0 * torch.randn(4, 777, dtype=torch.float64)
    x[2] = 5.0                                                  # a constant channel stays finite
    xn, mu, sigma = normalise(x)
    assert torch.isfinite(xn).all()
    torch.testing.assert_close(denormalise(xn, mu, sigma), x)
    out = _encoder()([SeriesInput(x.float())])
    torch.testing.assert_close(out.mu[0], mu.float())
    torch.testing.assert_close(out.sigma[0], sigma.float())


def test_gradients_reach_every_stage():
    enc = _encoder().train()
    out = enc([SeriesInput(torch.randn(3, 400), 10.0), SeriesInput(torch.randn(2, 90), 5.0)])
    (out.tokens * out.token_mask[..., None]).square().mean().backward()
    for name in ("embedder.conv_in.weight", "qformer.queries", "channel_index.weight", "channel_query",
                 "temporal_blocks.0.attn.q.weight", "to_backbone.weight", "rate.weight"):
        grad = enc.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    unused = [name for name, param in enc.named_parameters() if param.grad is None]
    assert unused == []                # no parameter sits out (DDP would need find_unused_parameters)


def _measure(enc, length):
    x = torch.randn(2, length)
    start = time.perf_counter()
    with torch.no_grad():
        enc([SeriesInput(x, 100.0)])
    return time.perf_counter() - start


def test_time_grows_linearly_in_length():
    """A small measured check (the bench prints more): 8x the steps costs well under 8x**2 time
    and at most ~3x the linear extrapolation (budget fixed, so only Stages 1-2 grow)."""
    torch.set_num_threads(1)
    enc = _encoder(token_budget=256, patches_per_chunk=16)
    _measure(enc, 4_000)                                         # warm-up
    short = min(_measure(enc, 8_000) for _ in range(3))
    long = min(_measure(enc, 64_000) for _ in range(3))
    assert long / short < 3 * 8, (short, long)


def _saved_bytes(enc, length) -> int:
    """Bytes autograd keeps for the backward of one forward (the training activation memory)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        enc([SeriesInput(torch.randn(2, length), 100.0)])
    return total


def test_activation_memory_grows_linearly_in_length():
    """Measured exactly (saved tensors): 8x the steps keeps at most ~8x the activation bytes, and
    more than half of it (the budget-bounded Transformers are the fixed part)."""
    enc = _encoder(token_budget=256, chunk_samples=4096)
    short, long = _saved_bytes(enc, 8_000), _saved_bytes(enc, 64_000)
    assert 4 * short < long <= 8 * 1.05 * short, (short, long)


@pytest.mark.parametrize("field,value,message", [
    ("heads", 5, "must divide timeseries.hidden"), ("cnn_kernel", 4, "must be odd"),
    ("token_budget", 2, "raise the budget"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        TimeSeriesEncoderConfig(output_hidden=8, hidden=32, **{field: value})


def test_too_many_channels_is_refused():
    with pytest.raises(ValueError, match="raise it"):
        _encoder(max_channels=2)([SeriesInput(torch.randn(3, 10))])


@pytest.mark.parametrize("rate", [0.0, -5.0, float("nan")])
def test_sampling_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match="sample_rate must be a positive number of Hz"):
        SeriesInput(torch.zeros(1, 4), rate)


@pytest.mark.parametrize("rate", [1e-310, 5e-324])
def test_a_subnormal_sampling_rate_is_refused_not_a_nan_forecast(rate):
    """review24: tools/forecast.py with "sample_rate": 1e-310 answered horizon 1 and NaN values
    (log10 of the patch duration L / rate = inf); now a one-line ValueError."""
    with pytest.raises(ValueError, match="below 2.23e-308") as err:
        SeriesInput(torch.zeros(1, 8), rate)
    assert "\n" not in str(err.value)
    assert SeriesInput(torch.zeros(1, 8), 1e-300).sample_rate == 1e-300
