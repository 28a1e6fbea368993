"""Sparse attention over gathered KV entries with an attention sink (report §2.3).

Every CSA2 query attends, in ONE softmax, to its layer-local sliding window and to the
top-k compressed main-KV entries selected by the indexer; both live in one KV array and
each query lists the entries it may read (``-1`` = empty slot). The KV latent is shared by
all heads and serves as both key and value (one latent for all heads, §2.3), and a learnable
per-head sink logit joins the softmax denominator (reference semantics)::

    p[t,h,i] = exp(q[t,h].kv[idx[t,i]] * scale) / (exp(sink[h]) + sum_i' exp(...))
    out[t,h] = sum_i p[t,h,i] kv[idx[t,i]]

Implementations (same signature and semantics):

* :func:`sparse_attention_eager` — the plain PyTorch formula under autograd. It keeps the
  ``[b, chunk, k, d]`` gathers and probabilities of every chunk alive for backward, so its
  memory is O(s * k * d). It is kept as the oracle of the two below.
* :func:`sparse_attention_reference` — the memory-bounded reference: a custom autograd
  function that saves only its inputs and recomputes the gather and the softmax per query
  chunk in backward (O(chunk * k * d) transient memory). ``dkv`` is a scatter-add
  (``index_add_``) of every query's entry gradients, because many queries read one entry.
* :mod:`megatron_s2.kernels.triton.sparse_attention` — the Triton kernel (GPU, or CPU under
  ``TRITON_INTERPRET=1``), chosen by :func:`sparse_attention` on CUDA tensors.

Gradients (``P`` the probabilities, ``dP = dO . kv_i``, ``delta = sum_i P dP = dO . O``)::

    dS = P * (dP - delta);  dq = scale * dS kv;  dkv_i += scale * dS^T q + P^T dO (over heads)
    dsink[h] = - sum_t p_sink[t,h] * delta[t,h]
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.dispatch import use_triton
from megatron_s2.kernels.precision import cast, wide

__all__ = ["sparse_attention", "sparse_attention_reference", "sparse_attention_eager", "chunk_rows"]

CHUNK_ELEMENTS = 1 << 21
"""Transient budget of the memory-bounded reference: at most this many gathered elements
(``rows x k x d``, 8 MiB in float32) per query chunk."""


def chunk_rows(chunk: int, per_row: int, budget: int = CHUNK_ELEMENTS) -> int:
    """Query rows per chunk: ``chunk`` at most, fewer when one row gathers ``per_row`` elements."""
    return max(1, min(chunk, budget // max(per_row, 1)))


def _gather(kv: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv [b, n, d], idx [b, c, k] -> [b, c, k, d] (``-1`` reads row 0; the caller masks it)."""
    b = kv.size(0)
    flat = idx.clamp_min(0).reshape(b, -1)
    keys = torch.gather(kv, 1, flat.unsqueeze(-1).expand(-1, -1, kv.size(-1)))
    return cast(keys.view(b, idx.size(1), idx.size(2), kv.size(-1)), dtype)


