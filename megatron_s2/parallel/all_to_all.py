"""Autograd-aware token exchange with variable split sizes (MoE expert parallelism).

Dropless MoE dispatch moves a different number of tokens between every pair of ranks, so
these collectives take explicit per-rank row counts (first dimension) instead of assuming
equal chunks like :mod:`megatron_s2.parallel.mappings`. Each forward/backward pair is
conjugate:

* :func:`all_to_all` — ``all_to_all_single`` with split sizes forward; the reverse exchange
  (splits swapped) backward. Expert-parallel dispatch and combine.
* :func:`all_gather_rows` — every rank's rows concatenated in rank order forward; the
  gradient rows of rank r summed over the group and returned to r backward
  (reduce-scatter). Expert-tensor-parallel entry.
* :func:`reduce_scatter_rows` — the reverse pair (sum, keep own rows; all-gather backward).
  Expert-tensor-parallel exit.

Row counts are Python ints (they size the receive buffers); obtaining them from device
counts costs one host synchronisation per exchange, as in every dropless dispatcher.
Variable-size all-gather and reduce-scatter pad each rank's rows to the largest count and
use the fixed-size ``all_gather_single`` / ``reduce_scatter_single``, which both gloo
(CPU) and NCCL implement. All functions are the identity for a size-1 group.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group

__all__ = ["all_to_all", "all_gather_rows", "reduce_scatter_rows", "exchange_counts", "gather_counts"]

# torch >= 2.13 names; older torch (e.g. in GPU containers) only has the *_tensor spellings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _exchange(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Group) -> torch.Tensor:
    if x.size(0) != sum(input_splits):
        raise ValueError(f"all_to_all: {x.size(0)} rows do not match input splits {list(input_splits)}")
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group.pg)
    return out


def _gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    if x.size(0) != sizes[group.rank]:
        raise ValueError(f"all_gather_rows: rank {group.rank} holds {x.size(0)} rows, sizes say {sizes[group.rank]}")
    width = max(sizes)
    if width == 0:  # every rank has no rows: nothing to exchange (the same decision on all ranks)
        return x
    padded = x.new_zeros((width,) + tuple(x.shape[1:]))
    padded[: x.size(0)] = x
    out = x.new_empty((group.size * width,) + tuple(x.shape[1:]))
    _all_gather_single(out, padded, group=group.pg)
    out = out.view((group.size, width) + tuple(x.shape[1:]))
    return torch.cat([out[r, :n] for r, n in enumerate(sizes)], dim=0)


def _reduce_scatter_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    if x.size(0) != sum(sizes):
        raise ValueError(f"reduce_scatter_rows: {x.size(0)} rows do not match sizes {list(sizes)}")
    width = max(sizes)
    if width == 0:
        return x
    padded = x.new_zeros((group.size, width) + tuple(x.shape[1:]))
    for r, part in enumerate(torch.split(x, list(sizes), dim=0)):
        padded[r, : part.size(0)] = part
    out = x.new_empty((width,) + tuple(x.shape[1:]))
    _reduce_scatter_single(out, padded.view((-1,) + tuple(x.shape[1:])), group=group.pg)
    return out[: sizes[group.rank]]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_rows(g, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.group), None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: Group) -> torch.Tensor:
    """Send ``input_splits[r]`` consecutive rows of ``x`` to rank r; receive
    ``output_splits[r]`` rows from rank r, concatenated in rank order."""
    if not group.active:
        return x
    return _AllToAll.apply(x, tuple(int(n) for n in output_splits), tuple(int(n) for n in input_splits), group)


def all_gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Concatenate every rank's rows (rank r holds ``sizes[r]``); reduce-scatter backward."""
    if not group.active:
        return x
    return _AllGatherRows.apply(x, tuple(int(n) for n in sizes), group)


def reduce_scatter_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Sum ``x`` (rows laid out as ``sizes`` per rank) over the group and keep this rank's
    ``sizes[rank]`` rows; all-gather backward."""
    if not group.active:
        return x
    return _ReduceScatterRows.apply(x, tuple(int(n) for n in sizes), group)


def exchange_counts(send: torch.Tensor, group: Group) -> torch.Tensor:
    """Non-differentiable all-to-all of a ``[group.size, ...]`` count tensor: row r goes to
    rank r; the result's row r came from rank r."""
    if not group.active:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group.pg)
    return recv


def gather_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Non-differentiable all-gather of equal-shaped count tensors: ``[group.size, *counts.shape]``."""
    if not group.active:
        return counts.unsqueeze(0)
    flat = counts.reshape(1, -1)
    out = counts.new_empty((group.size, flat.size(1)))
    _all_gather_single(out, flat.contiguous(), group=group.pg)
    return out.view((group.size,) + tuple(counts.shape))
