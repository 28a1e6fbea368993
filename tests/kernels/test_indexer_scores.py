"""Indexer scores: the memory-bounded gathered-score function (alignment loss) against the
plain formula (float64 gradcheck, equal values and gradients), and the masked full scan."""

from __future__ import annotations

import torch

from megatron_s2.kernels.indexer import (_eager_gathered, indexer_gathered_scores_reference, indexer_scores_reference,
                                         masked_indexer_scores)
from megatron_s2.models.v41.attention.visibility import compressed_visible


def case(dtype=torch.float64, b=2, s=7, h=3, d=8, n=10, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, key, w = (torch.randn(b, s, h, d, generator=g, dtype=dtype), torch.randn(b, n, d, generator=g, dtype=dtype),
                 torch.randn(b, s, h, generator=g, dtype=dtype))
    ids = torch.randint(0, n, (b, s, k), generator=g)
    ids = torch.where(torch.rand(b, s, k, generator=g) < 0.25, -1, ids)
    return q, key, w, ids


def test_gathered_scores_gradcheck_float64():
    q, key, w, ids = case(b=1, s=4, h=2, d=3, n=5, k=4)
    leaves = tuple(t.requires_grad_() for t in (q, key, w))
    torch.autograd.gradcheck(lambda a, b, c: indexer_gathered_scores_reference(a, b, c, ids, chunk=3), leaves)


def test_gathered_scores_equal_plain_autograd():
    q, key, w, ids = case(torch.float32)
    a = [t.clone().requires_grad_() for t in (q, key, w)]
    r = [t.clone().requires_grad_() for t in (q, key, w)]
    out = indexer_gathered_scores_reference(*a, ids, chunk=3)
    ref = _eager_gathered(*r, ids)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[ids < 0], torch.zeros_like(out[ids < 0]))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for x, y in zip(a, r):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)


def test_masked_scores_follow_compressed_visibility():
    q, key, w, _ = case(torch.float32, s=9, n=5)
    pos = torch.arange(9).expand(2, 9)
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    e_doc = doc[:, ::2][:, :5]
    out = masked_indexer_scores(q, key, w, torch.div(pos + 1, 2, rounding_mode="floor"), doc, e_doc)
    vis = compressed_visible(pos, 2, 5, doc, e_doc)
    ref = indexer_scores_reference(q, key, w).masked_fill(~vis, float("-inf"))
    assert torch.equal(out, ref)


# ---- Triton kernels (CPU: TRITON_INTERPRET=1) --------------------------------------------------------
def test_triton_full_scan_with_fused_visibility(device):
    from tests.kernels.conftest import require_triton

    require_triton()
    from megatron_s2.kernels.triton.indexer import indexer_scores_triton

    q, key, w, _ = (t.to(device) for t in case(torch.float32, s=9, n=37, d=16))
    pos = torch.arange(9, device=device).expand(2, 9)
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9], device=device)
    e_doc = torch.cat([doc[:, ::2], torch.full((2, 32), 1, device=device)], 1)[:, :37]
    visible = torch.div(pos + 1, 2, rounding_mode="floor")
    torch.testing.assert_close(indexer_scores_triton(q, key, w), indexer_scores_reference(q, key, w),
                               atol=1e-5, rtol=1e-5)
    ref = indexer_scores_reference(q, key, w).masked_fill(~compressed_visible(pos, 2, 37, doc, e_doc), float("-inf"))
    torch.testing.assert_close(indexer_scores_triton(q, key, w, visible, doc, e_doc), ref, atol=1e-5, rtol=1e-5)


def test_triton_gathered_scores_forward_backward(device):
    from tests.kernels.conftest import require_triton

    require_triton()
    from megatron_s2.kernels.triton.indexer import indexer_gathered_scores_triton

    q, key, w, ids = (t.to(device) for t in case(torch.float32, d=16, k=40))
    a = [t.clone().requires_grad_() for t in (q, key, w)]
    r = [t.clone().requires_grad_() for t in (q, key, w)]
    out = indexer_gathered_scores_triton(*a, ids)
    ref = _eager_gathered(*r, ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for x, y in zip(a, r):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)
