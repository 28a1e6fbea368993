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
from torch import nn
from torch.overrides import TorchFunctionMode

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.offline_groups import layout_groups, stage_model_kwargs
from megatron_s2.parallel.sharding import ShardSpec, shard_spec

__all__ = ["SkeletonMode", "TensorInfo", "model_skeleton", "skeleton_state", "rank_skeleton_state", "materialize"]

_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})
_FILL = "_skeleton_fill"


class SkeletonMode(TorchFunctionMode):
    """Allocate uninitialised parameter/buffer storage on the ``meta`` device (each meta tensor
    remembers its factory's fill value, so that :func:`materialize` can give buffers theirs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
            out = func(*args, **kwargs)
            fill = {torch.zeros: 0, torch.ones: 1}.get(func)
            if func is torch.full:
                fill = kwargs.get("fill_value", args[1] if len(args) > 1 else None)
            setattr(out, _FILL, fill)
            return out
        return func(*args, **kwargs)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Give a skeleton real storage on ``device``, in place: parameters uninitialised (the
    family's ``init_weights`` fills them) with their placements and other attributes kept, meta
    buffers their constructor's fill value (zeros / ones / full), computed buffers moved.

    Building on ``meta`` first lets a rank plan its memory on the very model it then trains,
    instead of constructing the model twice (issue 19: one construction per start)."""
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:  # a parameter shared by two modules stays shared
                if param.is_meta:
                    new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                       requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)
                else:
                    new = param
                fresh[id(param)] = new
            module._parameters[name] = fresh[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                fill = getattr(buf, _FILL, None)
                new = (torch.empty(buf.shape, dtype=buf.dtype, device=device) if fill is None
                       else torch.full(buf.shape, fill, dtype=buf.dtype, device=device))
            else:
                new = buf.to(device)
            module._buffers[name] = new
    return model.to(device)


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
    for an optional backend (Transformer Engine) needs none of it (a login node, a CPU machine).
    Its dtypes are those of a trained model (the family's precision map applied, as
    ``init_weights`` applies it): a conversion reads tensors in these dtypes."""
    from megatron_s2.models.family import family_of

    with SkeletonMode():
        model = family_of(cfg).build_model(cfg, groups, portable=True, **kwargs)
    model.apply_precision_map()
    return model


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
