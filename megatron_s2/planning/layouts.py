"""Enumerate the layouts a cluster size admits and rank them (``megatron-s2 plan layouts``).

Candidates are the products of tp, pp, vpp, cp, ep, etp over the divisors of the cluster
size (tp and etp up to ``max_tp``, one node of 8 GPUs by default), sequence parallelism
whenever tp > 1, ZeRO-1 whenever data parallelism exists, and engram-parallel over the
largest divisor of dp x cp up to ``max_engram``. Each candidate goes through
:meth:`ParallelLayout.from_recipe` — the runtime's own validation —
and is either kept or reported rejected with the builder's reason.

Kept layouts are ranked: those whose most loaded rank fits in ``gpu_mem`` first, then by
communication volume per step (:mod:`.comm`), then by memory headroom. Memory is the model
state and activation plan of :mod:`.memory`, evaluated on one rank per pipeline stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product

from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.models.family import family_of
from megatron_s2.planning.memory import rank_memory, representative_ranks
from megatron_s2.planning.schedule import bubble_fraction, timeline

__all__ = ["LayoutCandidate", "Rejected", "enumerate_layouts", "rank_layouts"]

GiB = 1024 ** 3


@dataclass
class LayoutCandidate:
    parallel: ParallelConfig
    layout: ParallelLayout
    memory: float            # bytes of the most loaded rank
    comm: float              # wire bytes per step of the busiest rank
    comm_parts: dict
    bubble: float
    gpu_mem: float | None

    @property
    def headroom(self) -> float | None:
        return None if self.gpu_mem is None else self.gpu_mem - self.memory

    @property
    def fits(self) -> bool:
        return self.gpu_mem is None or self.memory <= self.gpu_mem


@dataclass
class Rejected:
    parallel: ParallelConfig
    reason: str


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0 and (limit is None or k <= limit)]


def _candidates(recipe: RecipeConfig, gpus: int, max_tp: int, max_engram: int) -> list[ParallelConfig]:
    base, need = recipe.parallel, recipe.model.layout_requirements()  # any family: only what its plan states
    out = []
    for tp, pp, cp in product(_divisors(gpus, max_tp), _divisors(gpus), _divisors(gpus)):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        for vpp in ([1, 2] if pp > 1 else [1]):
            for ep in (_divisors(tp * cp * dp) if need.experts else [1]):
                if any(count % ep for count, _ in need.ep):
                    continue
                for etp in (sorted({1, tp}) if need.experts else [1]):
                    engram = max(_divisors(dp * cp, max_engram)) if need.engram else 1
                    out.append(dataclasses.replace(
                        base, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, ep=ep, etp=etp, engram_parallel=engram,
                        sequence_parallel=tp > 1, distributed_optimizer=dp * cp > 1, pipeline_layers=()))
    return out


def enumerate_layouts(recipe: RecipeConfig, gpus: int, *, max_tp: int = 8, max_engram: int = 8
                      ) -> tuple[list[tuple[RecipeConfig, ParallelLayout]], list[Rejected]]:
    """(buildable (recipe, layout) pairs, rejected candidates with the builder's reason)."""
    kept, rejected = [], []
    for par in _candidates(recipe, gpus, max_tp, max_engram):
        try:
            r = recipe.replace(parallel=par)
            kept.append((r, ParallelLayout.from_recipe(r, gpus)))
        except ConfigError as exc:
            rejected.append(Rejected(par, str(exc)))
    return kept, rejected


def _evaluate(recipe: RecipeConfig, layout: ParallelLayout, gpu_mem: float | None) -> LayoutCandidate:
    worst_mem, worst_comm, parts = 0.0, 0.0, {}
    for rank in representative_ranks(layout):
        mem = rank_memory(recipe, layout, rank, worst_zero1=True)
        worst_mem = max(worst_mem, mem.total)
        expert = mem.state.parameters.get("moe routed experts", 0)
        dense = mem.state.gradients - expert
        vol = family_of(recipe.model).memory_model(recipe.model).comm_volume(recipe, layout, mem.pp_rank, dense, expert)
        if vol.total >= worst_comm:
            worst_comm, parts = vol.total, vol.parts
    m = recipe.training.global_batch_size // (recipe.training.micro_batch_size * layout.dp)
    bubble = bubble_fraction(timeline(layout.pp, layout.vpp, m)) if layout.pp > 1 else 0.0
    return LayoutCandidate(recipe.parallel, layout, worst_mem, worst_comm, parts, bubble, gpu_mem)


def rank_layouts(recipe: RecipeConfig, gpus: int, gpu_mem_gb: float | None = None, *, max_tp: int = 8,
                 max_engram: int = 8) -> tuple[list[LayoutCandidate], list[Rejected]]:
    gpu_mem = gpu_mem_gb * GiB if gpu_mem_gb is not None else None
    kept, rejected = enumerate_layouts(recipe, gpus, max_tp=max_tp, max_engram=max_engram)
    ranked = [_evaluate(r, layout, gpu_mem) for r, layout in kept]
    ranked.sort(key=lambda c: (not c.fits, c.comm, -(c.headroom or 0.0), c.memory))
    return ranked, rejected
