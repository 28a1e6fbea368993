"""Block-scaled FP8 / FP4 weights of the released checkpoint format.

The DeepSeek-V4.1-Flash reference stores (``inference/model.py``: ``Linear``,
``ParallelEngramEmbedding``; ``fp8_block_size = fp4_block_size = 32``):

* FP8 linear weights: ``weight`` E4M3 ``[out, in]`` with ``scale`` E8M0
  ``[ceil(out/32), ceil(in/32)]`` — one power-of-two scale per 32x32 block;
* FP4 routed-expert weights: ``weight`` ``float4_e2m1fn_x2`` ``[out, in/2]`` (two E2M1 values
  per byte, the even column in the low nibble) with ``scale`` E8M0 ``[out, in/32]``;
* FP8 Engram tables: ``embed.weight`` E4M3 ``[rows, dim]`` with ``embed.scale``
  ``[rows, dim/32]`` — one scale per 32 channels of each row.

All three are "values times a block-broadcast scale", with block sizes 1 or 32 per dimension
inferred from the two shapes (:func:`block_sizes`). Import dequantises to float32; the
quantisers produce the same formats (tests fabricate released-format files with them).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E2M1_VALUES", "block_sizes", "dequantize", "is_quantized", "quantize_fp4",
           "quantize_fp8", "unpack_fp4"]

BLOCK = 32
"""Block length of every scale in the released format (both FP8 and FP4)."""

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""E2M1 value of each 4-bit code (bit 3 = sign)."""

_FP8 = (torch.float8_e4m3fn,)
_FP4 = (torch.float4_e2m1fn_x2,)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _FP8 or dtype in _FP4


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., c/2]`` packed E2M1 pairs -> ``[..., c]`` float32 (low nibble = even column)."""
    codes = packed.contiguous().view(torch.uint8)
    low, high = (codes & 0x0F).long(), (codes >> 4).long()
    return torch.stack((E2M1_VALUES[low], E2M1_VALUES[high]), dim=-1).flatten(-2)


def block_sizes(shape: tuple[int, int], scale_shape: tuple[int, int]) -> tuple[int, int]:
    """Rows and columns covered by one scale: 1 or :data:`BLOCK` per dimension."""
    out = []
    for n, s in zip(shape, scale_shape):
        if s == n:
            out.append(1)
        elif s == -(-n // BLOCK):
            out.append(BLOCK)
        else:
            raise ValueError(f"a scale of shape {tuple(scale_shape)} does not tile a weight of shape {tuple(shape)} "
                             f"in blocks of 1 or {BLOCK}")
    return out[0], out[1]


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of an FP8 (E4M3) or FP4 (packed E2M1) weight and its block scale."""
    if weight.dtype in _FP4 or weight.dtype in (torch.uint8, torch.int8):
        values = unpack_fp4(weight)
    elif weight.dtype in _FP8:
        values = weight.float()
    else:
        raise TypeError(f"dequantize: {weight.dtype} is neither FP8 E4M3 nor packed FP4")
    if values.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"dequantize: expected 2-D weight and scale, got {tuple(values.shape)} and {tuple(scale.shape)}")
    br, bc = block_sizes(tuple(values.shape), tuple(scale.shape))
    s = scale.float().repeat_interleave(br, 0)[: values.size(0)].repeat_interleave(bc, 1)[:, : values.size(1)]
    return values * s


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (E8M0 scale)."""
    return torch.exp2(torch.ceil(torch.log2((amax / qmax).clamp_min(2.0 ** -126))))


def _blocked_amax(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    rows, cols = w.shape
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    padded = torch.nn.functional.pad(w.abs().float(), (0, pc - cols, 0, pr - rows))
    return padded.view(pr // br, br, pc // bc, bc).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, br: int, bc: int, shape) -> torch.Tensor:
    return scale.repeat_interleave(br, 0)[: shape[0]].repeat_interleave(bc, 1)[:, : shape[1]]


def quantize_fp8(w: torch.Tensor, *, row_block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values and E8M0 scales; ``row_block`` 32 for linear weights, 1 for Engram rows."""
    scale = _pow2_scale(_blocked_amax(w, row_block, BLOCK), 448.0)
    values = (w.float() / _expand(scale, row_block, BLOCK, w.shape)).to(torch.float8_e4m3fn)
    return values, scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 values (round to nearest) and E8M0 scales, one per 32 columns of a row."""
    rows, cols = w.shape
    if cols % 2 or cols % BLOCK:
        raise ValueError(f"quantize_fp4: {cols} columns are not a multiple of {BLOCK}")
    scale = _pow2_scale(_blocked_amax(w, 1, BLOCK), 6.0)
    x = w.float() / _expand(scale, 1, BLOCK, w.shape)
    magnitudes = E2M1_VALUES[:8]
    code = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    code = code + 8 * (x < 0).long() * (code > 0).long()
    pairs = code.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), scale.to(torch.float8_e8m0fnu)
