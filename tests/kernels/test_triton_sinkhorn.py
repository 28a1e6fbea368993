"""mHC's Sinkhorn-Knopp Triton kernel against its PyTorch reference (kernels/sinkhorn.py): equal
to float32 rounding for n = 4 (the model's hc_mult) and a non-power-of-two n, one matrix and
more than one program's block, few and many iterations; the dispatch routes mHC through it
and the backward still differentiates the reference."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels.sinkhorn import sinkhorn, sinkhorn_reference
from tests.kernels.conftest import require_triton

require_triton()
from megatron_s2.kernels.triton.sinkhorn import sinkhorn_triton  # noqa: E402


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("shape", [(1, 1), (3, 70)])  # one matrix; more than one program's 64
@pytest.mark.parametrize("iters", [1, 20])
def test_equals_the_reference_to_float32_rounding(device, n, shape, iters):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, n, n, generator=g) * 3).to(device)
    got, want = sinkhorn_triton(logits, iters, 1e-6), sinkhorn_reference(logits, iters, 1e-6)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-7)


def test_mhc_runs_through_the_kernel_and_differentiates_the_reference(device, monkeypatch):
    from megatron_s2.models.v41.mhc import sinkhorn_knopp

    import megatron_s2.kernels.triton.sinkhorn as kernel

    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(kernel, "sinkhorn_triton", lambda *a: calls.append(1) or sinkhorn_triton(*a))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 4, 4, generator=g).to(device).requires_grad_(True)
    out = sinkhorn_knopp(logits, 20, 1e-6)
    torch.testing.assert_close(out, sinkhorn_reference(logits.detach(), 20, 1e-6), rtol=4e-6, atol=1e-7)
    grad = torch.randn(out.shape, generator=g).to(device)
    (g_fused,) = torch.autograd.grad(out, logits, grad)
    (g_ref,) = torch.autograd.grad(sinkhorn_reference(logits, 20, 1e-6), logits, grad)
    assert torch.equal(g_fused, g_ref)
    with torch.no_grad():  # the inference path (no autograd.Function)
        torch.testing.assert_close(sinkhorn(logits, 20, 1e-6), sinkhorn_reference(logits, 20, 1e-6),
                                   rtol=4e-6, atol=1e-7)
    assert len(calls) == 2
