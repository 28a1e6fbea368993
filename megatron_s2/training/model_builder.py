"""Build the model (or this rank's pipeline stages) for a recipe and a layout."""

from __future__ import annotations

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.models.v41.model import V41Model
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.pipeline.payload import PayloadModes
from megatron_s2.pipeline.stage import PipelineRuntime, build_pipeline_model

__all__ = ["build_stage_model"]


def build_stage_model(recipe: RecipeConfig, layout: ParallelLayout, groups: ParallelGroups, rank: int,
                      token_map: list[int] | None = None) -> tuple[V41Model, PipelineRuntime | None]:
    """(the model of this rank's stages, its pipeline runtime or None without pipelining)."""
    pipeline = None
    if layout.pp == 1:
        model = V41Model(recipe.model, groups).init_weights(recipe.training.seed)
    else:
        modes = PayloadModes(recipe.parallel.payload_index_k, recipe.parallel.payload_candidates)
        model, pipeline = build_pipeline_model(recipe.model, layout, groups, rank, seed=recipe.training.seed,
                                               modes=modes)
    model.set_token_map(token_map)
    model.set_recompute(recipe.parallel.recompute)
    return model, pipeline
