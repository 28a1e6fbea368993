"""Balanced image sharding across context-parallel ranks (report §3.1.1, "Long-Sequence
Multimodal Training Optimization").

A long, image-dense sequence would exhaust one host's I/O, CPU and memory if every CP rank
decoded all of its images, so the images of each sequence are split across the CP group:

1. **Plan** (:func:`plan_image_owners`, pure and deterministic): every CP rank computes the same
   owner for every image from sizes known before any pixel is read (the resize planning), by
   greedy longest-processing-time scheduling — images in decreasing cost, each onto the rank
   with the least work so far (ties: the lower image index first, then the lower rank). Graham's
   bound holds: the busiest rank carries at most ``total / cp + (1 - 1/cp) * max cost``.
2. **Load and encode**: each rank decodes and runs the vision forward only on the images it owns
   (the loader emits :class:`RemoteImage` placeholders for the others), so each image is loaded
   exactly once across the CP group.
3. **Exchange** (:func:`gather_image_spans`): the owners' span embeddings are all-gathered over
   the CP group; the backward sums every rank's gradient of each span and returns to its owner
   exactly the gradient of its own spans (a variable-length all-gather / reduce-scatter pair).
4. **Merge**: each rank writes the parts of every span that fall into its own sequence chunks
   (:class:`ShardedImages` carries those chunks' global positions; spans may cross chunk
   boundaries and the two load-balanced chunks of a rank are not contiguous).

The LLM phase is unchanged: it sees the same embeddings [b, s_local, d] as with text only.

Cost model (:func:`image_work`): the forward multiply-adds of one tower layer on an image of
``n`` patches, ``n * (4 d^2 + 3 d f) + 2 n^2 d`` (fused QKV and output projections, the SwiGLU's
three matrices; the bidirectional attention's scores and weighted sum). The quadratic term is
kept because at the released cap (1024 tokens, ~9k patches, d = 1024) attention is ~60% of
the layer's work, so counting patches alone would badly under-weight large images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group

__all__ = ["RemoteImage", "ShardedImages", "image_work", "plan_image_owners", "rank_loads", "gather_image_spans"]


@dataclass(frozen=True)
class RemoteImage:
    """An image of the sequence that another CP rank loads and encodes: where its span sits."""

    start: int
    """Position of the span's first token in the (full) sequence."""
    length: int
    """Positions the span takes."""
    owner: int
    """The CP rank that loads and encodes it."""


@dataclass
class ShardedImages:
    """The image inputs of a context-parallel micro-batch (what ``model.embed`` receives under CP).

    ``rows[i]`` lists every image of sequence ``i`` in order: the family's image input for the
    images this rank owns, a :class:`RemoteImage` for the others (the plan is the same on every
    rank). ``positions``: the global positions of this rank's local tokens (chunk r, then chunk
    2cp-1-r; see :func:`~megatron_s2.parallel.context_parallel.local_chunk_positions`)."""

    rows: list[list[Any]]
    positions: torch.Tensor
    group: Group


def image_work(num_patches: int, dim: int, inter_dim: int) -> int:
    """Forward multiply-adds of one vision-tower layer on an image of ``num_patches`` patches
    (module docstring; the layer count is common to every image and left out)."""
    n = num_patches
    return n * (4 * dim * dim + 3 * dim * inter_dim) + 2 * n * n * dim


def plan_image_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The CP rank that loads and encodes each image: greedy, largest first onto the least-loaded
    rank (module docstring). Deterministic: equal costs keep their order, equal loads take the
    lower rank."""
    if ranks < 1:
        raise ValueError(f"plan_image_owners: ranks must be >= 1, got {ranks}")
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def rank_loads(costs: Sequence[float], owners: Sequence[int], ranks: int) -> list[float]:
    """Total cost each rank carries under ``owners``."""
    loads = [0.0] * ranks
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


class _GatherSpans(torch.autograd.Function):
    """Variable-length all-gather of rows over a group; backward: the summed gradient of this
    rank's own rows (a reduce-scatter of the padded blocks)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group: Group):
        ctx.counts, ctx.group = counts, group
        longest = max(counts)
        padded = local.new_zeros(longest, *local.shape[1:])
        padded[:local.size(0)] = local
        blocks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(blocks, padded.contiguous(), group=group.pg)
        return torch.cat([block[:n] for block, n in zip(blocks, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, group = ctx.counts, ctx.group
        longest = max(counts)
        blocks, offset = [], 0
        for n in counts:
            block = grad.new_zeros(longest, *grad.shape[1:])
            block[:n] = grad[offset:offset + n]
            blocks.append(block)
            offset += n
        mine = torch.empty_like(blocks[group.rank])
        dist.reduce_scatter(mine, blocks, group=group.pg)
        return mine[:counts[group.rank]], None, None


def gather_image_spans(local: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Every rank's span rows [sum(counts), ...] in rank order, from this rank's ``local``
    [counts[group.rank], ...]; identity for a size-1 group."""
    if local.size(0) != counts[group.rank]:
        raise ValueError(f"gather_image_spans: {local.size(0)} local rows, the plan gives this rank "
                         f"{counts[group.rank]}")
    if not group.active:
        return local
    return _GatherSpans.apply(local, list(counts), group)