def _chunk_probs(q_c: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities [b, c, h, k] of one chunk (wide dtype) and the sink's share [b, c, h]."""
    b, c, h = q_c.shape[:3]
    scores = torch.einsum("bshd,bskd->bshk", q_c, keys) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if sink is None:
        return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0), None
    logits = torch.cat([scores, cast(sink, scores.dtype).view(1, 1, h, 1).expand(b, c, h, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return probs[..., :-1], probs[..., -1]


def sparse_attention_eager(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                           sink: torch.Tensor | None, scale: float, *, split: int | None = None,
                           chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The formula under plain autograd (saves every chunk's gather): the oracle."""
    s = q.size(1)
    outs, masses = [], []
    for start in range(0, s, chunk):
        idx = indices[:, start:start + chunk]
        keys = wide(_gather(kv, idx, q.dtype))
        probs, _ = _chunk_probs(wide(q[:, start:start + chunk]), keys, idx >= 0,
                                None if sink is None else wide(sink), scale)
        outs.append(cast(torch.einsum("bshk,bskd->bshd", probs, cast(keys, probs.dtype)), q.dtype))
        if split is not None:
            masses.append(probs[..., split:].detach().sum(dim=2))
        del keys, probs  # freed before the next chunk's gather
    return torch.cat(outs, dim=1), (torch.cat(masses, dim=1) if split is not None else None)


class _SparseAttention(torch.autograd.Function):
    """Saves (q, kv, indices, sink) only; recomputes each chunk in backward."""

    @staticmethod
    def forward(ctx, q, kv, sink, indices, scale, split, chunk):
        with torch.no_grad():
            out, mass = sparse_attention_eager(q, kv, indices, sink, scale, split=split, chunk=chunk)
        ctx.save_for_backward(q, kv, sink, indices)
        ctx.scale, ctx.chunk = scale, chunk
        if mass is not None:
            ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, grad_out, _grad_mass):
        q, kv, sink, indices = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        b, s, h, d = q.shape
        n = kv.size(1)
        work = wide(q).dtype
        sink_w = None if sink is None else sink.to(work)
        dq = torch.empty(q.shape, dtype=work, device=q.device)
        dkv = torch.zeros(b, n, d, dtype=work, device=kv.device)  # returned as is, not as a view
        dkv_rows = dkv.view(b * n, d)
        dsink = None if sink is None else torch.zeros(h, dtype=work, device=q.device)
        offsets = (torch.arange(b, device=indices.device) * n).view(b, 1, 1)
        for start in range(0, s, chunk):
            sl = slice(start, start + chunk)
            idx = indices[:, sl]
            valid = idx >= 0
            q_c = q[:, sl].to(work)
            keys = _gather(kv, idx, q.dtype).to(work)
            probs, p_sink = _chunk_probs(q_c, keys, valid, sink_w, scale)
            do = grad_out[:, sl].to(work)
            dp = torch.einsum("bshd,bskd->bshk", do, keys)
            delta = (probs * dp).sum(-1)  # = dO . O
            ds = probs * (dp - delta.unsqueeze(-1))
            dq[:, sl] = torch.einsum("bshk,bskd->bshd", ds, keys) * scale
            del keys  # the chunk's [b, c, k, d] buffers, at most two at a time from here on
            # (s q) * scale + p dO, then the mask, as in-place steps: the same values, no third buffer
            dkeys = torch.einsum("bshk,bshd->bskd", ds, q_c).mul_(scale)
            dkeys.add_(torch.einsum("bshk,bshd->bskd", probs, do)).mul_(valid.unsqueeze(-1))
            flat = (idx.clamp_min(0) + offsets).reshape(-1)
            dkv_rows.index_add_(0, flat, dkeys.reshape(-1, d))
            if dsink is not None:
                dsink -= (p_sink * delta).sum(dim=(0, 1))
            del dkeys, probs, p_sink, dp, ds, delta, do, q_c  # freed before the next chunk's gather
        return (dq.to(q.dtype), dkv.to(kv.dtype),
                None if dsink is None else dsink.to(sink.dtype), None, None, None, None)


def sparse_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                               sink: torch.Tensor | None, scale: float, *, split: int | None = None,
                               chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of each query over its listed KV entries (memory-bounded PyTorch reference).

    q: [b, s, h, d]; kv: [b, n, d]; indices: [b, s, k] int (-1 = none); sink: [h] or None.
    ``split``: if given, also return the attention probability mass of entries
    ``indices[..., split:]`` summed over the local heads, detached ([b, s, k - split]); the
    indexer is trained to match it.
    Returns (output [b, s, h, d] in q's dtype, mass or None).
    """
    chunk = chunk_rows(chunk, indices.size(-1) * kv.size(-1))
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kv, sink))):
        # inference: the Function's own forward without its context (per layer per decode step)
        return sparse_attention_eager(q, kv, indices, sink, scale, split=split, chunk=chunk)
    return _SparseAttention.apply(q, kv, sink, indices, scale, split, chunk)


def sparse_attention(q, kv, indices, sink, scale, *, split=None, chunk=1024):
    """Dispatch: the Triton kernel on CUDA tensors (when Triton imports), else the reference."""
    if use_triton(q, kv, indices):
        from megatron_s2.kernels.triton.sparse_attention import sparse_attention_triton

        return sparse_attention_triton(q, kv, indices, sink, scale, split=split)
    return sparse_attention_reference(q, kv, indices, sink, scale, split=split, chunk=chunk)
