"""Shape-only models: parameter names, full shapes and per-rank ShardSpecs without memory.

Conversion and planning need to know, for a model config and a parallel layout, which
tensors exist on which rank and where each local tensor sits in its global tensor
(:class:`~megatron_s2.parallel.sharding.ShardSpec`). The single source of truth for that is
the model code itself, so this module *builds the real model* — but inside
:class:`SkeletonMode`, which sends every uninitialised factory call (``torch.empty``,
``zeros``, ``ones``, ``full`` without an explicit device) to the ``meta`` device. Parameters
and buffers then cost no memory (the 748B-parameter flagship builds in about a second),
while the small host-side tensors some modules compute at construction (RoPE frequencies,
Engram hash constants) stay real.

Per-rank skeletons use :func:`layout_groups`: a :class:`ParallelGroups` whose groups have the
sizes and this rank's coordinates from the pure :class:`ParallelLayout`, but no process
group. Module constructors only read sizes and ranks, so nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.overrides import TorchFunctionMode

from megatron_s2.config.model import ModelConfig
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.sharding import ShardSpec, shard_spec

__all__ = ["SkeletonMode", "TensorInfo", "model_skeleton", "skeleton_state", "layout_groups", "group_table",
           "pp_rank_of", "rank_skeleton_state", "stage_model_kwargs"]

_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})


class SkeletonMode(TorchFunctionMode):
    """Allocate uninitialised parameter/buffer storage on the ``meta`` device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a model's state: its local shape/dtype and its place in the full tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: ShardSpec
    is_parameter: bool

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.spec.full_shape

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype, device="meta").element_size()


def model_skeleton(cfg: ModelConfig, groups: ParallelGroups | None = None, **kwargs):
    """The real :class:`V41Model` for ``cfg`` with meta storage (``kwargs``: layers,
    pre_process, post_process). Built with the local leaf modules whatever
    ``model.transformer_impl`` says: the Transformer Engine modules adopt exactly our parameters
    and buffers, so names and shapes are the same, and planning or converting a TE recipe needs
    no Transformer Engine (a login node, a CPU machine)."""
    from megatron_s2.models.v41.model import V41Model
    from megatron_s2.models.v41.spec import LocalProvider

    kwargs.setdefault("provider", LocalProvider())
    with SkeletonMode():
        return V41Model(cfg, groups, **kwargs)


def _state_info(model) -> dict[str, TensorInfo]:
    params = dict(model.named_parameters())
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = TensorInfo(tuple(t.shape), t.dtype, shard_spec(t), name in params)
    return out


def skeleton_state(cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Every entry of the single-rank model's ``state_dict`` (local shape == full shape)."""
    return _state_info(model_skeleton(cfg))


@lru_cache(maxsize=32)
def group_table(layout: ParallelLayout) -> dict[str, dict[int, tuple[int, ...]]]:
    """``{ParallelGroups field: {rank: ranks of its group}}`` for every rank, computed once
    (``ParallelLayout.groups`` recomputes the rank grid on every call)."""
    from megatron_s2.parallel.setup import GROUP_KINDS

    table = {field: {r: tuple(g) for g in layout.groups(kind) for r in g} for field, kind in GROUP_KINDS.items()}
    # Engram replicas: same position in their engram group and same model shard (tp, pp) —
    # the rule of megatron_s2.parallel.setup._engram_replica_groups.
    by_key: dict[tuple, list[int]] = {}
    for g in layout.groups("engram"):
        for idx, r in enumerate(g):
            key = (table["tp"][r].index(r), table["pp"][r].index(r), idx)
            by_key.setdefault(key, []).append(r)
    table["engram_replica"] = {r: tuple(sorted(v)) for v in by_key.values() for r in v}
    return table


def layout_groups(layout: ParallelLayout, rank: int) -> ParallelGroups:
    """Communication-free :class:`ParallelGroups` of ``rank``: sizes and coordinates only."""
    handles = {}
    for field, by_rank in group_table(layout).items():
        ranks = by_rank.get(rank, (rank,))
        handles[field] = Group(pg=None, size=len(ranks), rank=ranks.index(rank), ranks=ranks)
    return ParallelGroups(sequence_parallel=layout.sequence_parallel, **handles)


def pp_rank_of(layout: ParallelLayout, rank: int) -> int:
    ranks = group_table(layout)["pp"][rank]
    return ranks.index(rank)


def stage_model_kwargs(layout: ParallelLayout, rank: int) -> dict:
    """``layers`` / ``pre_process`` / ``post_process`` of the model object held by ``rank``
    (the union of its virtual stages, as :func:`build_pipeline_model` builds it)."""
    if layout.pp == 1:
        return {}
    stages = layout.stages_of_rank(pp_rank_of(layout, rank))
    layers = [layer for s in stages for layer in layout.stage_layers[s]]
    return {"layers": layers, "pre_process": 0 in stages, "post_process": len(layout.stage_layers) - 1 in stages}


def rank_skeleton_state(cfg: ModelConfig, layout: ParallelLayout, rank: int) -> dict[str, TensorInfo]:
    """The ``state_dict`` entries rank ``rank`` holds under ``layout``, with their ShardSpecs."""
    model = model_skeleton(cfg, layout_groups(layout, rank), **stage_model_kwargs(layout, rank))
    return _state_info(model)
