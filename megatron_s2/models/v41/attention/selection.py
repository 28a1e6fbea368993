"""Top-k with a defined tie-break, for the indexer's entry and block selection (report §2.3).

Index scores are sums of ReLU'd dot products, so exact ties are common: every entry whose
dot products are all negative scores exactly 0. ``torch.topk`` breaks ties arbitrarily, and
in practice differently for different numbers of columns — so a whole-sequence forward
(which scores all n entries of the sequence) and an incremental decode step (which scores
the entries cached so far) could select different entries for the same query. This
selection keeps, among equal scores, the entries with the lower index (older entries, or
earlier candidate-pool slots), which does not depend on how many columns follow.
"""

from __future__ import annotations

import torch

__all__ = ["topk_lowest_index_on_ties"]


def topk_lowest_index_on_ties(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along the last dimension; among equal
    scores the lower indices are taken. Ordered like a stable descending sort: by score,
    then by index."""
    n = scores.size(-1)
    threshold = scores.topk(k, dim=-1).values[..., -1:]           # the k-th largest score
    above = scores > threshold
    tied = scores == threshold
    room = k - above.sum(-1, keepdim=True)                          # tied entries still needed
    chosen = above | (tied & (tied.cumsum(-1) <= room))             # exactly k per row
    key = chosen.to(torch.int64) * (n - torch.arange(n, device=scores.device))  # earlier first
    indices = key.topk(k, dim=-1).indices.sort(dim=-1).values  # the chosen set, by index
    values = torch.gather(scores, -1, indices)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return torch.gather(values, -1, order), torch.gather(indices, -1, order)
