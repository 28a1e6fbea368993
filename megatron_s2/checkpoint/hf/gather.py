"""Layout-aware gather and scatter of model state through ShardSpecs.

Every tensor a rank holds carries a :class:`~megatron_s2.parallel.sharding.ShardSpec` — the
full shape and the successive (dim, index, count) splits that cut its slice — set by the model
code where the parameter is created (TP column/row splits, EP expert blocks, ETP widths,
vocabulary shards, Engram row partitions). Gathering a sharded checkpoint therefore needs no
per-parameter TP/EP rules: :func:`assemble` places every shard at ``spec.slices()`` and checks
that the shards tile the full tensor exactly once, and that replicas of the same slice (data,
context, pipeline-embedding or expert-data replicas) are bit-identical — a divergent replica
is an error, never a silent pick. :func:`scatter` is the inverse for one rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from megatron_s2.parallel.sharding import ShardSpec

__all__ = ["ShardError", "assemble", "scatter"]


class ShardError(ValueError):
    """Shards that do not form a consistent full tensor."""


def _volume(slices: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in slices)


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> bool:
    return all(x.start < y.stop and y.start < x.stop for x, y in zip(a, b))


def assemble(shards: Iterable[tuple[str, ShardSpec, torch.Tensor]], *, where: str = "checkpoint"
             ) -> dict[str, torch.Tensor]:
    """Full tensors from ``(name, spec, local tensor)`` triples of any number of ranks."""
    full: dict[str, torch.Tensor] = {}
    placed: dict[str, dict[tuple, tuple[int, str]]] = {}
    for name, spec, local in shards:
        if tuple(local.shape) != spec.local_shape():
            raise ShardError(f"{where}: '{name}' has shape {tuple(local.shape)} but its ShardSpec "
                             f"{spec.splits} of {spec.full_shape} describes {spec.local_shape()}")
        slices = spec.slices()
        key = tuple((s.start, s.stop) for s in slices)
        if name not in full:
            full[name] = torch.empty(spec.full_shape, dtype=local.dtype)
            placed[name] = {}
        elif tuple(full[name].shape) != spec.full_shape:
            raise ShardError(f"{where}: '{name}' is described with full shapes {tuple(full[name].shape)} "
                             f"and {spec.full_shape} by different ranks")
        if key in placed[name]:
            if not torch.equal(full[name][slices], local.to(full[name].dtype)):
                raise ShardError(f"{where}: replicas of '{name}' slice {key} differ; the checkpoint holds "
                                 "diverged copies of one parameter")
            continue
        for other in placed[name]:
            if _overlap(slices, tuple(slice(a, b) for a, b in other)):
                raise ShardError(f"{where}: shards {other} and {key} of '{name}' overlap without being equal slices")
        full[name][slices] = local
        placed[name][key] = (_volume(slices), name)
    for name, tensor in full.items():
        covered = sum(v for v, _ in placed[name].values())
        if covered != tensor.numel():
            raise ShardError(f"{where}: the shards of '{name}' cover {covered} of its {tensor.numel()} elements; "
                             "a rank's file is missing")
    return full


def scatter(full: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """The local tensors of one rank: ``full[name][spec.slices()]`` for every name in ``specs``."""
    missing = sorted(set(specs) - set(full))
    if missing:
        raise ShardError(f"state is missing {len(missing)} tensors this rank holds, e.g. {missing[:3]}")
    out = {}
    for name, spec in specs.items():
        tensor = full[name]
        if tuple(tensor.shape) != spec.full_shape:
            raise ShardError(f"'{name}' has shape {tuple(tensor.shape)}, the layout expects {spec.full_shape}")
        out[name] = tensor[spec.slices()].clone()
    return out
