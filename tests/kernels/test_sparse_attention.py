"""The memory-bounded sparse-attention reference (custom autograd, per-chunk recompute) against
the plain-autograd formula it replaces: float64 gradcheck, equal outputs and gradients, mass,
empty rows, and that backward keeps no ``[b, s, k, d]`` gather alive."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels.sparse_attention import sparse_attention_eager, sparse_attention_reference


def random_case(b=2, s=9, h=3, d=8, n=11, k=5, dtype=torch.float64, seed=0, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    kv = torch.randn(b, n, d, generator=g, dtype=dtype)
    sink = torch.randn(h, generator=g, dtype=dtype)
    idx = torch.randint(0, n, (b, s, k), generator=g)
    idx = torch.where(torch.rand(b, s, k, generator=g) < 0.3, -1, idx)  # repeats and holes
    if empty_row:
        idx[0, 0] = -1
    return q, kv, sink, idx


@pytest.mark.parametrize("with_sink", [True, False])
def test_gradcheck_float64(with_sink):
    q, kv, sink, idx = random_case(b=1, s=5, h=2, d=4, n=6, k=4)
    leaves = [q.requires_grad_(), kv.requires_grad_()] + ([sink.requires_grad_()] if with_sink else [])

    def f(*xs):
        return sparse_attention_reference(xs[0], xs[1], idx, xs[2] if with_sink else None, 0.7, chunk=2)[0]

    torch.autograd.gradcheck(f, tuple(leaves))


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 4), (torch.float32, 1024), (torch.bfloat16, 3)])
def test_equals_plain_autograd(dtype, chunk):
    q, kv, sink, idx = random_case(dtype=dtype)
    sink = sink.float()
    a = [t.clone().requires_grad_() for t in (q, kv, sink)]
    r = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out, mass = sparse_attention_reference(a[0], a[1], idx, a[2], 0.35, split=2, chunk=chunk)
    ref, ref_mass = sparse_attention_eager(r[0], r[1], idx, r[2], 0.35, split=2, chunk=chunk)
    assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(mass, ref_mass)
    assert not mass.requires_grad
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    (out.float() * g.float()).sum().backward()
    (ref.float() * g.float()).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for x, y in zip(a, r):
        assert x.grad.dtype == y.grad.dtype
        torch.testing.assert_close(x.grad, y.grad, **tol)


def test_no_sink_empty_row_is_zero_with_finite_grads():
    q, kv, _, idx = random_case(dtype=torch.float32)
    q.requires_grad_(), kv.requires_grad_()
    out, _ = sparse_attention_reference(q, kv, idx, None, 0.5, chunk=4)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert torch.equal(q.grad[0, 0], torch.zeros_like(q.grad[0, 0]))


def test_backward_saves_no_gather():
    """Only the inputs are saved: the graph holds nothing of size s * k * d."""
    q, kv, sink, idx = random_case(b=1, s=64, h=2, d=16, n=32, k=24, dtype=torch.float32, empty_row=False)
    q.requires_grad_(), kv.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sparse_attention_reference(q, kv, idx, sink, 0.5, chunk=16)
    assert max(saved) == q.numel() and sum(saved) <= q.numel() + kv.numel() + idx.numel() + sink.numel()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sparse_attention_eager(q, kv, idx, sink, 0.5, chunk=16)
    assert max(saved) >= 16 * 24 * 16  # the old path keeps each chunk's gather
