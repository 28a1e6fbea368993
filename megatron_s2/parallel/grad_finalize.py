"""Gradient reduction after the backward pass (megatron-core's ``finalize_model_grads``).

Which group a gradient is reduced over is read from the parameter's
:class:`~megatron_s2.parallel.placement.ParamPlacement` (set by the model's parallel plan),
never from names:

* ``tp_partial``: replicated over tp but fed different tokens (or only the local heads'
  share) -> partial sum, all-reduced over tp first;
* ``replicas``: the identical copies whose gradients are summed — data x context replicas
  (dense parameters), expert-data replicas (routed experts), or the ranks holding the same
  Engram row partition (the lookup already returned every requester's gradient).

Each rank's loss is already normalised by the *global* token count (see losses.py), so every
reduction is a plain SUM. Gradients of the same reduction group are flattened into buckets of
``bucket_mb`` MiB so that one collective moves many tensors. With ZeRO-1 (``zero1``) the
replicas' sum is a reduce-scatter to each parameter's owner instead of an all-reduce
(:mod:`megatron_s2.optim.distributed_optimizer`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.placement import placement_of

__all__ = ["finalize_model_grads", "reduction_group"]


def reduction_group(param: torch.nn.Parameter, groups: ParallelGroups) -> tuple[str, Group]:
    """(name, group) of the replicas whose gradients of ``param`` are summed."""
    field = placement_of(param).replicas.value
    return field, getattr(groups, field)


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
def finalize_model_grads(params: list[torch.nn.Parameter], groups: ParallelGroups, bucket_mb: float = 25.0,
                         zero1=None) -> None:
    """Sum the gradients as the placements say: tp-partial ones over tp, then every gradient
    over its replicas (all-reduced, or reduce-scattered to its owner by ``zero1``, a
    :class:`~megatron_s2.optim.distributed_optimizer.DistributedOptimizer`)."""
    bucket_bytes = int(bucket_mb * 2 ** 20)
    with_grad = [p for p in params if p.grad is not None]
    if groups.tp.active:
        partial = [p.grad for p in with_grad if placement_of(p).tp_partial]
        _bucketed_all_reduce(partial, groups.tp, bucket_bytes)
    if zero1 is not None:
        zero1.reduce_scatter_grads()
        return
    by_group: dict[str, tuple[Group, list[torch.Tensor]]] = defaultdict(lambda: (None, []))
    for p in with_grad:
        name, group = reduction_group(p, groups)
        if group.active:
            by_group.setdefault(name, (group, []))[1].append(p.grad)
    for name in sorted(by_group):
        group, grads = by_group[name]
        if group is not None:
            _bucketed_all_reduce(grads, group, bucket_bytes)


def replication(param: torch.nn.Parameter, groups: ParallelGroups, zero1: bool = False) -> int:
    """How many ranks of the stage hold an identical copy of this rank's shard of ``param``
    (the stage's ranks over the number of distinct shards); with ``zero1``, of its reduced
    gradient, which only the owner in each replica group keeps."""
    shards = 1
    for _, _, count in placement_of(param).shard.splits:
        shards *= count
    copies = groups.stage.size // shards
    return copies // reduction_group(param, groups)[1].size if zero1 else copies


@torch.no_grad()
def clip_grads(params: list[torch.nn.Parameter], max_norm: float, groups: ParallelGroups,
               zero1: bool = False) -> torch.Tensor:
    """Global L2 norm of the model's gradient over every unique element (each shard counted
    once however many ranks replicate it), then clip to ``max_norm`` (0 = measure only).
    ``zero1``: gradients were reduce-scattered, only owners hold them."""
    grads = [(p.grad, replication(p, groups, zero1)) for p in params if p.grad is not None]
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
