"""Autograd-aware collectives for tensor, sequence and context parallelism.

Megatron-core's versions (``tensor_parallel.mappings``) read the global tensor-parallel group
and allocate sequence-parallel buffers with ``torch.cuda.current_device()``, which fails on
CPU. These take the :class:`Group` explicitly and allocate on the input's device, so they
run with ``gloo`` on CPU and with NCCL on GPUs. Each forward/backward pair is the usual
Megatron conjugate pair (copy <-> all-reduce, scatter <-> gather, all-gather <->
reduce-scatter). All are the identity for a size-1 group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group

__all__ = [
    "copy_to_group",
    "reduce_from_group",
    "gather_from_group",
    "scatter_to_group",
    "all_gather_sequence",
    "reduce_scatter_sequence",
    "scatter_sequence",
    "gather_sequence",
    "all_reduce_sum",
    "all_reduce_max",
]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if not group.active:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group.pg)
    return x


def _gather_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if not group.active:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.pg)
    return torch.cat(parts, dim=dim)


def _split_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if not group.active:
        return x
    size = x.size(dim)
    if size % group.size:
        raise ValueError(f"cannot split dimension {dim} of size {size} over {group.size} ranks")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _reduce_scatter_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if not group.active:
        return x
    if x.size(dim) % group.size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.size(dim)} over {group.size} ranks")
    parts = [p.contiguous() for p in x.chunk(group.size, dim=dim)]
    out = torch.empty_like(parts[group.rank])
    dist.reduce_scatter(out, parts, group=group.pg)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split_dim(g, ctx.group, ctx.dim), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.group, ctx.dim), None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    """all-gather along ``dim`` in forward, reduce-scatter of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim(g, ctx.group, ctx.dim), None, None


class _ReduceScatterAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.group, ctx.dim), None, None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward (entry of a column-parallel region)."""
    return _Copy.apply(x, group) if group.active else x


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward (exit of a row-parallel region)."""
    return _Reduce.apply(x, group) if group.active else x


def gather_from_group(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` forward, split backward."""
    return _Gather.apply(x, group, dim) if group.active else x


def scatter_to_group(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward, all-gather backward."""
    return _Scatter.apply(x, group, dim) if group.active else x


def all_gather_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence/context parallel gather: all-gather forward, reduce-scatter backward."""
    return _AllGatherReduceScatter.apply(x, group, dim) if group.active else x


def reduce_scatter_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel exit of a row-parallel region: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterAllGather.apply(x, group, dim) if group.active else x


def scatter_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Enter a sequence-parallel region from replicated activations."""
    return scatter_to_group(x, group, dim)


def gather_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Leave a sequence-parallel region to replicated activations (gradient split back)."""
    return gather_from_group(x, group, dim)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Non-differentiable in-place-free all-reduce (statistics, losses for logging)."""
    return _all_reduce(x, group)


def all_reduce_max(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Non-differentiable element-wise max over the group."""
    if not group.active:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group.pg)
    return x
