"""The release's block-scaled FP8 / FP4 formats (reference ``Linear`` / ``ParallelEngramEmbedding``)."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.checkpoint.hf.quant import block_sizes, dequantize, quantize_fp4, quantize_fp8


def test_fp4_nibble_order_and_scale():
    # byte 0x21: low nibble code 1 (0.5) is column 0, high nibble code 2 (1.0) column 1;
    # 0xF8: code 8 (-0.0) then code 15 (-6.0)
    packed = torch.tensor([[0x21, 0xF8] * 16], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    scale = torch.tensor([[4.0, 0.5]]).to(torch.float8_e8m0fnu)
    w = dequantize(packed, scale)
    assert w.shape == (1, 64)
    assert w[0, :4].tolist() == [2.0, 4.0, -0.0, -24.0]
    assert w[0, 32:36].tolist() == [0.25, 0.5, -0.0, -3.0]


def test_fp8_blocks_are_32_by_32():
    w = torch.ones(40, 64)
    w[32:] *= 3.0  # second row block
    values, scale = quantize_fp8(w)
    assert scale.shape == (2, 2) and values.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(values, scale), w)


def test_round_trips_and_errors():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    p, s = quantize_fp4(w)
    once = dequantize(p, s)
    assert (once - w).abs().max() <= 0.5 * s.float().max()  # half the largest E2M1 step at that scale
    assert torch.equal(dequantize(*quantize_fp4(once)), once)  # representable values are exact
    v, s = quantize_fp8(w, row_block=1)
    assert s.shape == (48, 2)
    assert ((dequantize(v, s) - w).abs() / w.abs().clamp_min(1e-3)).median() < 0.07
    assert block_sizes((70, 96), (3, 3)) == (32, 32)
    with pytest.raises(ValueError, match="does not tile"):
        block_sizes((70, 96), (5, 3))
    with pytest.raises(TypeError):
        dequantize(torch.zeros(2, 32, dtype=torch.bfloat16), torch.ones(2, 1))
