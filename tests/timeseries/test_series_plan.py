"""`plan memory` of the time-series forecasting phase (Intern-S2 report §2.2; issue 24) counts the
series lane where the ranks hold it (megatron_s2/planning/series_lane.py): the encoder on the first
stage (``timeseries.*``, beside the embedding), the forecaster on the last (trained: gradients and
optimiser state), and under pp the last stage's encoder replica (parameters and gradients, no
optimiser state) — each equal to the bytes of the module the runtime builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.planning.memory import estimate_memory

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "timeseries_forecast_tiny.yaml"


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _built_stage(recipe, layout, rank: int):
    """The family model ``rank`` builds, in its precision map."""
    from megatron_s2.models.family import family_of
    from megatron_s2.parallel.offline_groups import layout_groups, stage_model_kwargs

    model = family_of(recipe.model).build_model(recipe.model, layout_groups(layout, rank),
                                                **stage_model_kwargs(layout, rank))
    model.apply_precision_map()
    return model


def test_the_series_lane_is_counted_on_the_stages_that_hold_it():
    from megatron_s2.models.timeseries.attach import build_series_encoder
    from megatron_s2.models.timeseries.forecaster import ForecastBranch

    recipe = load_recipe(RECIPE, ["parallel.pp=2", "parallel.dp=1"])
    plan = estimate_memory(recipe, 2)
    first, last = plan.ranks
    encoder = _built_stage(recipe, plan.layout, first.rank).timeseries
    assert first.state.parameters["series encoder"] == _bytes(encoder)
    assert "forecaster" not in first.state.parameters and "series encoder replica" not in first.state.parameters
    assert _built_stage(recipe, plan.layout, last.rank).timeseries is None
    assert "series encoder" not in last.state.parameters
    assert last.state.parameters["forecaster"] == _bytes(ForecastBranch(recipe.model.timeseries, recipe.model.hidden_size))
    assert last.state.parameters["series encoder replica"] == _bytes(build_series_encoder(recipe.model))
    # every parameter of both stages has a gradient, the replica's included (summed into the owner's)
    assert first.state.gradients == first.state.parameter_bytes and last.state.gradients == last.state.parameter_bytes


def test_the_forecaster_has_optimiser_state_and_the_replica_none():
    from megatron_s2.planning.model_state import model_state_bytes

    recipe = load_recipe(RECIPE, ["parallel.pp=2", "parallel.dp=1"])
    plan = estimate_memory(recipe, 2)
    last = plan.ranks[1]
    text_only = model_state_bytes(recipe.model, plan.layout, last.rank, recipe.optimizer, parallel=recipe.parallel,
                                  zero1_worst=True)
    added = last.state.optimizer_bytes - text_only.optimizer_bytes
    forecaster = last.state.parameters["forecaster"]
    assert forecaster <= added <= 2 * forecaster + 4 * 1000   # one (Muon) or two (AdamW) moments, no replica state


@pytest.mark.parametrize("pp", [1, 2])
def test_one_stage_holds_the_encoder_and_the_forecaster_without_a_replica(pp):
    recipe = load_recipe(RECIPE, [f"parallel.pp={pp}", "parallel.dp=1"])
    ranks = estimate_memory(recipe, pp).ranks
    holders = [r for r in ranks if "series encoder replica" in r.state.parameters]
    assert len(holders) == (pp > 1) and sum("forecaster" in r.state.parameters for r in ranks) == 1
