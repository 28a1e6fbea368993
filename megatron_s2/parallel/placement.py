"""Where a parameter lives and how its gradient is reduced: one typed record per parameter.

Every parameter of a parallel model carries one :class:`ParamPlacement` (``param.placement``):

* ``shard`` — its global shape and the splits that cut this rank's slice out of it
  (:class:`ShardSpec`): the single source of truth for layout-independent initialisation,
  gathering gradients in parity tests and checkpoint resharding;
* ``style`` — how the layout cuts it: replicated, column / row over tensor parallelism,
  whole experts over expert parallelism, table rows over the engram group;
* ``tp_partial`` — replicated over tp but fed tp-split inputs (sequence-sharded tokens, the
  MoE layer's 1/tp token split, the local heads' share), so each tp rank holds a partial sum
  of its gradient that the finaliser all-reduces over tp first;
* ``replicas`` — the group of ranks holding an identical copy of this shard, whose gradients
  are summed (data x context replicas, expert-data replicas, Engram partition replicas);
* ``head_split`` — heads stacked along its rows (head-wise Muon), ``None`` when it has none.

Modules record the shard when they allocate (:func:`mark_param`); the rest comes from the
model's parallel plan (:mod:`megatron_s2.models.v41.parallel_plan`), which also checks that
the shard the module allocated is the one the plan's style describes. Gradient finalisation,
clipping, ZeRO-1, the optimiser's shard groups, head-wise Muon, checkpoints, initialisation
and the planners read :func:`placement_of` — never ad-hoc attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

__all__ = ["ShardSpec", "Style", "Replicas", "ParamPlacement", "mark_param", "place", "placement_of",
           "shard_spec", "slice_of"]


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    splits: tuple[tuple[int, int, int], ...] = ()  # (dim, index, count), applied in order

    def slices(self) -> tuple[slice, ...]:
        """Index of this shard inside the full tensor."""
        lo = [0] * len(self.full_shape)
        hi = list(self.full_shape)
        for dim, index, count in self.splits:
            length = hi[dim] - lo[dim]
            if length % count:
                raise ValueError(f"dimension {dim} of length {length} does not split into {count} shards")
            step = length // count
            lo[dim], hi[dim] = lo[dim] + index * step, lo[dim] + (index + 1) * step
        return tuple(slice(a, b) for a, b in zip(lo, hi))

    def local_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.slices())

    @property
    def is_sharded(self) -> bool:
        return any(count > 1 for _, _, count in self.splits)

    @property
    def cut_dims(self) -> list[int]:
        """Dimensions actually split (count > 1), in split order."""
        return [dim for dim, _, count in self.splits if count > 1]


class Style(str, Enum):
    """How the layout cuts a parameter."""

    REPLICATED = "replicated"    # the whole tensor on every rank of the stage
    COLUMN = "column"            # dim 0 (output features, heads, vocabulary rows) split over tp
    ROW = "row"                  # dim 1 (input features) split over tp
    EXPERTS = "experts"          # whole experts (dim 0) over ep, FFN width over etp
    ENGRAM_ROWS = "engram_rows"  # table rows (dim 0) over the engram-parallel group


class Replicas(str, Enum):
    """Ranks holding an identical copy of a shard (named by their ``ParallelGroups`` field)."""

    DATA = "dp_cp"               # data x context parallel replicas
    EXPERT_DATA = "expert_dp"    # replicas of the same experts
    ENGRAM = "engram_replica"    # ranks holding the same Engram row partition


@dataclass(frozen=True)
class ParamPlacement:
    shard: ShardSpec
    """Global shape and this rank's slice."""
    style: Style = Style.REPLICATED
    """How the layout cuts it."""
    tp_partial: bool = False
    """Its gradient on each tp rank is a partial sum (all-reduced over tp before anything else)."""
    replicas: Replicas = Replicas.DATA
    """The group whose identical copies' gradients are summed."""
    head_split: int | None = None
    """Heads (or output groups) stacked along its rows on this rank; None: not head-structured."""
    planned: bool = False
    """Set by a parallel plan (False: only the shard is known, e.g. a module built on its own)."""


def place(param: torch.Tensor, placement: ParamPlacement) -> torch.Tensor:
    """Attach ``placement`` to ``param`` (its shard must match the tensor)."""
    if placement.shard.local_shape() != tuple(param.shape):
        raise ValueError(f"shard of {placement.shard.full_shape} by {placement.shard.splits} is "
                         f"{placement.shard.local_shape()}, but the parameter is {tuple(param.shape)}")
    param.placement = placement
    return param


def placement_of(param: torch.Tensor) -> ParamPlacement:
    """The parameter's placement; an unmarked tensor is whole, replicated, reduced over dp x cp."""
    found = getattr(param, "placement", None)
    return found if found is not None else ParamPlacement(ShardSpec(tuple(param.shape)))


def mark_param(param: torch.nn.Parameter, full_shape, splits=(), init: Callable | None = None,
               init_shard: Callable | None = None) -> torch.nn.Parameter:
    """Record where ``param`` sits in its global tensor. Style, gradient reduction and head split
    come from the model's parallel plan.

    Initialisation (model semantics, read only by :func:`~megatron_s2.parallel.sharding.init_from_full`):
    ``init(full, generator)`` fills the full tensor; ``init_shard(local, first_row, generator)``
    draws only this rank's rows of a row-partitioned giant (Engram tables) with the same values.
    """
    spec = ShardSpec(tuple(int(s) for s in full_shape), tuple((int(d), int(i), int(c)) for d, i, c in splits))
    place(param, replace(placement_of(param), shard=spec))
    if init is not None:
        param.init_fn = init
    if init_shard is not None:
        param.init_shard_fn = init_shard
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec:
    return placement_of(param).shard


def slice_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    return full[spec.slices()]
