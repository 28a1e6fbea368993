"""Hierarchical Sparse Indexer, level one: candidate blocks (report §2.3.2).

The first decoder Full layer scores every causally visible main-KV entry anyway; it also
gives each block of ``block_size`` consecutive entries the maximum score among its entries,
keeps the ``top_blocks`` best blocks per query, and publishes the positions they cover as a
*candidate pool* (2,048 blocks x 8 = 16,384 positions in the flagship). Later Reindex layers
score only their query's pool, so their per-query cost no longer grows with the context.

The block holding the query's newest visible entry is always kept (it is only partly filled
and could otherwise lose to an older full block — reference semantics); among blocks with
equal maxima the newer one is kept. Unreachable picks and not-yet-visible positions are -1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_s2.models.v41.attention.selection import topk_newest_on_ties

__all__ = ["select_candidate_blocks"]


def select_candidate_blocks(scores: torch.Tensor, q_pos: torch.Tensor, ratio: int, top_blocks: int,
                            block_size: int) -> torch.Tensor:
    """scores: [b, s, n] with invisible entries at -inf. Returns [b, s, top_blocks*block_size]
    candidate entry ids (block order, -1 for unreachable/invisible)."""
    b, s, n = scores.shape
    pad = -n % block_size
    blocks = F.pad(scores, (0, pad), value=float("-inf")).unflatten(-1, (-1, block_size)).amax(-1)
    num_blocks = blocks.size(-1)
    newest = torch.div(q_pos + 1, ratio, rounding_mode="floor") - 1  # newest visible entry
    has_visible = newest >= 0
    newest_block = torch.div(newest.clamp_min(0), block_size, rounding_mode="floor")
    pin = (torch.arange(num_blocks, device=scores.device).view(1, 1, -1) == newest_block.unsqueeze(-1))
    pin = pin & has_visible.unsqueeze(-1) & torch.isfinite(blocks)
    blocks = blocks.masked_fill(pin, float("inf"))
    kb = min(top_blocks, num_blocks)
    values, indices = topk_newest_on_ties(blocks, kb)  # equal maxima: the newer block
    keep = values > float("-inf")
    starts = indices * block_size
    ids = starts.unsqueeze(-1) + torch.arange(block_size, device=scores.device)  # [b, s, kb, bs]
    ids = torch.where(keep.unsqueeze(-1), ids, -1).flatten(-2)
    # Drop positions past the end or not visible to this query.
    in_range = (ids >= 0) & (ids < n)
    visible = torch.gather(torch.isfinite(scores), 2, ids.clamp(0, n - 1)) & in_range
    ids = torch.where(visible, ids, -1)
    if kb < top_blocks:
        ids = F.pad(ids, (0, (top_blocks - kb) * block_size), value=-1)
    return ids
