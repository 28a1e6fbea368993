"""Layout-independent initialisation of sharded parameters.

Every parameter's place in its global tensor is its :class:`~megatron_s2.parallel.placement.ShardSpec`
(part of its :class:`~megatron_s2.parallel.placement.ParamPlacement`). The full tensor is
generated from a seed derived from the parameter's name, then sliced, so a model starts from
the same weights under every layout. ``ShardSpec``, ``mark_param``, ``shard_spec`` and
``slice_of`` are defined in :mod:`megatron_s2.parallel.placement` and re-exported here.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from megatron_s2.parallel.placement import ShardSpec, mark_param, shard_spec, slice_of

__all__ = ["ShardSpec", "mark_param", "shard_spec", "slice_of", "init_from_full", "name_seed"]


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
