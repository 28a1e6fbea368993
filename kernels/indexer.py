"""Lightning-indexer scores (report §2.3; DeepSeek-V3.2 indexer semantics).

    I(t, j) = sum_h w[t, h] * ReLU(q[t, h] . K[j])

Two shapes of the same score, each a dispatch function (Triton on CUDA, PyTorch elsewhere):

* :func:`indexer_scores` — every query against every entry ``K [b, n, d]`` -> ``[b, s, n]``
  (the indexer's full scan before top-k; no autograd). The Triton kernel never forms the
  ``[b, s, h, n]`` logits the einsum reference builds: each program accumulates the head sum
  of one ``[BLOCK_S, BLOCK_N]`` tile and can fuse the causal / document visibility mask
  (``-inf`` on invisible entries, the input of top-k).
* :func:`indexer_gathered_scores` — each query against its own listed entries ``ids [b, s, k]``
  (``-1`` = none, score 0) -> ``[b, s, k]`` with gradients to ``q``, ``w`` and ``K`` (the
  indexer's alignment loss). The reference is a custom autograd function that recomputes the
  ``[b, chunk, k, d]`` gather per query chunk in backward instead of keeping it alive, and
  scatter-adds ``dK`` (many queries read one entry).

Gradients (``l = q . K_j``, ``g`` the incoming gradient of I)::

    dw[t,h] = sum_j g[t,j] ReLU(l);  dl = g w [l > 0];  dq = sum_j dl K_j;  dK_j += sum_{t,h} dl q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_s2.kernels.dispatch import use_triton
from megatron_s2.kernels.sparse_attention import chunk_rows
from megatron_s2.kernels.precision import wide

__all__ = ["indexer_scores", "indexer_scores_reference", "indexer_gathered_scores",
           "indexer_gathered_scores_reference", "masked_indexer_scores"]


def indexer_scores_reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [b,s,h,d], k [b,n,d], w [b,s,h] -> [b,s,n] (the formula, as ``Indexer._score``)."""
    return (F.relu(torch.einsum("bshd,bnd->bshn", q, k)) * w.unsqueeze(-1)).sum(dim=2)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Dispatch of :func:`indexer_scores_reference` (no autograd on the Triton path)."""
    if use_triton(q, k, w) and not torch.is_grad_enabled():
        from megatron_s2.kernels.triton.indexer import indexer_scores_triton

        return indexer_scores_triton(q, k, w)
    return indexer_scores_reference(q, k, w)


def masked_indexer_scores(q, k, w, visible_entries: torch.Tensor, q_doc=None, e_doc=None) -> torch.Tensor:
    """Scores with invisible entries at ``-inf``: entry j is visible to query t when
    ``j < visible_entries[b, t]`` and (with documents) ``e_doc[b, j] == q_doc[b, t]``
    (:func:`megatron_s2.models.v41.attention.visibility.compressed_visible`). Fused in the
    Triton kernel; the reference masks the scores afterwards."""
    if use_triton(q, k, w):
        from megatron_s2.kernels.triton.indexer import indexer_scores_triton

        return indexer_scores_triton(q, k, w, visible_entries, q_doc, e_doc)
    scores = indexer_scores_reference(q, k, w)
    j = torch.arange(k.size(1), device=q.device)
    vis = j.view(1, 1, -1) < visible_entries.unsqueeze(-1)
    if q_doc is not None:
        vis = vis & (e_doc.unsqueeze(1) == q_doc.unsqueeze(-1))
    return scores.masked_fill(~vis, float("-inf"))


def _gather(k: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    b = k.size(0)
    rows = torch.gather(k, 1, ids.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, k.size(-1)))
    return rows.view(b, ids.size(1), ids.size(2), k.size(-1))


def _gathered_chunk(q, keys, w, valid):
    logits = torch.einsum("bshd,bskd->bshk", q, keys)
    return logits, (F.relu(logits) * w.unsqueeze(-1)).sum(dim=2) * valid


class _GatheredScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, ids, chunk):
        out = torch.empty(ids.shape, dtype=torch.promote_types(q.dtype, k.dtype), device=q.device)
        for start in range(0, ids.size(1), chunk):
            sl = slice(start, start + chunk)
            idx = ids[:, sl]
            out[:, sl] = _gathered_chunk(q[:, sl], _gather(k, idx), w[:, sl], idx >= 0)[1]
        ctx.save_for_backward(q, k, w, ids)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, w, ids = ctx.saved_tensors
        b, n, d = k.shape
        dq, dw = torch.empty_like(q), torch.empty_like(w)
        dk = torch.zeros(b * n, d, dtype=k.dtype, device=k.device)
        offsets = (torch.arange(b, device=ids.device) * n).view(b, 1, 1)
        for start in range(0, ids.size(1), ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            idx = ids[:, sl]
            valid = idx >= 0
            keys = _gather(k, idx)
            logits = torch.einsum("bshd,bskd->bshk", q[:, sl], keys)
            g = (grad[:, sl] * valid).unsqueeze(2)  # [b, c, 1, k]
            dw[:, sl] = (g * F.relu(logits)).sum(-1)
            dl = g * w[:, sl].unsqueeze(-1) * (logits > 0)
            dq[:, sl] = torch.einsum("bshk,bskd->bshd", dl, keys)
            del keys
            dkeys = torch.einsum("bshk,bshd->bskd", dl, q[:, sl])
            dk.index_add_(0, (idx.clamp_min(0) + offsets).reshape(-1), dkeys.reshape(-1, d))
            del dkeys, logits, dl, g  # freed before the next chunk's gather
        return dq, dk.view(b, n, d), dw, None, None


def indexer_gathered_scores_reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                                      chunk: int = 1024) -> torch.Tensor:
    """q [b,s,h,d], k [b,n,d], w [b,s,h], ids [b,s,k] (-1 = none) -> [b,s,k] (0 where none)."""
    return _GatheredScores.apply(q, k, w, ids, chunk_rows(chunk, ids.size(-1) * k.size(-1)))


def indexer_gathered_scores(q, k, w, ids, chunk: int = 1024):
    """Dispatch of :func:`indexer_gathered_scores_reference`."""
    if use_triton(q, k, w, ids):
        from megatron_s2.kernels.triton.indexer import indexer_gathered_scores_triton

        return indexer_gathered_scores_triton(q, k, w, ids)
    return indexer_gathered_scores_reference(q, k, w, ids, chunk)


def _eager_gathered(q, k, w, ids):
    """The formula under plain autograd (test oracle)."""
    return _gathered_chunk(wide(q), wide(_gather(k, ids)), wide(w), ids >= 0)[1]
