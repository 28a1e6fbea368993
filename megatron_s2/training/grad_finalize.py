"""Gradient reduction after the backward pass (megatron-core's ``finalize_model_grads``).

Which group a gradient is reduced over follows from attributes the modules set on their
parameters, never from names:

* ``sequence_parallel``: replicated over tp but fed different tokens (or only the local
  heads' share) -> partial sum, all-reduced over tp first;
* ``is_expert``: a routed expert held by one expert-parallel rank -> summed over its
  expert-data-parallel replicas;
* ``engram_table``: an Engram row partition -> summed over the ranks holding the same
  partition (``engram_replica``); the lookup already returned every requester's gradient;
* anything else: summed over data x context parallel replicas.

Each rank's loss is already normalised by the *global* token count (see losses.py), so every
reduction is a plain SUM. Gradients of the same reduction group are flattened into buckets of
``bucket_mb`` MiB so that one collective moves many tensors.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups

__all__ = ["finalize_model_grads", "reduction_group"]


def reduction_group(param: torch.nn.Parameter, groups: ParallelGroups) -> tuple[str, Group]:
    if getattr(param, "engram_table", False):
        return "engram_replica", groups.engram_replica
    if getattr(param, "is_expert", False):
        return "expert_dp", groups.expert_dp
    return "dp_cp", groups.dp_cp


def _bucketed_all_reduce(grads: list[torch.Tensor], group: Group, bucket_bytes: int) -> None:
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group.pg)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            flush()
    flush()


@torch.no_grad()
def finalize_model_grads(params: list[torch.nn.Parameter], groups: ParallelGroups, bucket_mb: float = 25.0) -> None:
    bucket_bytes = int(bucket_mb * 2 ** 20)
    with_grad = [p for p in params if p.grad is not None]
    if groups.tp.active:
        partial = [p.grad for p in with_grad if getattr(p, "sequence_parallel", False)]
        _bucketed_all_reduce(partial, groups.tp, bucket_bytes)
    by_group: dict[str, tuple[Group, list[torch.Tensor]]] = defaultdict(lambda: (None, []))
    for p in with_grad:
        name, group = reduction_group(p, groups)
        if group.active:
            by_group.setdefault(name, (group, []))[1].append(p.grad)
    for name in sorted(by_group):
        group, grads = by_group[name]
        if group is not None:
            _bucketed_all_reduce(grads, group, bucket_bytes)


def replication(param: torch.nn.Parameter, groups: ParallelGroups) -> int:
    """How many ranks hold an identical copy of this rank's shard of ``param``."""
    if getattr(param, "engram_table", False):
        return groups.engram_replica.size * groups.tp.size
    if getattr(param, "is_expert", False):
        return groups.expert_dp.size
    spec = getattr(param, "shard_spec", None)
    tp_sharded = spec is not None and spec.is_sharded
    return groups.stage.size // (groups.tp.size if tp_sharded else 1)


@torch.no_grad()
def clip_grads(params: list[torch.nn.Parameter], max_norm: float, groups: ParallelGroups) -> torch.Tensor:
    """Global L2 norm of the model's gradient over every unique element (each shard counted
    once however many ranks replicate it), then clip to ``max_norm`` (0 = measure only)."""
    grads = [(p.grad, replication(p, groups)) for p in params if p.grad is not None]
    total_sq = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for g, r in grads:
        total_sq += torch.linalg.vector_norm(g, dtype=torch.float32).square() / r
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    if max_norm > 0 and torch.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g, _ in grads:
                g.mul_(coef.to(g.dtype))
    return total
