"""Packed storage formats of the KV cache (report §2.4.4, §3.2) — the PyTorch reference.

Training sees these formats through fake quantisation (:func:`megatron_s2.kernels.quantize.fake_quant_fp4_e4m3`
and its siblings): ``dequantize_*(x)`` here, ``dequant(quant(x))`` in float, with a straight-through
gradient. Inference *stores* them as bytes. Each ``pack_*`` returns the packed codes and scales,
each ``unpack_*`` returns float32 values; both share one quantiser per format with
``dequantize_*``, so ``unpack(pack(x))`` is bit-identical to ``dequantize(x)`` and a decode step
that reads packed KV computes exactly what the training forward computed:

* **FP4 main KV** — E2M1 values with one E4M3 scale per 16 channels and no second-level
  global scale (NVFP4 minus its global scale). The largest representable magnitude is
  448 x 6 = 2688, far above the KV latent's bound (~sqrt(512) after RMSNorm and RoPE).
* **MXFP4 indexer Q/K** — E2M1 values with one E8M0 (power-of-two) scale per 32 channels,
  the OCP format DeepSeek-V4 uses for the indexer.
* **FP8 SWA KV** — E4M3 values with one power-of-two scale per 32 channels.

Rounding follows the reference inference kernels: round-to-nearest-even onto the E2M1 grid,
E4M3 scales by casting ``amax / 6``, power-of-two scales rounded up.

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

from megatron_s2.kernels.precision import cast

__all__ = ["pack_fp4_e4m3", "unpack_fp4_e4m3", "pack_mxfp4", "unpack_mxfp4", "pack_fp8", "unpack_fp8",
           "dequantize_fp4_e4m3", "dequantize_mxfp4", "dequantize_fp8", "DEQUANTIZE", "packed_bytes", "E8M0_BIAS",
           "E2M1_MAX", "E4M3_MAX", "FP4_MAIN_KV_MAX", "round_e2m1", "ceil_pow2"]

E8M0_BIAS = 127
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP4_MAIN_KV_MAX = E4M3_MAX * E2M1_MAX  # 2688: dynamic range without a global scale (§2.4.4)

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code), saturating at +-6."""
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=x.device)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = cast(x, torch.float32).abs().clamp_max(E2M1_MAX)
    idx = torch.bucketize(mag, mids)  # value == midpoint goes to the lower code
    tie = (idx < len(_E2M1_MIDPOINTS)) & (mag == mids[idx.clamp_max(len(_E2M1_MIDPOINTS) - 1)])
    idx = idx + (tie & (idx % 2 == 1)).long()  # ...unless the lower code is odd: round to even
    return torch.copysign(grid[idx], cast(x, torch.float32))


def ceil_pow2(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v (v > 0), i.e. an E8M0 scale rounded up."""
    mant, exp = torch.frexp(v.float())
    return torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Detached float32 blocks ``[..., d/block, block]`` (the training gradient is
    straight-through, so autograd keeps none of the quantiser's intermediates alive)."""
    if x.shape[-1] % block or x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return cast(x.detach(), torch.float32).unflatten(-1, (-1, block))


# ---- the three quantisers: grid values [..., d/block, block] and their block scales ---------
def _quantize_fp4_e4m3(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn)
    return round_e2m1(b / scale.float()), scale


def _quantize_mxfp4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -126)
    scale = ceil_pow2(amax / E2M1_MAX)
    return round_e2m1(b / scale), scale


def _quantize_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = ceil_pow2(amax / E4M3_MAX)
    return (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``dequant(quant(x))`` float32: E2M1 values, one E4M3 scale per ``block`` (main KV)."""
    values, scale = _quantize_fp4_e4m3(x, block)
    return (values * scale.float()).flatten(-2)


def dequantize_mxfp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``dequant(quant(x))`` float32: E2M1 values, one E8M0 scale per ``block`` (indexer Q/K)."""
    values, scale = _quantize_mxfp4(x, block)
    return (values * scale).flatten(-2)


def dequantize_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``dequant(quant(x))`` float32: E4M3 values, one power-of-two scale per ``block`` (SWA KV)."""
    values, scale = _quantize_fp8(x, block)
    return (cast(values, torch.float32) * scale).flatten(-2)


DEQUANTIZE = {"fp4_e4m3": dequantize_fp4_e4m3, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}


def _encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Values already on the E2M1 grid -> packed uint8, two 4-bit codes per byte."""
    mag = values.abs()
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=values.device)
    idx = torch.searchsorted(grid, mag.contiguous())  # exact: mag is a grid value
    code = idx.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)
    pairs = code.flatten(-2).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _decode_e2m1_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., d/2] -> float32 [..., d] on the E2M1 grid, nibble by nibble (the
    definition; builds :func:`_decode_e2m1`'s table)."""
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=codes.device)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    mag = grid[(nibbles & 0x7).long()]
    return torch.where((nibbles & 0x8).bool(), -mag, mag)


