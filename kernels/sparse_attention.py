"""Sparse attention over gathered KV entries with an attention sink (report §2.3).

Every CSA2 query attends, in ONE softmax, to its layer-local sliding window and to the
top-k compressed main-KV entries selected by the indexer; both live in one KV array and
each query lists the entries it may read (``-1`` = empty slot). The KV latent is shared by
all heads and serves as both key and value (one latent for all heads, §2.3), and a learnable
per-head sink logit joins the softmax denominator (reference semantics).

This is the PyTorch reference: it gathers [b, chunk, k, d] entries per query chunk, so its
memory is O(s * k * d) rather than O(s^2). A fused GPU kernel can replace it behind
:func:`sparse_attention` without changing callers.
"""

from __future__ import annotations

import torch

from megatron_s2.models.v41.precision import wide

__all__ = ["sparse_attention", "sparse_attention_reference"]


def sparse_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                               sink: torch.Tensor | None, scale: float, *, split: int | None = None,
                               chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of each query over its listed KV entries.

    q: [b, s, h, d]; kv: [b, n, d]; indices: [b, s, k] int (-1 = none); sink: [h] or None.
    ``split``: if given, also return the attention probability mass of entries
    ``indices[..., split:]`` summed over the local heads, detached ([b, s, k - split]); the
    indexer is trained to match it.
    Returns (output [b, s, h, d], mass or None).
    """
    b, s, h, d = q.shape
    outs, masses = [], []
    for start in range(0, s, chunk):
        idx = indices[:, start:start + chunk]
        valid = idx >= 0
        flat = idx.clamp_min(0).reshape(b, -1)
        keys = torch.gather(kv, 1, flat.unsqueeze(-1).expand(-1, -1, kv.size(-1)))
        keys = keys.view(b, idx.size(1), idx.size(2), kv.size(-1)).to(q.dtype)
        scores = torch.einsum("bshd,bskd->bshk", wide(q[:, start:start + chunk]), wide(keys)) * scale
        scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
        if sink is not None:
            logits = torch.cat([scores, wide(sink).to(scores.dtype).view(1, 1, h, 1).expand(b, idx.size(1), h, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)
        outs.append(torch.einsum("bshk,bskd->bshd", probs, wide(keys).to(probs.dtype)).to(q.dtype))
        if split is not None:
            masses.append(probs[..., split:].detach().sum(dim=2))
    out = torch.cat(outs, dim=1)
    mass = torch.cat(masses, dim=1) if split is not None else None
    return out, mass


def sparse_attention(q, kv, indices, sink, scale, *, split=None, chunk=1024):
    """Dispatch point for the sparse attention kernel (only the reference exists today)."""
    return sparse_attention_reference(q, kv, indices, sink, scale, split=split, chunk=chunk)
