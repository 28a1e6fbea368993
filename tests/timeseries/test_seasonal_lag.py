"""The forecaster's seasonal lag (Autoformer-style period discovery from the history's
autocorrelation; Intern-S2 §2.2.2 forecaster): it finds the generator's period without being told,
falls back to the naive lag on a series without a cycle, and the forecaster starts near the
seasonal candidate."""

from __future__ import annotations

import numpy as np
import torch

from megatron_s2.data.timeseries import procedural_series
from megatron_s2.models.timeseries.forecaster import CausalForecaster, seasonal_lag


def _left_padded(values: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(values, dtype=torch.float32)
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    pad = width - x.size(1)
    return torch.nn.functional.pad(x, (pad, 0)), (torch.arange(width) >= pad).expand(x.size(0), -1)


def test_lag_finds_the_generators_period_on_most_series():
    found = total = 0
    for index in range(40):
        series = procedural_series(11, index, channels=3, length=128, horizon=8, noise=0.1)
        history, valid = _left_padded(series.values, 128)
        for lag in seasonal_lag(history, valid).tolist():
            total += 1
            found += abs(lag - series.period) <= 1
    assert found / total > 0.8, (found, total)


def test_left_padding_does_not_change_the_lag():
    series = procedural_series(3, 0, channels=2, length=100, horizon=8, noise=0.05)
    a = seasonal_lag(*_left_padded(series.values, 100))
    b = seasonal_lag(*_left_padded(series.values, 128))
    assert torch.equal(a, b)


def test_no_cycle_means_the_naive_lag():
    ramp = np.linspace(0.0, 1.0, 64)[None]                 # no cycle: autocorrelation never turns negative
    assert seasonal_lag(*_left_padded(ramp, 64)).tolist() == [1]
    short = np.sin(np.arange(6))[None]                     # too short for any lag with 8 overlapping steps
    assert seasonal_lag(*_left_padded(short, 32)).tolist() == [1]


def test_forecaster_starts_near_the_seasonal_candidate():
    torch.manual_seed(0)
    model = CausalForecaster(hidden=16, heads=2, layers=1, positions=64, channels=2)
    with torch.no_grad():
        model.value_head.weight.zero_()                    # no correction: the gate alone decides
    values = torch.randn(2, 40)
    out = model(values, torch.ones(2, 40, dtype=torch.bool), torch.tensor([0, 1]), torch.randn(2, 4, 16),
                torch.tensor([10, 10]))
    seasonal = values[:, 40 + 1 - 10 - 1]                  # position 39 reads values[39 + 1 - 10]
    gate = torch.sigmoid(torch.tensor(2.0))
    assert torch.allclose(out[:, -1], gate * seasonal + (1 - gate) * values[:, -1], atol=1e-6)
