"""CSA2 sparse attention in Triton: forward, attention mass and backward (report §2.3).

Same semantics as :func:`megatron_s2.kernels.sparse_attention.sparse_attention_reference`
(window ∪ top-k entries of one KV array per query, one softmax with the per-head sink logit,
the KV latent as key and value of every head). The ``[b, s, k, d]`` gather is never
materialised: each program reads its query's entries block by block straight from ``kv``.

* **Forward** — one program per (token, block of heads): the token's entry list is streamed
  in blocks of ``BLOCK_K`` rows; all heads of the block share each loaded KV tile (one latent
  for all heads, so a head block is a small ``[BLOCK_H, d] x [d, BLOCK_K]`` GEMM, as in
  MQA-style decoding). Online softmax (running max / sum); the sink joins the denominator at
  the end. Stores the output and the log-sum-exp ``lse [b, s, h]`` (float32).
* **Mass** (``split``) — a second small kernel re-reads entries ``split..k`` and sums
  ``exp(score - lse)`` over all heads: the detached mass the indexer's alignment loss uses.
* **Backward** — FlashAttention-2 style recompute per (token, head block):
  ``p = exp(s - lse)``, ``ds = p (dO.kv - delta)`` with ``delta = dO . O``;
  ``dq`` is written once; ``dkv`` gets ``scale ds^T q + p^T dO`` by **atomic adds** into a
  float32 buffer (many queries read one entry; the order of float additions, hence the last
  bits, is not deterministic on a GPU). ``dsink = -sum p_sink delta`` is a reduction over
  ``[b, s, h]`` done in PyTorch.

Float32 inputs use IEEE float32 dot products (no TF32), bfloat16/float16 inputs use the
tensor cores with float32 accumulation. On CPU the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_s2.kernels.triton.common import dot_dtype, dot_precision

__all__ = ["sparse_attention_triton"]


@triton.jit
def _fwd_kernel(Q, KV, IDX, SINK, OUT, LSE, scale, S, H, N, K, D,
                HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hm = offs_h < H
    dm = offs_d < D
    row = (b * S + t).to(tl.int64)
    hd = hm[:, None] & dm[None, :]
    q = tl.load(Q + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd, other=0.0).to(DOT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(IDX + row * K + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        keys = tl.load(KV + (b * N + idx[:, None]) * D + offs_d[None, :], mask=valid[:, None] & dm[None, :],
                       other=0.0).to(Q.dtype.element_ty).to(DOT)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), keys, input_precision=PRECISION)
        m_i = m_new
    if HAS_SINK:
        sink = tl.load(SINK + offs_h, mask=hm, other=0.0).to(tl.float32)
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_f)
        l_i = l_i * alpha + tl.exp(sink - m_f)
        acc = acc * alpha[:, None]
        m_i = m_f
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, 0.0, m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(OUT + (row * H + offs_h[:, None]) * D + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=hm[:, None] & dm[None, :])
    tl.store(LSE + row * H + offs_h, lse, mask=hm)


@triton.jit
def _mass_kernel(Q, KV, IDX, LSE, MASS, scale, S, H, N, K, D, SPLIT,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                 PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    k0 = SPLIT + tl.program_id(2) * BLOCK_K
    row = (b * S + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < D
    offs_k = k0 + tl.arange(0, BLOCK_K)
    km = offs_k < K
    idx = tl.load(IDX + row * K + offs_k, mask=km, other=-1).to(tl.int64)
    valid = idx >= 0
    keys = tl.load(KV + (b * N + idx[:, None]) * D + offs_d[None, :], mask=valid[:, None] & dm[None, :],
                   other=0.0).to(Q.dtype.element_ty).to(DOT)
    total = tl.zeros([BLOCK_K], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hm = offs_h < H
        hd = hm[:, None] & dm[None, :]
        q = tl.load(Q + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd, other=0.0).to(DOT)
        lse = tl.load(LSE + row * H + offs_h, mask=hm, other=0.0)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        p = tl.exp(s - lse[:, None])
        p = tl.where(hm[:, None] & valid[None, :], p, 0.0)
        total += tl.sum(p, 0)
    tl.store(MASS + row * (K - SPLIT) + offs_k - SPLIT, total, mask=km)


@triton.jit
def _bwd_kernel(Q, KV, IDX, LSE, DO, DELTA, DQ, DKV, scale, S, H, N, K, D,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hm = offs_h < H
    dm = offs_d < D
    hd = hm[:, None] & dm[None, :]
    row = (b * S + t).to(tl.int64)
    q = tl.load(Q + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd, other=0.0).to(DOT)
    do = tl.load(DO + (row * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd, other=0.0).to(DOT)
    lse = tl.load(LSE + row * H + offs_h, mask=hm, other=0.0)
    delta = tl.load(DELTA + row * H + offs_h, mask=hm, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(IDX + row * K + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        keys = tl.load(KV + (b * N + idx[:, None]) * D + offs_d[None, :], mask=valid[:, None] & dm[None, :],
                       other=0.0).to(Q.dtype.element_ty).to(DOT)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        p = tl.exp(s - lse[:, None])
        p = tl.where(hm[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(keys), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(DOT), keys, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds.to(DOT)), q, input_precision=PRECISION) * scale
        dk += tl.dot(tl.trans(p.to(DOT)), do, input_precision=PRECISION)
        tl.atomic_add(DKV + (b * N + idx[:, None]) * D + offs_d[None, :], dk, mask=valid[:, None] & dm[None, :])
    tl.store(DQ + (row * H + offs_h[:, None]) * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=hd)


def _blocks(h: int, d: int, k: int) -> tuple[int, int, int]:
    block_h = min(max(triton.next_power_of_2(h), 16), 16)
    block_k = min(max(triton.next_power_of_2(k), 16), 32)
    return block_h, block_k, max(triton.next_power_of_2(d), 16)


def _check(q, kv, indices, sink):
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3 or q.size(-1) != kv.size(-1):
        raise ValueError(f"sparse attention: q [b,s,h,d], kv [b,n,d], indices [b,s,k] expected, got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if sink is not None and sink.shape != (q.size(2),):
        raise ValueError(f"sparse attention: sink must have shape ({q.size(2)},), got {tuple(sink.shape)}")


def attention_forward(q, kv, indices, sink, scale):
    """(out [b,s,h,d] in q.dtype, lse [b,s,h] float32)."""
    _check(q, kv, indices, sink)
    b, s, h, d = q.shape
    n, k = kv.size(1), indices.size(2)
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    bh, bk, bd = _blocks(h, d, k)
    sink_arg = sink.contiguous() if sink is not None else lse  # dummy pointer when absent
    _fwd_kernel[(s, b, triton.cdiv(h, bh))](q, kv, indices, sink_arg, out, lse, scale, s, h, n, k, d,
                                            HAS_SINK=sink is not None, BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd,
                                            DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype))
    return out, lse


def attention_mass(q, kv, indices, lse, scale, split):
    """Detached probability mass of entries ``split..k`` summed over heads: [b, s, k - split] float32."""
    b, s, h, d = q.shape
    n, k = kv.size(1), indices.size(2)
    mass = torch.zeros(b, s, max(k - split, 0), dtype=torch.float32, device=q.device)
    if k - split <= 0:
        return mass
    bh, bk, bd = _blocks(h, d, k)
    _mass_kernel[(s, b, triton.cdiv(k - split, bk))](q.contiguous(), kv.contiguous(), indices.contiguous(), lse, mass,
                                                     scale, s, h, n, k, d, split, BLOCK_H=bh, BLOCK_K=bk,
                                                     BLOCK_D=bd,
                                                     DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype))
    return mass


def attention_backward(q, kv, indices, sink, scale, out, lse, grad_out):
    b, s, h, d = q.shape
    n, k = kv.size(1), indices.size(2)
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    bh, bk, bd = _blocks(h, d, k)
    _bwd_kernel[(s, b, triton.cdiv(h, bh))](q.contiguous(), kv.contiguous(), indices.contiguous(), lse,
                                            grad_out.contiguous(), delta, dq, dkv, scale, s, h, n, k, d,
                                            BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd, DOT=dot_dtype(q.dtype),
                                            PRECISION=dot_precision(q.dtype))
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.float().view(1, 1, h) - lse)
        dsink = (-(p_sink * delta).sum(dim=(0, 1))).to(sink.dtype)
    return dq, dkv.to(kv.dtype), dsink


class _SparseAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sink, indices, scale, split):
        out, lse = attention_forward(q, kv, indices, sink, scale)
        mass = attention_mass(q, kv, indices, lse, scale, split).to(torch.promote_types(q.dtype, torch.float32)) \
            if split is not None else None
        ctx.save_for_backward(q, kv, sink, indices, out, lse)
        ctx.scale = scale
        if mass is not None:
            ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, grad_out, _grad_mass):
        q, kv, sink, indices, out, lse = ctx.saved_tensors
        dq, dkv, dsink = attention_backward(q, kv, indices, sink, ctx.scale, out, lse, grad_out)
        return dq, dkv, dsink, None, None, None


def sparse_attention_triton(q, kv, indices, sink, scale, *, split=None):
    """Triton implementation of :func:`megatron_s2.kernels.sparse_attention.sparse_attention`."""
    return _SparseAttentionTriton.apply(q, kv, sink, indices, float(scale), split)
