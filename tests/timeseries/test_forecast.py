"""The forecasting branch (issue 24, Intern-S2 report §2.2.2): the horizon predictor reads the
walkthrough's instructions, the two Q-Formers give a constant number of slots, the forecaster is
causal, its values come back on the series' scale exactly through the encoder's retained mu /
sigma, and the phase's loss falls in the real trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.timeseries import TimeSeriesConfig
from megatron_s2.models.timeseries.encoder import normalise
from megatron_s2.models.timeseries.forecaster import ForecastBranch, ForecastRows
from megatron_s2.models.timeseries.horizon import HorizonError, number_words, parse_horizon, render_instruction
from tests.timeseries.test_lane import lane_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- horizon predictor -----------------------------------------------------------------------------
@pytest.mark.parametrize("instruction, rate, horizon", [
    ("forecast the next two seconds", 4.0, 8),          # the walkthrough's two phrasings
    ("predict 96 steps ahead", None, 96),
    ("Forecast the next twenty-four steps.", None, 24),
    ("predict the next one hundred and twenty values", None, 120),
    ("forecast 500 ms", 100.0, 50),
    ("over the next 3 minutes, at 2 Hz, forecast", None, None),   # a unit but no rate: refused
])
def test_horizon_predictor_reads_instructions(instruction, rate, horizon):
    if horizon is None:
        with pytest.raises(HorizonError, match="sampling rate"):
            parse_horizon(instruction, rate)
    else:
        assert parse_horizon(instruction, rate) == horizon


def test_horizon_predictor_is_exact_on_every_data_phrasing():
    for horizon in range(1, 400):
        for rate in (None, 1.0, 2.0, 4.0, 10.0):
            for style in range(5):
                assert parse_horizon(render_instruction(horizon, rate, style), rate) == horizon


@pytest.mark.parametrize("instruction", ["forecast the future", "predict 2.5 steps ahead", "forecast zero steps"])
def test_unreadable_horizons_are_refused_in_one_line(instruction):
    with pytest.raises(HorizonError) as err:
        parse_horizon(instruction, 1.0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("instruction, rate", [("forecast the next two seconds", 1e308),
                                               ("forecast the next 2 hours", 1e305),
                                               ("predict " + "9" * 400 + " steps ahead", None)])
def test_a_horizon_beyond_any_number_is_refused_not_an_overflow(instruction, rate):
    """review24: 1e308 Hz x two seconds is inf, and int(inf) was an OverflowError traceback in
    `generate --series`, tools/forecast.py and /v1/forecast; now a one-line HorizonError."""
    with pytest.raises(HorizonError, match="more steps than a number holds") as err:
        parse_horizon(instruction, rate)
    assert "\n" not in str(err.value)


def test_number_words_round_trip():
    for n in (1, 13, 40, 99, 101, 250, 1000, 1024, 9999):
        assert parse_horizon(f"forecast the next {number_words(n)} steps") == n


# ---- the branch ------------------------------------------------------------------------------------
CFG = TimeSeriesConfig(hidden=16, heads=2, forecast_queries=3, forecast_layers=2, forecast_context=12,
                       max_horizon=10, max_channels=4)


def _branch_and_rows(channels=(2, 3), steps=(20, 9)):
    torch.manual_seed(0)
    branch = ForecastBranch(CFG, backbone_hidden=24)
    values = [torch.randn(c, t) * 5 + 3 for c, t in zip(channels, steps)]
    stats = [normalise(v) for v in values]
    rows = ForecastRows.build(values, [s[1] for s in stats], [s[2] for s in stats], CFG.forecast_context, 1e-6)
    return branch, rows, values


@pytest.mark.parametrize("prompt", [5, 40])
def test_conditioning_is_2q_slots_whatever_the_prompt_length(prompt):
    branch, rows, _ = _branch_and_rows()
    cond = branch.condition(torch.randn(2, prompt, 24), torch.ones(2, prompt, dtype=torch.bool),
                            torch.randn(2, 7, 24), torch.ones(2, 7, dtype=torch.bool))
    assert cond.shape == (2, 2 * CFG.forecast_queries, CFG.hidden)


def test_shapes_and_causality_of_the_forecaster():
    branch, rows, _ = _branch_and_rows()
    assert rows.history.shape == (5, CFG.forecast_context) and rows.history_valid[2:].sum() == 3 * 9
    cond = torch.randn(2, 2 * CFG.forecast_queries, CFG.hidden)
    future = torch.randn(5, 6)
    predicted = branch.teacher_forced(cond, rows, future)
    assert predicted.shape == (5, 6)
    changed = future.clone()
    changed[:, 3:] += 10.0   # later truths must not reach earlier predictions
    torch.testing.assert_close(branch.teacher_forced(cond, rows, changed)[:, :4], predicted[:, :4])
    generated = branch.generate(cond, rows, horizon=6)
    assert generated.shape == (5, 6)
    # fed its own outputs, teacher forcing reproduces generation step by step
    torch.testing.assert_close(branch.teacher_forced(cond, rows, generated), generated, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="max_horizon"):
        branch.generate(cond, rows, horizon=CFG.max_horizon + 1)


def test_denormalisation_uses_the_encoders_retained_stats_exactly():
    branch, rows, values = _branch_and_rows()
    # the forecaster's history is the encoder's normalised series; de-normalised it is the raw tail
    torch.testing.assert_close(branch.denormalise(rows.history, rows)[:2], values[0][:, -CFG.forecast_context:],
                               rtol=0, atol=2e-5)
    normalised = torch.randn(5, 4)
    expected = normalised * (rows.sigma[:, None] + 1e-6) + rows.mu[:, None]
    assert torch.equal(branch.denormalise(normalised, rows), expected)
    assert torch.equal(rows.mu[:2], values[0].mean(dim=1)) and rows.sigma[0] > 1.0   # real scale, not unit


# ---- the phase ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    (["phase.kind=timeseries_forecast", "phase.forecast_lambda=0"], "phase.forecast_lambda"),
    (["phase.forecast_lambda_text=-1"], "phase.forecast_lambda"),
    (["phase.horizon_lambda=-0.5"], "phase.horizon_lambda"),
])
def test_bad_phase_settings_are_one_line(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        lane_recipe(tmp_path, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_forecast_phase_needs_series_data(tmp_path):
    from megatron_s2.training.run_checks import check_phase_layout

    with pytest.raises(ConfigError, match="data.kind: timeseries"):
        check_phase_layout(lane_recipe(tmp_path, ["phase.kind=timeseries_forecast", "data.kind=synthetic"]))


def test_horizon_beyond_the_forecaster_is_refused_naming_the_field(tmp_path):
    from megatron_s2.data.errors import DataError
    from tests.timeseries.test_lane import _iterator

    with pytest.raises(DataError, match="max_horizon"):
        _iterator(lane_recipe(tmp_path, ["data.series_horizon=40"]))


@pytest.mark.slow
def test_forecast_and_text_losses_fall_in_the_trainer(tmp_path):
    from megatron_s2.training.forecast_trainer import ForecastTrainer

    recipe = lane_recipe(tmp_path, ["phase.kind=timeseries_forecast", "data.num_documents=4", "training.train_steps=10",
                                    "schedule.decay_start_step=9", "schedule.decay_end_step=10"])
    result = ForecastTrainer(recipe, tmp_path / "run", log=lambda *a, **k: None).train()
    assert all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    forecast = [row["loss_forecast_raw"] for row in rows]
    text = [row["loss_text_raw"] for row in rows]
    assert len(forecast) == 10 and forecast[-1] < forecast[0] and text[-1] < text[0]
    # the trained run answers a request with numbers on the series' scale (tools/forecast.py)
    from tools.forecast import answer
    from megatron_s2.training.forecast_trainer import load_trained_forecaster

    trained = load_trained_forecaster(tmp_path / "run")
    steps = torch.arange(60.0)
    series = [(100 + 5 * torch.sin(steps / 4)).tolist(), (-3 + torch.cos(steps / 4)).tolist()]
    response = answer(trained, {"instruction": "forecast the next two seconds", "sample_rate": 4, "series": series})
    assert response["horizon"] == 8 and [len(c) for c in response["forecast"]] == [8, 8]
    # a run without the learned horizon predictor (as before it existed) answers with the parser
    assert trained.model.forecaster.horizon is None and response["horizon_parsed"] == 8
    with pytest.raises(HorizonError, match="cannot read a horizon"):
        answer(trained, {"instruction": "what comes next?", "series": series})
    assert all(80 < v < 120 for v in response["forecast"][0]) and all(-10 < v < 4 for v in response["forecast"][1])
    with pytest.raises(ValueError, match="max_horizon"):
        answer(trained, {"instruction": "predict 500 steps ahead", "series": series})
    # the engine's loader (generate / serve) takes the checkpoint with its branch, not refusing it
    from megatron_s2.inference.weights import load_model

    served, _, _ = load_model(str(tmp_path / "run"), device="cpu")
    for name, value in trained.model.forecaster.state_dict().items():
        assert torch.equal(served.forecaster.state_dict()[name], value), name
    with pytest.raises(ValueError, match="--allow-files"):
        answer(trained, {"instruction": "predict 4 steps ahead", "path": "x.csv"})


@pytest.mark.parametrize("extra, needle", [
    ({"sample_rate": "abc"}, "request.sample_rate"),
    ({"sample_rate": -4}, "request.sample_rate"),
    ({"sample_rate": float("nan")}, "request.sample_rate"),
    ({"sample_rate": True}, "request.sample_rate"),
    ({"path": 5}, "request.path"),
    ({"horizn": 3}, "request.horizn: unknown field"),   # a typo was ignored: the predictor's horizon answered (review57)
    ({"sample-rate": 4}, "request.sample-rate: unknown field"),
])
def test_forecast_request_fields_of_the_wrong_kind_are_one_line(extra, needle):
    """tools/forecast.py exits 2 with one line on these (a TypeError traceback before, or a
    negative rate answered with "needs the series' sampling rate; give it"); checked before the
    model is touched, so no trained run is needed here."""
    from tools.forecast import answer

    request = {"instruction": "forecast the next two seconds", "series": [1.0, 2.0, 3.0, 4.0], **extra}
    with pytest.raises(ValueError, match=needle) as info:
        answer(None, request, allow_files=True)
    assert "\n" not in str(info.value)


def _forecast_rank(rank: int, world: int, recipe_path: str, run_dir: str, overrides: list) -> None:
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.training.forecast_trainer import ForecastTrainer

    recipe = load_recipe(recipe_path, overrides)
    ForecastTrainer(recipe, Path(run_dir), rank=rank, world_size=world, log=lambda *a, **k: None).train()


@pytest.mark.slow
def test_data_parallel_forecast_phase_matches_one_rank(tmp_path):
    """DP2 against one rank on the same seed: the global batch is split, the step is the same."""
    from tests.parallel.spawn import run_distributed

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "timeseries_forecast_tiny.yaml"
    base = ["training.train_steps=3", "data.num_documents=64", "checkpoint.save_interval=0"]
    _forecast_rank(0, 1, str(recipe), str(tmp_path / "dp1"), base)
    run_distributed(2, _forecast_rank, str(recipe), str(tmp_path / "dp2"), [*base, "parallel.dp=2"])
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("dp1", "dp2"))
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "loss_forecast_raw", "loss_text_raw", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
