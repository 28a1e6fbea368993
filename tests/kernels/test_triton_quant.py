"""Triton FP4 E2M1/E4M3, MXFP4 and FP8 quantisers: bit-identical to the packed-format
references (kernels/quant_formats.py) and to the reference fake-quantisers (kernels/quantize.py),
including ties, zeros, signed zeros, subnormal E4M3 scales and bfloat16 inputs."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels import quant_formats as formats
from megatron_s2.kernels import quantize
from tests.kernels.conftest import require_triton

require_triton()
from megatron_s2.kernels.triton.quant import dequantize_triton, quantize_triton  # noqa: E402

CASES = {
    "fp4_e4m3": (formats.pack_fp4_e4m3, formats.unpack_fp4_e4m3, lambda x: quantize.fake_quant_reference(x, "fp4_e4m3", 16)),
    "mxfp4": (formats.pack_mxfp4, formats.unpack_mxfp4, lambda x: quantize.fake_quant_reference(x, "mxfp4", 32)),
    "fp8": (formats.pack_fp8, formats.unpack_fp8, lambda x: quantize.fake_quant_reference(x, "fp8", 32)),
}


def hard_values(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-12, 3, 40).unsqueeze(1)  # 1e-12 .. 1e3 magnitudes
    x[0, :32] = 0.0
    x[1, 3] = -0.0
    x[2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 8) * 0.5  # E2M1 midpoints after scaling
    x[3] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8) * -1.0
    return x.to(device, dtype)


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_exact_against_references(device, fmt, dtype):
    pack, unpack, fq = CASES[fmt]
    x = hard_values(device, dtype)
    deq, codes, scales = quantize_triton(x, fmt, packed=True)
    ref_codes, ref_scales = pack(x)
    assert torch.equal(bits(codes), bits(ref_codes)) and codes.dtype == ref_codes.dtype
    assert torch.equal(bits(scales), bits(ref_scales)) and scales.dtype == ref_scales.dtype
    assert deq.dtype == dtype and torch.equal(bits(x + (deq - x)), bits(fq(x)))  # the straight-through step
    assert torch.equal(bits(dequantize_triton(codes, scales, fmt)), bits(unpack(ref_codes, ref_scales)))


@pytest.mark.parametrize("fmt", list(CASES))
def test_dispatch_with_kernels_forced(device, monkeypatch, fmt):
    """The public dispatchers (what the model and the inference engine call) with the Triton
    path forced: same bits, straight-through gradient."""
    x = hard_values(device)[:8].requires_grad_()
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    y = getattr(quantize, f"fake_quant_{fmt}")(x)
    codes, scales = getattr(quantize, f"pack_{fmt}")(x.detach())
    back = getattr(quantize, f"unpack_{fmt}")(codes, scales)
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "reference")
    assert torch.equal(bits(y.detach()), bits(getattr(quantize, f"fake_quant_{fmt}")(x).detach()))
    assert torch.equal(bits(back), bits(getattr(quantize, f"unpack_{fmt}")(codes, scales)))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
