"""FP4 (E2M1 + E4M3 scale), MXFP4 (E2M1 + E8M0 scale) and FP8 (E4M3 + E8M0 scale) in Triton.

Oracles, bit for bit: :mod:`megatron_s2.kernels.quant_formats` (packed bytes) and the
reference quantisers of :mod:`megatron_s2.kernels.quant_formats` (dequantised values). One kernel
quantises a tile of ``BLOCK_R`` scale blocks and writes any of: the dequantised values
(fake quantisation), the packed codes, the scale bytes. Rounding is done with integer and
exactly-representable float arithmetic so that it does not depend on the GPU's conversion
instructions (their saturation differs from PyTorch's casts):

* round to nearest even of ``v`` at a power-of-two quantum ``u``: ``((v/u + 2^23) - 2^23) * u``
  (exact for ``0 <= v/u < 2^22``; ``v/u`` is a multiplication by a power of two, exact);
* E2M1: quantum 0.5 below 2, 1 below 4, 2 up to the saturation at 6 — the grid
  {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even code;
* E4M3 (finite-only ``e4m3fn``): quantum ``2^(floor(log2 v) - 3)``, at least ``2^-9``
  (subnormals); values rounding above 448 become NaN, as PyTorch's cast does for the scale
  (the FP8 values themselves are clamped to +-448 first, as in the reference);
* E8M0 (power-of-two, rounded up): from the float's exponent bits.
* Divisions ``x / scale`` use ``tl.div_rn`` (IEEE round-to-nearest), as PyTorch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["quantize_triton", "dequantize_triton", "FORMATS"]

FORMATS = {"fp4_e4m3": (0, 16), "mxfp4": (1, 32), "fp8": (2, 32)}
"""name -> (kernel format id, default block)."""


@triton.jit
def _rne(v, e):
    """v rounded to nearest even at the quantum 2^e (multiplications by powers of two are exact)."""
    return ((v * _pow2(-e) + 8388608.0) - 8388608.0) * _pow2(e)


@triton.jit
def _pow2(e):
    """2^e (float32) for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(v):
    """floor(log2 v) for normal positive float32 v."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_e4m3(v):
    """|v| rounded to E4M3 (finite-only), NaN above 448."""
    e = tl.maximum(_floor_log2(tl.maximum(v, 1.1754943508222875e-38)), -6)
    r = _rne(v, e - 3)
    return tl.where(r > 448.0, float("nan"), r)


@triton.jit
def _e4m3_bits(r):
    """Byte of a non-negative value already on the E4M3 grid."""
    e = _floor_log2(tl.maximum(r, 1.1754943508222875e-38))
    normal = r >= 0.015625
    mant_n = (r * _pow2(3 - e)).to(tl.int32) - 8
    code_n = ((e + 7) << 3) | mant_n
    code_s = (r * 512.0).to(tl.int32)
    code = tl.where(normal, code_n, code_s)
    return tl.where(r != r, 0x7F, code).to(tl.uint8)


@triton.jit
def _ceil_pow2(v):
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    exact = (bits & 0x7FFFFF) == 0
    return _pow2(tl.where(exact, e, e + 1))


@triton.jit
def _round_e2m1(v):
    """|v| (non-negative) onto the E2M1 grid, ties to the even code, saturating at 6."""
    m = tl.minimum(v, 6.0)
    e = tl.where(m < 2.0, -1, tl.where(m < 4.0, 0, 1))
    return tl.minimum(_rne(m, e), 6.0)


@triton.jit
def _e2m1_code(mag):
    """Grid magnitude -> 3-bit code."""
    return tl.where(mag < 2.0, mag * 2.0, tl.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0)).to(tl.int32)


@triton.jit
def _quant_kernel(X, DEQ, CODES, SCALES, R, FORMAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                  WRITE_DEQ: tl.constexpr, WRITE_PACKED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    rm = rows < R
    offs = rows[:, None].to(tl.int64) * BLOCK + cols[None, :]
    x = tl.load(X + offs, mask=rm[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    if FORMAT == 0:  # E2M1 values, E4M3 scale = amax / 6 rounded
        amax = tl.maximum(amax, 0.01171875)  # 6 * 2^-9
        scale = _round_e4m3(tl.div_rn(amax, 6.0))
    elif FORMAT == 1:  # E2M1 values, E8M0 scale rounded up
        amax = tl.maximum(amax, 7.052966104933725e-38)  # 6 * 2^-126
        scale = _ceil_pow2(tl.div_rn(amax, 6.0))
    else:  # E4M3 values, E8M0 scale rounded up
        amax = tl.maximum(amax, 1e-4)
        scale = _ceil_pow2(tl.div_rn(amax, 448.0))
    v = tl.div_rn(x, scale[:, None])
    neg = (v.to(tl.int32, bitcast=True) >> 31) != 0
    if FORMAT == 2:
        mag = _round_e4m3(tl.minimum(tl.abs(v), 448.0))
    else:
        mag = _round_e2m1(tl.abs(v))
    if WRITE_DEQ:
        q = tl.where(neg, -mag, mag)
        tl.store(DEQ + offs, (q * scale[:, None]).to(DEQ.dtype.element_ty), mask=rm[:, None])
    if WRITE_PACKED:
        if FORMAT == 0:
            tl.store(SCALES + rows, _e4m3_bits(scale), mask=rm)
        else:
            tl.store(SCALES + rows, (((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF)).to(tl.uint8), mask=rm)
        if FORMAT == 2:
            byte = _e4m3_bits(mag).to(tl.int32) | (neg.to(tl.int32) << 7)
            tl.store(CODES + offs, byte.to(tl.uint8), mask=rm[:, None])
        else:
            code = _e2m1_code(mag) | (neg.to(tl.int32) << 3)
            lo, hi = tl.split(tl.reshape(code, [BLOCK_R, BLOCK // 2, 2]))
            half = tl.arange(0, BLOCK // 2)
            tl.store(CODES + rows[:, None].to(tl.int64) * (BLOCK // 2) + half[None, :], (lo | (hi << 4)).to(tl.uint8),
                     mask=rm[:, None])


@triton.jit
def _e4m3_value(byte):
    e = (byte >> 3) & 0xF
    m = (byte & 0x7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * _pow2(e - 7))
    mag = tl.where((byte & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_value(nibble):
    c = nibble & 0x7
    cf = c.to(tl.float32)
    mag = tl.where(c < 4, cf * 0.5, tl.where(c < 6, cf - 2.0, cf * 2.0 - 8.0))
    return tl.where((nibble & 0x8) != 0, -mag, mag)


@triton.jit
def _dequant_kernel(CODES, SCALES, OUT, R, FORMAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = rows < R
    sbyte = tl.load(SCALES + rows, mask=rm, other=0).to(tl.int32)
    if FORMAT == 0:
        scale = _e4m3_value(sbyte)
    else:
        scale = _pow2(sbyte - 127)
    if FORMAT == 2:
        cols = tl.arange(0, BLOCK)
        byte = tl.load(CODES + rows[:, None].to(tl.int64) * BLOCK + cols[None, :], mask=rm[:, None], other=0)
        vals = _e4m3_value(byte.to(tl.int32))
    else:
        half = tl.arange(0, BLOCK // 2)
        byte = tl.load(CODES + rows[:, None].to(tl.int64) * (BLOCK // 2) + half[None, :], mask=rm[:, None], other=0)
        byte = byte.to(tl.int32)
        vals = tl.reshape(tl.join(_e2m1_value(byte & 0xF), _e2m1_value(byte >> 4)), [BLOCK_R, BLOCK])
    cols = tl.arange(0, BLOCK)
    tl.store(OUT + rows[:, None].to(tl.int64) * BLOCK + cols[None, :], vals * scale[:, None], mask=rm[:, None])


def _setup(x: torch.Tensor, fmt: str, block: int | None):
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantisation format '{fmt}' (choose {', '.join(FORMATS)})")
    fid, default = FORMATS[fmt]
    block = block or default
    if x.shape[-1] % block or block & (block - 1) or block < 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block} "
                         "(a power of two)")
    return fid, block


def quantize_triton(x: torch.Tensor, fmt: str, block: int | None = None, *, dequantized: bool = True,
                    packed: bool = False):
    """Returns ``(deq or None, codes or None, scales or None)``: ``deq`` in ``x.dtype`` (the
    fake-quantised values before the straight-through step), ``codes``/``scales`` as
    :mod:`megatron_s2.kernels.quant_formats` returns them."""
    fid, block = _setup(x, fmt, block)
    flat = x.contiguous().view(-1, block)
    r = flat.size(0)
    deq = torch.empty_like(x) if dequantized else None
    codes = scales = None
    dummy = flat
    if packed:
        code_width = x.shape[-1] if fmt == "fp8" else x.shape[-1] // 2
        codes = torch.empty(*x.shape[:-1], code_width, dtype=torch.uint8, device=x.device)
        scales = torch.empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.uint8, device=x.device)
    block_r = 64
    if r:
        _quant_kernel[(triton.cdiv(r, block_r),)](flat, deq if deq is not None else dummy,
                                                  codes if packed else dummy, scales if packed else dummy, r,
                                                  FORMAT=fid, BLOCK=block, BLOCK_R=block_r, WRITE_DEQ=dequantized,
                                                  WRITE_PACKED=packed)
    if packed:
        if fmt == "fp4_e4m3":
            scales = scales.view(torch.float8_e4m3fn)
        if fmt == "fp8":
            codes = codes.view(torch.float8_e4m3fn)
    return deq, codes, scales


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int | None = None) -> torch.Tensor:
    """Packed codes and scales -> float32 values (inverse of :func:`quantize_triton`)."""
    fid, default = FORMATS[fmt]
    block = block or default
    width = codes.shape[-1] if fmt == "fp8" else codes.shape[-1] * 2
    out = torch.empty(*codes.shape[:-1], width, dtype=torch.float32, device=codes.device)
    r = out.numel() // block
    block_r = 64
    if r:
        _dequant_kernel[(triton.cdiv(r, block_r),)](codes.contiguous().view(torch.uint8),
                                                    scales.contiguous().view(torch.uint8), out, r,
                                                    FORMAT=fid, BLOCK=block, BLOCK_R=block_r)
    return out
