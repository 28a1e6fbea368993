"""Where a post-training rank's rollout engine runs (report §5.2.1): on the training model itself,
or on a second copy with its own inference layout.

The inference engine runs without pipeline, context or sequence parallelism; a training layout
that uses none of them shares its model with the engine (``rollout.engine.share_weights: auto``),
otherwise the engine gets a copy laid out ``tp`` x ``rollout_ep`` (x ``rollout_engram_parallel``)
over the same ranks, refreshed by :class:`~megatron_s2.posttrain.rollout.weights.WeightTransfer`
after each optimiser step. Pure: used by the trainer and by ``megatron-s2 plan memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["RolloutPlacement", "rollout_placement"]


@dataclass(frozen=True)
class RolloutPlacement:
    shared: bool
    """The engine runs the training model (no transfer)."""
    layout: ParallelLayout
    """The rollout model's layout (the training layout when shared)."""
    reason: str
    """Why (for the log)."""


def rollout_placement(recipe, train_layout: ParallelLayout, world_size: int) -> RolloutPlacement:
    engine = (recipe.rl or recipe.opd).rollout.engine
    p = recipe.parallel
    needs_copy = [why for why, bad in (("pp > 1", p.pp > 1), ("cp > 1", p.cp > 1),
                                       ("sequence parallelism", p.sequence_parallel)) if bad]
    if not needs_copy and engine.share_weights == "auto":
        return RolloutPlacement(True, train_layout, "the engine runs the training model (tp/ep/dp layout)")
    cfg = ParallelConfig(tp=p.tp, ep=engine.rollout_ep, etp=1, backend=p.backend,
                         engram_parallel=engine.rollout_engram_parallel or p.engram_parallel)
    try:
        layout = ParallelLayout.build(cfg, recipe.model, world_size)
    except ConfigError as exc:
        raise ConfigError(f"{recipe.phase.kind}.rollout.engine: the rollout layout (tp={cfg.tp}, ep={cfg.ep}, "
                          f"engram_parallel={cfg.engram_parallel}, pp = cp = 1 on {world_size} ranks) is invalid: "
                          f"{exc}; adjust rollout_ep / rollout_engram_parallel") from None
    why = ", ".join(needs_copy) if needs_copy else "rollout.engine.share_weights: never"
    return RolloutPlacement(False, layout, f"rollout model {layout.describe()} with weights transferred ({why})")
