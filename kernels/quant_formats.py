"""Packed storage formats of the KV cache (report §2.4.4, §3.2) — the PyTorch reference.

Training sees these formats through fake quantisation (:mod:`megatron_s2.models.v41.quant`):
``dequant(quant(x))`` in float. Inference *stores* them as bytes. Each ``pack_*`` here returns
the packed codes and scales, each ``unpack_*`` returns float32 values that are bit-identical
to the matching fake-quantiser, so a decode step that reads packed KV computes exactly what
the training forward computed:

=================  =========================================  ===============================
format             codes                                      scales
=================  =========================================  ===============================
FP4 main KV        E2M1, two per byte (even index in the low  one E4M3 byte per 16 values
                   nibble), sign in bit 3 of each nibble
MXFP4 index K      E2M1, two per byte (as above)              one E8M0 byte (2^(e-127)) per 32
FP8 SWA KV         one E4M3 byte per value                    one E8M0 byte per 32
=================  =========================================  ===============================

Bytes per vector of ``d`` channels: FP4 ``d/2 + d/16`` (288 for the flagship's 512), MXFP4
``d/2 + d/32`` (68 for 128), FP8 ``d + d/32`` (528 for 512) — the figures of
:mod:`megatron_s2.models.v41.accounting`. These functions are also the oracles of the Triton
quantisation kernels.
"""

from __future__ import annotations

import torch

from megatron_s2.models.v41.quant import E2M1_MAX, E4M3_MAX, ceil_pow2, round_e2m1

__all__ = ["pack_fp4_e4m3", "unpack_fp4_e4m3", "pack_mxfp4", "unpack_mxfp4", "pack_fp8", "unpack_fp8",
           "packed_bytes", "E8M0_BIAS"]

E8M0_BIAS = 127
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block or x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


def _encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Values already on the E2M1 grid -> packed uint8, two 4-bit codes per byte."""
    mag = values.abs()
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=values.device)
    idx = torch.searchsorted(grid, mag.contiguous())  # exact: mag is a grid value
    code = idx.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)
    pairs = code.flatten(-2).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., d/2] -> float32 [..., d] on the E2M1 grid."""
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=codes.device)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    mag = grid[(nibbles & 0x7).long()]
    return torch.where((nibbles & 0x8).bool(), -mag, mag)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> biased exponent bytes."""
    _, exp = torch.frexp(scale)
    return (exp - 1 + E8M0_BIAS).to(torch.uint8)


def _from_e8m0(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - E8M0_BIAS)


# ---- FP4 E2M1 with E4M3 scales (main KV) -----------------------------------------------------
def pack_fp4_e4m3(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (codes uint8 [..., d/2], scales float8_e4m3fn [..., d/block])."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn)
    codes = _encode_e2m1(round_e2m1(b / scale.float()))
    return codes, scale.squeeze(-1)


def unpack_fp4_e4m3(codes: torch.Tensor, scales: torch.Tensor, block: int = 16) -> torch.Tensor:
    vals = _decode_e2m1(codes).unflatten(-1, (-1, block))
    return (vals * scales.float().unsqueeze(-1)).flatten(-2)


# ---- MXFP4: E2M1 with E8M0 scales (index K) -------------------------------------------------
def pack_mxfp4(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (codes uint8 [..., d/2], biased exponents uint8 [..., d/block])."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -126)
    scale = ceil_pow2(amax / E2M1_MAX)
    return _encode_e2m1(round_e2m1(b / scale)), _e8m0(scale).squeeze(-1)


def unpack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = _decode_e2m1(codes).unflatten(-1, (-1, block))
    return (vals * _from_e8m0(exponents).unsqueeze(-1)).flatten(-2)


# ---- FP8 E4M3 with E8M0 scales (SWA KV) -----------------------------------------------------
def pack_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (values float8_e4m3fn [..., d], biased exponents uint8 [..., d/block])."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = ceil_pow2(amax / E4M3_MAX)
    q = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), _e8m0(scale).squeeze(-1)


def unpack_fp8(values: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = values.float().unflatten(-1, (-1, block))
    return (vals * _from_e8m0(exponents).unsqueeze(-1)).flatten(-2)


def packed_bytes(fmt: str, dim: int) -> int:
    """Bytes one ``dim``-channel vector occupies in ``fmt`` (fp4_e4m3 | mxfp4 | fp8 | bf16 | fp32)."""
    table = {"fp4_e4m3": dim // 2 + dim // 16, "mxfp4": dim // 2 + dim // 32, "fp8": dim + dim // 32,
             "bf16": 2 * dim, "fp32": 4 * dim}
    if fmt not in table:
        raise ValueError(f"unknown KV storage format '{fmt}' (choose {', '.join(table)})")
    return table[fmt]
