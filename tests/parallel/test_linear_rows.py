"""The local GEMM of every linear layer under autograd (``parallel.linear._linear``): the same
values as ``F.linear``, and an input gradient that owns its storage, so that autograd can sum
the gradients of an input read by several layers in place (what keeps a CSA2 layer's backward
from holding three ``[s, d]`` input gradients at once: bench/csa2_vs_dense.py); and the CSA2
compressor's stacked C/Z projection against two separate ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.parallel.linear import ReplicatedLinear, _linear, _RowsLinear


@pytest.mark.parametrize("shape,out", [((2, 37, 48), 24), ((1, 300, 96), 40), ((3, 5, 7, 16), 9)])
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_rows_linear_equals_f_linear_bit_for_bit(shape, out, weight_grad, transposed):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, generator=g)
    if transposed:  # a non-contiguous input (its rows are gathered by reshape on both paths)
        x0 = x0.transpose(0, 1).contiguous().transpose(0, 1)
    w0 = torch.randn(out, shape[-1], generator=g)
    grad = torch.randn(*shape[:-1], out, generator=g)
    results = []
    for fn in (F.linear, _RowsLinear.apply):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_(weight_grad)
        if transposed:
            x = x0.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
        y = fn(x, w)
        y.backward(grad)
        results.append((y, x.grad, w.grad))
    (y1, gx1, gw1), (y2, gx2, gw2) = results
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert (gw1 is None and gw2 is None) if not weight_grad else torch.equal(gw1, gw2)


def test_rows_linear_input_gradient_is_not_a_view():
    """F.linear's gradient of a [b, s, in] input is a view of the GEMM's [b*s, in] result; that
    view's base is a second owner of the storage, which makes autograd's sum out of place."""
    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(_RowsLinear.apply(x, w), x, torch.ones(2, 8, 4))
    assert gx._base is None and gx.shape == x.shape and gx.is_contiguous()


def test_linear_uses_rows_gemm_only_under_autograd():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(5, 8)
    assert type(_linear(x, w).grad_fn).__name__ == "_RowsLinearBackward"
    with torch.no_grad():
        assert torch.equal(_linear(x, w), F.linear(x, w))
    assert _linear(x.detach(), w).grad_fn is None
    assert type(_linear(x[0], w).grad_fn).__name__ != "_RowsLinearBackward"  # 2-D input: F.linear


def test_compressor_stacked_projection_matches_two():
    """C and Z from one GEMM over [W^KV; W^Z]: the same outputs and weight gradients as two
    GEMMs, the input gradient equal to float round-off (one sum over 2 hd instead of two)."""
    from pathlib import Path

    import yaml

    from megatron_s2.models.v41.config import V41Config
    from megatron_s2.config.schema import from_mapping
    from megatron_s2.models.v41.attention.compressor import Compressor

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "models" / "tiny.yaml"
    cfg = from_mapping(V41Config, yaml.safe_load(tiny.read_text()))
    d, hd = cfg.hidden_size, cfg.head_dim
    comp = Compressor(cfg, ratio=2)
    g = torch.Generator().manual_seed(1)
    for p in comp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x0 = torch.randn(2, 12, d, generator=g)
    dkv, dgate = torch.randn(2, 12, hd, generator=g), torch.randn(2, 12, hd, generator=g)

    x = x0.clone().requires_grad_()
    kv, gate = comp.project(x)
    assert type(kv.grad_fn).__name__ == "SplitWithSizesBackward0"  # the stacked GEMM ran
    torch.autograd.backward([kv, gate], [dkv, dgate])
    stacked = (kv.detach(), gate.detach(), x.grad, comp.linear_kv.weight.grad, comp.linear_gate.weight.grad)

    comp.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    kv2, gate2 = comp.linear_kv(x), comp.linear_gate(x)
    torch.autograd.backward([kv2, gate2], [dkv, dgate])
    separate = (kv2.detach(), gate2.detach(), x.grad, comp.linear_kv.weight.grad, comp.linear_gate.weight.grad)
    for name, a, b in zip(("C", "Z", "dx", "dW_kv", "dW_z"), stacked, separate):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert isinstance(comp.linear_kv, ReplicatedLinear)
