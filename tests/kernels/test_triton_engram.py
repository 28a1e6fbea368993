"""Engram gather + FP8 Triton kernel against its PyTorch reference (kernels/engram.py): forward
bit-identical (float32 and bfloat16 tables, scale blocks of 32 and of a whole non-power-of-two
row, repeated ids, zero and extreme rows), backward equal to the embedding backward, and the
Engram table routed through the kernel by the dispatch."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels.engram import engram_rows, engram_rows_reference, fp8_row_block
from tests.kernels.conftest import require_triton

require_triton()
from megatron_s2.kernels.triton.engram import engram_rows_triton, scatter_row_grads  # noqa: E402


def table(rows, width, dtype, device):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(rows, width, generator=g) * torch.logspace(-6, 3, rows).unsqueeze(1)
    w[0] = 0.0
    w[1, ::3] = -0.0
    w[2] = 448.0 * 2.0 ** torch.arange(width) / 2.0 ** width  # values across many binades
    return w.to(device, dtype)


def hash_ids(rows, shape, device):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, rows, shape, generator=g)
    ids.view(-1)[:5] = 3  # one row read by several tokens
    ids.view(-1)[-1] = 0
    return ids.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 24])   # scale block 32, and one scale for a 24-wide row
@pytest.mark.parametrize("fp8", [True, False])
def test_forward_bit_exact_backward_equal(device, dtype, width, fp8):
    w = table(40, width, dtype, device).requires_grad_(True)
    ids = hash_ids(40, (2, 5, 3), device)
    out = engram_rows_triton(ids, w, fp8_row_block(width) if fp8 else 0)
    ref_w = w.detach().clone().requires_grad_(True)
    ref = engram_rows_reference(ids, ref_w, fp8)
    assert out.shape == (2, 5, 3, width) and out.dtype == dtype
    assert torch.equal(out.view(torch.uint8), ref.contiguous().view(torch.uint8))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    out.backward(g)
    ref.backward(g)
    assert w.grad.dtype == ref_w.grad.dtype
    # float32 sums in token order, rounded once to the table dtype ...
    exact = torch.zeros(w.shape, device=device).index_add_(0, ids.reshape(-1), g.reshape(-1, width).float())
    assert torch.equal(w.grad, exact.to(dtype))
    # ... which is the embedding backward (that one accumulates bfloat16 tables in bfloat16)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.float(), ref_w.grad.float(), **tol)


def test_row_gradients_are_summed_in_token_order(device):
    ids = torch.tensor([5, 1, 5, 5, 0], device=device)
    grad = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1e8, 0.5], [-1e8, 0.25], [7.0, 8.0]], device=device)
    gw = scatter_row_grads(ids, grad, 8)
    expected = torch.zeros(8, 2, device=device)
    expected[5] = (grad[0] + grad[2]) + grad[3]   # float32, in token order
    expected[1], expected[0] = grad[1], grad[4]
    assert torch.equal(gw, expected)


def test_dispatch_routes_the_engram_table_through_the_kernel(monkeypatch, tiny_table):
    ids, module = tiny_table
    ref_out = module(ids)
    ref_out.square().sum().backward()
    ref_grad = module.weight.grad.clone()
    module.weight.grad = None
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    calls = []
    import megatron_s2.kernels.triton.engram as kernel

    original = kernel.gather_quant_rows
    monkeypatch.setattr(kernel, "gather_quant_rows", lambda *a: calls.append(1) or original(*a))
    out = module(ids)
    out.square().sum().backward()
    assert calls and torch.equal(out, ref_out)
    torch.testing.assert_close(module.weight.grad, ref_grad, rtol=0, atol=1e-7)


@pytest.fixture
def tiny_table(device):
    from megatron_s2.models.v41.engram.table import EngramTable

    module = EngramTable(251, 32, fp8=True, init_std=0.02).to(device)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0)) if device.type == "cpu" \
            else module.weight.copy_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(0)))
    return hash_ids(251, (2, 7, 4), device), module


def test_reference_dispatch_without_triton_mode(monkeypatch, device):
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "reference")
    w = table(10, 32, torch.float32, device)
    ids = hash_ids(10, (3, 2), device)
    assert torch.equal(engram_rows(ids, w, True), engram_rows_reference(ids, w, True))
