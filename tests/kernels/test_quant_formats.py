"""Packed KV storage formats: bytes and round trips bit-identical to the training fake-quantisers."""

import pytest
import torch

from megatron_s2.kernels.quant_formats import (pack_fp4_e4m3, pack_fp8, pack_mxfp4, packed_bytes, unpack_fp4_e4m3,
                                               unpack_fp8, unpack_mxfp4)
from megatron_s2.kernels.quantize import fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4

FORMATS = {
    "fp4_e4m3": (pack_fp4_e4m3, unpack_fp4_e4m3, fake_quant_fp4_e4m3, 16),
    "mxfp4": (pack_mxfp4, unpack_mxfp4, fake_quant_mxfp4, 32),
    "fp8": (pack_fp8, unpack_fp8, fake_quant_fp8, 32),
}


def _inputs(d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, 5, d, generator=g),
            torch.randn(2, d, generator=g) * 1e3,            # large magnitudes
            torch.randn(2, d, generator=g) * 1e-6,           # below the smallest scales
            torch.zeros(1, d),                               # all zero (scale floor)
            torch.tensor([[0.25, -0.25, 0.75, -5.0] * (d // 4)])]  # ties and exact grid points
    return rows


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("d", [64, 512])
def test_round_trip_equals_fake_quant(fmt, d):
    pack, unpack, fake, block = FORMATS[fmt]
    for x in _inputs(d):
        codes, scales = pack(x)
        assert codes.shape[:-1] == x.shape[:-1] and scales.shape == (*x.shape[:-1], d // block)
        got = unpack(codes, scales)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got, fake(x).float()), f"{fmt}: unpack(pack(x)) != fake_quant(x)"


@pytest.mark.parametrize("fmt,dim,expected", [("fp4_e4m3", 512, 288), ("mxfp4", 128, 68), ("fp8", 512, 528)])
def test_bytes_per_vector(fmt, dim, expected):
    pack = FORMATS[fmt][0]
    codes, scales = pack(torch.randn(7, dim))
    measured = (codes.numel() * codes.element_size() + scales.numel() * scales.element_size()) // 7
    assert measured == packed_bytes(fmt, dim) == expected


def test_bad_width_is_rejected():
    with pytest.raises(ValueError, match="multiple of the quantisation block"):
        pack_fp4_e4m3(torch.randn(2, 24))


def test_decoding_tables_return_the_definitions_bits():
    """The E2M1 / E8M0 lookup tables the KV reads use hold, for every byte, the bits of the
    nibble arithmetic and of ldexp (-0.0, subnormal 2^-127 and inf included)."""
    from megatron_s2.kernels.quant_formats import (_decode_e2m1, _decode_e2m1_nibbles, _from_e8m0,
                                                   _from_e8m0_ldexp)

    every = torch.arange(256, dtype=torch.uint8).view(16, 16)
    assert torch.equal(_decode_e2m1(every).view(torch.int32), _decode_e2m1_nibbles(every).view(torch.int32))
    assert torch.equal(_from_e8m0(every).view(torch.int32), _from_e8m0_ldexp(every).view(torch.int32))
