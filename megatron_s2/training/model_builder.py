"""Build the model of this rank (or its pipeline stages) for a recipe and a layout, through the
recipe's model family (:func:`megatron_s2.models.family.family_of`)."""

from __future__ import annotations

import torch

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.models.family import family_of
from megatron_s2.models.family.skeleton import SkeletonMode, materialize
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.pipeline.runtime import PipelineRuntime

__all__ = ["build_stage_model", "stage_kwargs"]


def stage_kwargs(layout: ParallelLayout, pp_rank: int) -> dict:
    """``layers`` / ``pre_process`` / ``post_process`` of the model object of pipeline rank
    ``pp_rank``: the union of its (virtual) stages (empty without pipelining)."""
    if layout.pp == 1:
        return {}
    stages = layout.stages_of_rank(pp_rank)
    return {"layers": [layer for s in stages for layer in layout.stage_layers[s]],
            "pre_process": 0 in stages, "post_process": len(layout.stage_layers) - 1 in stages}


def build_stage_model(recipe: RecipeConfig, layout: ParallelLayout, groups: ParallelGroups, rank: int,
                      token_map: list[int] | None = None, *, device: torch.device | None = None, plan_memory=None):
    """(the model of this rank's stages on ``device`` (default: the current default device),
    initialised from ``training.seed``; its pipeline runtime, or None without pipelining). The
    model itself knows nothing of the pipeline.

    The model is constructed once: on the meta device first, where ``plan_memory(model)`` (the
    trainer's start-up memory check) counts it before any storage exists, then given real
    storage in place and initialised."""
    family = family_of(recipe.model)
    pp_rank = layout.coords(rank)["pp"]
    with SkeletonMode():
        model = family.build_model(recipe.model, groups, **stage_kwargs(layout, pp_rank))
    if plan_memory is not None:
        plan_memory(model)
    device = torch.device(device) if device is not None else torch.get_default_device()
    materialize(model, device).init_weights(recipe.training.seed)
    model.set_token_map(token_map)
    model.set_recompute(recipe.parallel.recompute)
    if layout.pp == 1:
        return model, None
    payloads = family.stage_payloads(model, layout, groups, pp_rank, recipe.parallel)
    return model, PipelineRuntime(model, layout, groups, pp_rank, payloads)
