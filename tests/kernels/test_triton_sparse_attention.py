"""The Triton CSA2 sparse-attention kernel (forward, mass, backward) against the PyTorch
reference, on CPU under TRITON_INTERPRET=1 (on a GPU when one is visible)."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels.sparse_attention import sparse_attention, sparse_attention_eager
from tests.kernels.conftest import require_triton

require_triton()
from megatron_s2.kernels.triton.sparse_attention import sparse_attention_triton  # noqa: E402


def case(device, b=2, s=5, h=3, d=16, n=12, k=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, kv, sink = torch.randn(b, s, h, d, generator=g), torch.randn(b, n, d, generator=g), torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, s, k), generator=g)
    idx = torch.where(torch.rand(b, s, k, generator=g) < 0.3, -1, idx)
    idx[0, 0] = -1  # a query that reads nothing
    return [t.to(device) for t in (q, kv, sink, idx)]


@pytest.mark.parametrize("with_sink", [True, False])
def test_forward_backward_and_mass_match_reference(device, with_sink):
    q, kv, sink, idx = case(device)
    a = [t.clone().requires_grad_() for t in (q, kv, sink)]
    r = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out, mass = sparse_attention_triton(a[0], a[1], idx, a[2] if with_sink else None, 0.3, split=7)
    ref, ref_mass = sparse_attention_eager(r[0], r[1], idx, r[2] if with_sink else None, 0.3, split=7)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=2e-6, rtol=1e-5)
    assert not mass.requires_grad
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for x, y in zip(a, r):
        if y.grad is None:
            assert x.grad is None
        else:
            torch.testing.assert_close(x.grad, y.grad, atol=5e-6, rtol=1e-5)


def test_bfloat16_inputs(device):
    q, kv, sink, idx = case(device, h=4, d=32, k=9)
    q, kv = q.bfloat16(), kv.bfloat16()
    out, _ = sparse_attention_triton(q, kv, idx, sink, 0.2)
    ref, _ = sparse_attention_eager(q, kv, idx, sink, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_single_token_queries_and_dispatch(device, monkeypatch):
    """Decode shape (one query per sequence) through the dispatch function with the kernels forced."""
    q, kv, sink, idx = case(device, s=1, k=6)
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    out, _ = sparse_attention(q, kv, idx, sink, 0.5)
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "reference")
    ref, _ = sparse_attention(q, kv, idx, sink, 0.5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
