"""Top-k with a defined tie-break, for the indexer's entry and block selection (report §2.3).

Index scores are sums of ReLU'd dot products, so exact ties are common: every entry whose
dot products are all negative scores exactly 0 (and bfloat16 scores tie more often still).
``torch.topk`` breaks ties arbitrarily, and in practice differently for different numbers of
columns — so a whole-sequence forward (which scores all n entries of the sequence) and an
incremental decode step (which scores the entries cached so far) could select different
entries for the same query. Here, among equal scores the entry with the *higher* index wins
(the newer entry, the newer candidate block — as the candidate pool always keeps the newest
block — or the later candidate-pool slot). Entries past the query's visible range score
-inf and never displace a finite score, so the selection does not depend on how many of
them follow.
"""

from __future__ import annotations

import torch

__all__ = ["topk_newest_on_ties"]


def topk_newest_on_ties(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along the last dimension; among equal
    scores the higher indices are taken. Ordered by score, then by descending index."""
    n = scores.size(-1)
    threshold = scores.topk(k, dim=-1).values[..., -1:]           # the k-th largest score
    above = scores > threshold
    tied = scores == threshold
    room = k - above.sum(-1, keepdim=True)                          # tied entries still needed
    newest_first = tied.flip(-1).cumsum(-1).flip(-1)                # rank of a tie, counted from the end
    chosen = above | (tied & (newest_first <= room))                # exactly k per row
    key = chosen.to(torch.int64) * (torch.arange(n, device=scores.device) + 1)
    indices = key.topk(k, dim=-1).indices                           # the chosen set, newest first
    values = torch.gather(scores, -1, indices)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return torch.gather(values, -1, order), torch.gather(indices, -1, order)
