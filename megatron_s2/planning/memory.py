"""Per-rank memory plan of a recipe: model state, activations, pipeline buffers, Engram.

``estimate_memory(recipe, world_size)`` evaluates every pipeline stage on the layout the
runtime would build (:meth:`ParallelLayout.from_recipe`) and
reports the most loaded one:

* parameters, gradients, optimiser state — counted on the rank's model skeleton
  (:mod:`.model_state`; exact, ZeRO-1 ownership and frozen parameters included);
* saved activations — the sum over the micro-batches the rank holds at the peak of its
  1F1B / interleaved schedule (:mod:`.schedule` replays ``schedule_order``) of each virtual
  stage's per-layer estimate (the family's ``memory_model``), the LM head on the last stage;
* pipeline payload buffers — the states received with the hidden state (the family's cut
  messages; V4.1: CSA2 main KV, index K, top-k, candidates) and the full payload sent to the
  next stage, kept by every in-flight micro-batch until its backward;
* transients — the largest short-lived working set (logits gradient, attention scores);
* Engram — table partition, its gradient and its optimiser state (also inside the above);
* RL / OPD phases (``phase.kind: rl | opd``): what the co-located rollout keeps resident beside
  the training state — the rollout weight copy, each engine's KV pages, in-process teachers and
  the KL reference (:mod:`.posttrain`), one labelled line each;
* Memory Decoder phases (``phase.kind: memdec | memdec_router``): the frozen backbone, every
  layer on each rank, split by tp and ep (:func:`.posttrain.memdec_resident`);
* the time-series forecasting phase: the forecaster and the series encoder's replica on the last
  stage, inside the parameters, gradients and optimiser state (:mod:`.series_lane`).

Recomputation (``parallel.recompute``) changes what a layer keeps (:func:`layer_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.models.family.base import RankShape
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.offline_groups import group_table, pp_rank_of
from megatron_s2.planning.model_state import ModelStateBytes, model_state_bytes
from megatron_s2.planning.posttrain import memdec_resident, posttrain_resident
from megatron_s2.planning.schedule import peak_inflight

__all__ = ["RankMemory", "MemoryPlan", "estimate_memory", "rank_memory", "default_world_size",
           "representative_ranks"]

GiB = 1024 ** 3


@dataclass
class RankMemory:
    rank: int
    pp_rank: int
    layers: list[int]
    state: ModelStateBytes
    saved_activations: float
    activation_parts: dict[str, float]
    payload_buffers: float
    transient: float
    inflight: int
    micro_batches: int
    resident: dict[str, float] = field(default_factory=dict)
    """RL / OPD: rollout weight copy, engines' KV, frozen models, by labelled line (:mod:`.posttrain`)."""

    @property
    def activations(self) -> float:
        return self.saved_activations + self.payload_buffers + self.transient

    @property
    def resident_bytes(self) -> float:
        return sum(self.resident.values())

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.resident_bytes


@dataclass
class MemoryPlan:
    layout: ParallelLayout
    ranks: list[RankMemory] = field(default_factory=list)

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


def default_world_size(recipe: RecipeConfig) -> int:
    par = recipe.parallel
    return par.world_size() or par.model_parallel_size()


def representative_ranks(layout: ParallelLayout) -> list[int]:
    """One rank per pipeline stage (tp/cp/dp/ep coordinate 0): stages differ, ranks within a
    stage hold equal shares (even splits; ZeRO-1 imbalance is taken as the max below)."""
    return list(group_table(layout)["pp"][0])


def rank_memory(recipe: RecipeConfig, layout: ParallelLayout, rank: int, *, worst_zero1: bool = False,
                skeleton=None) -> RankMemory:
    """Memory of ``rank`` (``worst_zero1``: with the optimiser state of its most loaded
    ZeRO-1 peer, so that one rank per stage bounds the whole stage; ``skeleton``: the rank's own
    meta model, see :func:`~megatron_s2.planning.model_state.model_state_bytes`)."""
    from megatron_s2.models.family import family_of

    cfg, t = recipe.model, recipe.training
    terms = family_of(cfg).memory_model(cfg)
    pp_rank = pp_rank_of(layout, rank)
    shape = RankShape(t.micro_batch_size, t.seq_length, layout.tp, layout.cp, layout.ep, layout.etp,
                      layout.sequence_parallel)
    m = t.global_batch_size // (t.micro_batch_size * layout.dp)
    stages = layout.stages_of_rank(pp_rank)
    last = len(layout.stage_layers) - 1
    unit_saved, unit_payload, parts = {}, {}, {}
    for vi, stage in enumerate(stages):
        saved = 0.0
        for layer in layout.stage_layers[stage]:
            acts = terms.layer_activations(layer, shape, recipe.parallel.recompute)
            saved += acts.total
            for k, v in acts.parts.items():
                parts[k] = parts.get(k, 0.0) + v
        if stage == last:
            head = terms.head_activations(shape)
            saved += head
            parts["lm head + logits"] = parts.get("lm head + logits", 0.0) + head
        unit_saved[vi] = saved
        unit_payload[vi] = terms.payload_bytes(layout, stage, shape, recipe.parallel) if layout.pp > 1 else 0.0
    peak_saved, inflight = peak_inflight(layout.pp, layout.vpp, m, pp_rank, unit_saved)
    peak_payload, _ = peak_inflight(layout.pp, layout.vpp, m, pp_rank, unit_payload)
    # component split of the saved peak: in proportion to one micro-batch of every virtual stage
    one_each = sum(unit_saved.values()) or 1.0
    parts = {k: v * peak_saved / one_each for k, v in parts.items()}
    # router training freezes the whole memory decoder (its router is counted with the phase's residents)
    freeze = ("*",) if recipe.phase.kind == "memdec_router" else recipe.phase.freeze
    state = model_state_bytes(cfg, layout, rank, recipe.optimizer, freeze=freeze,
                              parallel=recipe.parallel, zero1_worst=worst_zero1, skeleton=skeleton,
                              series_forecast=recipe.phase.kind == "timeseries_forecast")
    layers = [layer for s in stages for layer in layout.stage_layers[s]]
    return RankMemory(rank, pp_rank, layers, state, peak_saved, parts, peak_payload,
                      terms.transient_bytes(shape, last in stages), inflight, m,
                      posttrain_resident(recipe, layout, rank) | memdec_resident(recipe, layout, rank))


def estimate_memory(recipe: RecipeConfig, world_size: int | None = None) -> MemoryPlan:
    """Memory of one rank per pipeline stage; ``plan.peak`` is the most loaded."""
    world = world_size or default_world_size(recipe)
    layout = ParallelLayout.from_recipe(recipe, world)
    plan = MemoryPlan(layout)
    if recipe.phase.kind == "contrastive":  # two towers per data-parallel rank, no language model
        from megatron_s2.planning.contrastive import contrastive_rank_state

        state, parts = contrastive_rank_state(recipe)
        t = recipe.training
        plan.ranks.append(RankMemory(0, 0, [], state, sum(parts.values()), parts, 0.0, 0.0, 1,
                                     t.global_batch_size // (t.micro_batch_size * layout.dp)))
        return plan
    for rank in representative_ranks(layout):
        plan.ranks.append(rank_memory(recipe, layout, rank, worst_zero1=True))
    return plan
