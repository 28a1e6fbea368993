"""Where a local parameter sits inside its global tensor.

Every parameter carries a :class:`ShardSpec`: its global shape and the successive splits
(dimension, index, count) that cut this rank's slice out of it. The spec is the single source
of truth for layout-independent initialisation (the full tensor is generated from a seed
derived from the parameter's name, then sliced), for gathering gradients in parity tests,
and for checkpoint resharding ("every tensor described by its global shape and the slice
this rank holds").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["ShardSpec", "mark_param", "shard_spec", "slice_of", "init_from_full", "name_seed"]


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


def mark_param(param: torch.nn.Parameter, full_shape, splits=(), init: Callable | None = None,
               **attrs) -> torch.nn.Parameter:
    """Attach a ShardSpec (and optional init function / attributes) to ``param``."""
    spec = ShardSpec(tuple(int(s) for s in full_shape), tuple((int(d), int(i), int(c)) for d, i, c in splits))
    if spec.local_shape() != tuple(param.shape):
        raise ValueError(f"shard of {spec.full_shape} by {spec.splits} is {spec.local_shape()}, "
                         f"but the parameter is {tuple(param.shape)}")
    param.shard_spec = spec
    if init is not None:
        param.init_fn = init
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec:
    spec = getattr(param, "shard_spec", None)
    return spec if spec is not None else ShardSpec(tuple(param.shape))


def slice_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    return full[spec.slices()]


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_from_full(param: torch.Tensor, name: str, seed: int, default: Callable[[torch.Tensor, torch.Generator], None]):
    """Generate the full tensor deterministically from (seed, name) and copy this rank's slice."""
    spec = shard_spec(param)
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    shard_fn = getattr(param, "init_shard_fn", None)
    if shard_fn is not None:  # row-partitioned giants (Engram tables): draw only this rank's rows
        rows = spec.slices()[0]
        local = torch.empty(spec.local_shape(), dtype=torch.float32, device="cpu")  # drawn on the host
        shard_fn(local, rows.start, gen)
        param.copy_(local.to(param.dtype))
        return
    full = torch.empty(spec.full_shape, dtype=torch.float32, device="cpu")  # same values on every device
    fn = getattr(param, "init_fn", None) or default
    fn(full, gen)
    param.copy_(slice_of(full, spec).to(param.dtype))