# Decoding tables, one per device: a byte's two E2M1 values ([256, 2]) and an E8M0 byte's scale
# ([256]), made by the definitions above from every byte, so a lookup returns their bits (-0.0
# and the E8M0 extremes included). A KV read unpacks every cached index key of a Full layer per
# decode step; the lookup is 3 operators where the nibble arithmetic is 12 over int64 copies.
_E2M1_PAIRS: dict[torch.device, torch.Tensor] = {}
_E8M0_SCALES: dict[torch.device, torch.Tensor] = {}


def _decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., d/2] -> float32 [..., d] on the E2M1 grid (a table lookup per byte)."""
    table = _E2M1_PAIRS.get(codes.device)
    if table is None:
        every = torch.arange(256, dtype=torch.uint8, device=codes.device)
        table = _E2M1_PAIRS[codes.device] = _decode_e2m1_nibbles(every).view(256, 2)
    return table[codes.long()].flatten(-2)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> biased exponent bytes."""
    _, exp = torch.frexp(scale)
    return (exp - 1 + E8M0_BIAS).to(torch.uint8)


def _from_e8m0_ldexp(e: torch.Tensor) -> torch.Tensor:
    """Biased exponent bytes -> 2^(e - 127) (float32; the definition, builds the table)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - E8M0_BIAS)


def _from_e8m0(e: torch.Tensor) -> torch.Tensor:
    """Biased exponent bytes -> 2^(e - 127) (float32; a table lookup per byte)."""
    table = _E8M0_SCALES.get(e.device)
    if table is None:
        table = _E8M0_SCALES[e.device] = _from_e8m0_ldexp(torch.arange(256, dtype=torch.uint8, device=e.device))
    return table[e.long()]


# ---- FP4 E2M1 with E4M3 scales (main KV) -----------------------------------------------------
def pack_fp4_e4m3(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (codes uint8 [..., d/2], scales float8_e4m3fn [..., d/block])."""
    values, scale = _quantize_fp4_e4m3(x, block)
    return _encode_e2m1(values), scale.squeeze(-1)


def unpack_fp4_e4m3(codes: torch.Tensor, scales: torch.Tensor, block: int = 16) -> torch.Tensor:
    vals = _decode_e2m1(codes).unflatten(-1, (-1, block))
    return (vals * scales.float().unsqueeze(-1)).flatten(-2)


# ---- MXFP4: E2M1 with E8M0 scales (index K) -------------------------------------------------
def pack_mxfp4(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (codes uint8 [..., d/2], biased exponents uint8 [..., d/block])."""
    values, scale = _quantize_mxfp4(x, block)
    return _encode_e2m1(values), _e8m0(scale).squeeze(-1)


def unpack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = _decode_e2m1(codes).unflatten(-1, (-1, block))
    return (vals * _from_e8m0(exponents).unsqueeze(-1)).flatten(-2)


# ---- FP8 E4M3 with E8M0 scales (SWA KV) -----------------------------------------------------
def pack_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] -> (values float8_e4m3fn [..., d], biased exponents uint8 [..., d/block])."""
    values, scale = _quantize_fp8(x, block)
    return values.flatten(-2), _e8m0(scale).squeeze(-1)


def unpack_fp8(values: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = cast(values, torch.float32).unflatten(-1, (-1, block))
    return (vals * _from_e8m0(exponents).unsqueeze(-1)).flatten(-2)


def packed_bytes(fmt: str, dim: int) -> int:
    """Bytes one ``dim``-channel vector occupies in ``fmt`` (fp4_e4m3 | mxfp4 | fp8 | bf16 | fp32)."""
    table = {"fp4_e4m3": dim // 2 + dim // 16, "mxfp4": dim // 2 + dim // 32, "fp8": dim + dim // 32,
             "bf16": 2 * dim, "fp32": 4 * dim}
    if fmt not in table:
        raise ValueError(f"unknown KV storage format '{fmt}' (choose {', '.join(table)})")
    return table[fmt]
