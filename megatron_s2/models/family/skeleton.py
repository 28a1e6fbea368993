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

Per-rank skeletons use :func:`~megatron_s2.parallel.offline_groups.layout_groups`: a
:class:`ParallelGroups` whose groups have the sizes and this rank's coordinates from the pure
:class:`ParallelLayout`, but no process group. Module constructors only read sizes and ranks, so
nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.offline_groups import layout_groups, stage_model_kwargs
from megatron_s2.parallel.sharding import ShardSpec, shard_spec

__all__ = ["SkeletonMode", "TensorInfo", "model_skeleton", "skeleton_state", "rank_skeleton_state"]

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


def model_skeleton(cfg: ModelSchema, groups: ParallelGroups | None = None, **kwargs):
    """The family's real model for ``cfg`` with meta storage (``kwargs``: layers, pre_process,
    post_process), built with portable leaf modules: planning or converting a recipe that asks
    for an optional backend (Transformer Engine) needs none of it (a login node, a CPU machine)."""
    from megatron_s2.models.family import family_of

    with SkeletonMode():
        return family_of(cfg).build_model(cfg, groups, portable=True, **kwargs)


def _state_info(model) -> dict[str, TensorInfo]:
    params = dict(model.named_parameters())
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = TensorInfo(tuple(t.shape), t.dtype, shard_spec(t), name in params)
    return out


def skeleton_state(cfg: ModelSchema) -> dict[str, TensorInfo]:
    """Every entry of the single-rank model's ``state_dict`` (local shape == full shape)."""
    return _state_info(model_skeleton(cfg))


def rank_skeleton_state(cfg: ModelSchema, layout: ParallelLayout, rank: int) -> dict[str, TensorInfo]:
    """The ``state_dict`` entries rank ``rank`` holds under ``layout``, with their ShardSpecs."""
    model = model_skeleton(cfg, layout_groups(layout, rank), **stage_model_kwargs(layout, rank))
    return _state_info(model)
