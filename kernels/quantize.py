"""Dispatch of the FP4 / MXFP4 / FP8 quantisers (report §2.4.4): the Triton kernels of
:mod:`megatron_s2.kernels.triton.quant` on CUDA tensors, the PyTorch references elsewhere.

* ``fake_quant_*`` — quantise-dequantise with the straight-through gradient, the training
  (QAT) view: ``x + (dequantize(x) - x).detach()``; the reference ``dequantize_*`` is in
  :mod:`megatron_s2.kernels.quant_formats` (one quantiser per format, shared with packing).
* ``pack_*`` / ``unpack_*`` — the packed storage formats of the KV cache; the reference is
  :mod:`megatron_s2.kernels.quant_formats`.

The Triton results are bit-identical to the references (tests/kernels/test_triton_quant.py).
"""

from __future__ import annotations

import torch

from megatron_s2.kernels import quant_formats as formats
from megatron_s2.kernels.dispatch import use_triton

__all__ = ["fake_quant_reference", "fake_quant_fp4_e4m3", "fake_quant_mxfp4", "fake_quant_fp8", "pack_fp4_e4m3", "unpack_fp4_e4m3",
           "pack_mxfp4", "unpack_mxfp4", "pack_fp8", "unpack_fp8"]


def _straight_through(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """The forward sees the quantised values, the backward is the straight-through identity."""
    return x + (deq.to(x.dtype) - x).detach()


def fake_quant_reference(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The PyTorch path of ``fake_quant_<fmt>`` whatever the device (the kernels' oracle)."""
    return _straight_through(x, formats.DEQUANTIZE[fmt](x, block))


def _fake(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    if not use_triton(x):
        return fake_quant_reference(x, fmt, block)
    from megatron_s2.kernels.triton.quant import quantize_triton

    deq, _, _ = quantize_triton(x.detach(), fmt, block)
    return _straight_through(x, deq)


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 values, one E4M3 scale per ``block`` channels, no global scale (main KV, §2.4.4)."""
    return _fake(x, "fp4_e4m3", block)


def fake_quant_mxfp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 values, one E8M0 (power-of-two, rounded up) scale per ``block`` channels (indexer)."""
    return _fake(x, "mxfp4", block)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E4M3 values, one power-of-two scale per ``block`` channels (SWA KV, Engram rows, §2.4.4)."""
    return _fake(x, "fp8", block)


def _pack(x: torch.Tensor, fmt: str, block: int, ref):
    if not use_triton(x):
        return ref(x, block)
    from megatron_s2.kernels.triton.quant import quantize_triton

    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    _, codes, scales = quantize_triton(x.detach(), fmt, block, dequantized=False, packed=True)
    return codes, scales


def _unpack(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, ref) -> torch.Tensor:
    if not use_triton(codes, scales):
        return ref(codes, scales, block)
    from megatron_s2.kernels.triton.quant import dequantize_triton

    return dequantize_triton(codes, scales, fmt, block)


def pack_fp4_e4m3(x, block: int = 16):
    return _pack(x, "fp4_e4m3", block, formats.pack_fp4_e4m3)


def unpack_fp4_e4m3(codes, scales, block: int = 16):
    return _unpack(codes, scales, "fp4_e4m3", block, formats.unpack_fp4_e4m3)


def pack_mxfp4(x, block: int = 32):
    return _pack(x, "mxfp4", block, formats.pack_mxfp4)


def unpack_mxfp4(codes, exponents, block: int = 32):
    return _unpack(codes, exponents, "mxfp4", block, formats.unpack_mxfp4)


def pack_fp8(x, block: int = 32):
    return _pack(x, "fp8", block, formats.pack_fp8)


def unpack_fp8(values, exponents, block: int = 32):
    return _unpack(values, exponents, "fp8", block, formats.unpack_fp8)
