"""Lightning-indexer scores in Triton (oracle: :mod:`megatron_s2.kernels.indexer`).

* :func:`indexer_scores_triton` — the full scan ``I[b, t, j] = sum_h w ReLU(q_h . K_j)``: one
  program per ``[BLOCK_S, BLOCK_N]`` tile of (queries, entries) loops over the heads and keeps
  only the head sum (never the ``[b, s, h, n]`` logits). The causal and document visibility of
  compressed entries is fused: entry ``j`` is kept when ``j < visible[b, t]`` and, with
  documents, ``e_doc[b, j] == q_doc[b, t]``; other entries get ``-inf`` (top-k input).
* :func:`indexer_gathered_scores_triton` — scores of each query's listed entries ``ids`` with
  autograd: forward one program per token (all heads), backward one program per (token,
  block of heads) recomputing the logits; ``dK`` by atomic adds into a float32 buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_s2.kernels.triton.common import dot_dtype, dot_precision

__all__ = ["indexer_scores_triton", "indexer_gathered_scores_triton"]


@triton.jit
def _scan_kernel(Q, K, W, VIS, QDOC, EDOC, OUT, S, H, N, D,
                 HAS_VIS: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(2)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    sm, nm, dm = offs_s < S, offs_n < N, offs_d < D
    rows = (b * S + offs_s).to(tl.int64)
    keys = tl.load(K + (b * N + offs_n[:, None]).to(tl.int64) * D + offs_d[None, :], mask=nm[:, None] & dm[None, :],
                   other=0.0).to(DOT)
    acc = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)
    for h in range(0, H):
        q = tl.load(Q + (rows[:, None] * H + h) * D + offs_d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        w = tl.load(W + rows * H + h, mask=sm, other=0.0).to(tl.float32)
        logits = tl.dot(q.to(DOT), tl.trans(keys), input_precision=PRECISION)
        acc += tl.maximum(logits, 0.0) * w[:, None]
    if HAS_VIS:
        vis = tl.load(VIS + rows, mask=sm, other=0)
        keep = offs_n[None, :] < vis[:, None]
        if HAS_DOC:
            qd = tl.load(QDOC + rows, mask=sm, other=-1)
            ed = tl.load(EDOC + b * N + offs_n, mask=nm, other=-2)
            keep = keep & (ed[None, :] == qd[:, None])
        acc = tl.where(keep, acc, float("-inf"))
    tl.store(OUT + rows[:, None] * N + offs_n[None, :], acc, mask=sm[:, None] & nm[None, :])


def indexer_scores_triton(q, k, w, visible=None, q_doc=None, e_doc=None):
    """q [b,s,h,d], k [b,n,d], w [b,s,h] -> [b,s,n] float32 (``-inf`` where not visible)."""
    b, s, h, d = q.shape
    n = k.size(1)
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if s == 0 or n == 0:
        return out
    block_s, block_n, block_d = 16, 32, max(triton.next_power_of_2(d), 16)
    dummy = out
    vis = visible.contiguous() if visible is not None else dummy
    qd = q_doc.contiguous() if q_doc is not None else dummy
    ed = e_doc.contiguous() if e_doc is not None else dummy
    grid = (triton.cdiv(s, block_s), triton.cdiv(n, block_n), b)
    _scan_kernel[grid](q.contiguous(), k.contiguous(), w.contiguous(), vis, qd, ed, out, s, h, n, d,
                       HAS_VIS=visible is not None, HAS_DOC=q_doc is not None, BLOCK_S=block_s, BLOCK_N=block_n,
                       BLOCK_D=block_d, DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype))
    return out


@triton.jit
def _gathered_fwd(Q, K, W, IDS, OUT, S, H, N, KK, D, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    row = (b * S + t).to(tl.int64)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    km, dm = offs_k < KK, offs_d < D
    idx = tl.load(IDS + row * KK + offs_k, mask=km, other=-1).to(tl.int64)
    valid = idx >= 0
    keys = tl.load(K + (b * N + idx[:, None]) * D + offs_d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hm = offs_h < H
        q = tl.load(Q + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        w = tl.load(W + row * H + offs_h, mask=hm, other=0.0).to(tl.float32)
        logits = tl.dot(q.to(DOT), tl.trans(keys.to(DOT)), input_precision=PRECISION)
        acc += tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    tl.store(OUT + row * KK + offs_k, tl.where(valid, acc, 0.0), mask=km)


@triton.jit
def _gathered_bwd(Q, K, W, IDS, G, DQ, DK, DW, S, H, N, KK, D, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    row = (b * S + t).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hm, dm = offs_h < H, offs_d < D
    hd = hm[:, None] & dm[None, :]
    q = tl.load(Q + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd, other=0.0).to(DOT)
    w = tl.load(W + row * H + offs_h, mask=hm, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, KK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < KK
        idx = tl.load(IDS + row * KK + offs_k, mask=km, other=-1).to(tl.int64)
        valid = idx >= 0
        keys = tl.load(K + (b * N + idx[:, None]) * D + offs_d[None, :], mask=valid[:, None] & dm[None, :],
                       other=0.0).to(DOT)
        g = tl.load(G + row * KK + offs_k, mask=km, other=0.0).to(tl.float32)
        g = tl.where(valid, g, 0.0)
        logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        dw += tl.sum(tl.maximum(logits, 0.0) * g[None, :], 1)
        dl = tl.where(logits > 0, g[None, :] * w[:, None], 0.0)
        dq += tl.dot(dl.to(DOT), keys, input_precision=PRECISION)
        dkeys = tl.dot(tl.trans(dl.to(DOT)), q, input_precision=PRECISION)
        tl.atomic_add(DK + (b * N + idx[:, None]) * D + offs_d[None, :], dkeys, mask=valid[:, None] & dm[None, :])
    tl.store(DQ + (row * H + offs_h[:, None]) * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=hd)
    tl.store(DW + row * H + offs_h, dw.to(DW.dtype.element_ty), mask=hm)


def _gathered_blocks(h, d, kk):
    return 16, min(max(triton.next_power_of_2(kk), 16), 32), max(triton.next_power_of_2(d), 16)


class _GatheredScoresTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, ids):
        q, k, w, ids = q.contiguous(), k.contiguous(), w.contiguous(), ids.contiguous()
        b, s, h, d = q.shape
        n, kk = k.size(1), ids.size(2)
        out = torch.empty(b, s, kk, dtype=torch.promote_types(q.dtype, k.dtype), device=q.device)
        bh, bk, bd = _gathered_blocks(h, d, kk)
        if s and kk:
            _gathered_fwd[(s, b, triton.cdiv(kk, bk))](q, k, w, ids, out, s, h, n, kk, d, BLOCK_H=bh, BLOCK_K=bk,
                                                       BLOCK_D=bd, DOT=dot_dtype(q.dtype),
                                                       PRECISION=dot_precision(q.dtype))
        ctx.save_for_backward(q, k, w, ids)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, w, ids = ctx.saved_tensors
        b, s, h, d = q.shape
        n, kk = k.size(1), ids.size(2)
        dq, dw = torch.empty_like(q), torch.empty_like(w)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        bh, bk, bd = _gathered_blocks(h, d, kk)
        if s and kk:
            _gathered_bwd[(s, b, triton.cdiv(h, bh))](q, k, w, ids, grad.contiguous(), dq, dk, dw, s, h, n, kk, d,
                                                      BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd, DOT=dot_dtype(q.dtype),
                                                      PRECISION=dot_precision(q.dtype))
        else:
            dq.zero_(), dw.zero_()
        return dq, dk.to(k.dtype), dw, None


def indexer_gathered_scores_triton(q, k, w, ids):
    """q [b,s,h,d], k [b,n,d], w [b,s,h], ids [b,s,k] -> [b,s,k] (0 where ids = -1), autograd-aware."""
    return _GatheredScoresTriton.apply(q, k, w, ids)
