"""Which keys a query may read: causal sliding window and causally complete compressed
entries, never across a document boundary (sample-level attention masking, §4.2.2).

Positions are global token positions, so the same rules hold for a context-parallel chunk
whose keys (window halo, gathered compressed entries) come from other ranks. Document ids
must be non-decreasing along each row (packing guarantees it).
"""

from __future__ import annotations

import torch

__all__ = ["window_indices", "truncate_window", "compressed_visible", "entry_doc_ids"]


def window_indices(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                   q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Index (into the key array) of each of the ``window`` most recent positions p-W+1..p of
    every query, -1 where that key does not exist, is before 0, or is in another document.

    q_pos: [b, sq]; k_pos: [b, sk] ascending; returns [b, sq, window] int64.
    """
    b, sq = q_pos.shape
    offsets = torch.arange(window, device=q_pos.device)
    target = q_pos.unsqueeze(-1) - offsets  # [b, sq, w]: p, p-1, ..., p-W+1
    flat = target.reshape(b, -1).contiguous()
    idx = torch.searchsorted(k_pos.contiguous(), flat).clamp_max(k_pos.size(1) - 1)
    found = torch.gather(k_pos, 1, idx) == flat
    valid = found & (flat >= 0)
    if q_doc is not None:
        same = torch.gather(k_doc, 1, idx) == q_doc.unsqueeze(-1).expand(b, sq, window).reshape(b, -1)
        valid = valid & same
    return torch.where(valid, idx, -1).view(b, sq, window)


def truncate_window(indices: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    start: torch.Tensor) -> torch.Tensor:
    """SWA Bounded Replay in a whole-sequence forward (report §3.2.2): a query at position
    p >= s (s = ``start[b]``, the row's replay start) keeps only window keys at positions >= s,
    i.e. [max(s, p-W+1), p] — what an engine that ran this layer only from s saw. Queries before
    s keep their window (the engine never computed them; their outputs reach no later query
    once every window is truncated). ``indices`` [b, sq, W] index ``k_pos`` [b, sk]."""
    s = start.to(q_pos.device).view(-1, 1, 1)
    key_pos = torch.gather(k_pos, 1, indices.clamp_min(0).flatten(1)).view_as(indices)
    cut = (q_pos.unsqueeze(-1) >= s) & (key_pos < s) & (indices >= 0)
    return torch.where(cut, torch.full_like(indices, -1), indices)


def entry_doc_ids(doc_ids: torch.Tensor | None, ratio: int, num_entries: int) -> torch.Tensor | None:
    """Document of each compressed entry: the document of its group's first token."""
    if doc_ids is None:
        return None
    return doc_ids[:, : num_entries * ratio : ratio]


def compressed_visible(q_pos: torch.Tensor, ratio: int, num_entries: int, q_doc: torch.Tensor | None = None,
                       e_doc: torch.Tensor | None = None) -> torch.Tensor:
    """[b, sq, C] bool: entry j (tokens j*m .. j*m+m-1) is visible to the query at position
    p once the query has passed its last token (j < (p+1) // m) and it lies in the query's
    document."""
    n_visible = torch.div(q_pos + 1, ratio, rounding_mode="floor")
    j = torch.arange(num_entries, device=q_pos.device)
    vis = j.view(1, 1, -1) < n_visible.unsqueeze(-1)
    if q_doc is not None:
        vis = vis & (e_doc.unsqueeze(1) == q_doc.unsqueeze(-1))
    return vis
