"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton.language as tl

__all__ = ["interpreting", "dot_dtype", "dot_precision"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype):
    """Operand dtype of ``tl.dot``: the input's 16-bit type on a GPU (tensor cores, float32
    accumulation); float32 under the CPU interpreter, whose ``tl.dot`` on bfloat16 operands
    returns garbage in Triton 3.9 (checked), and for float32/float64 inputs."""
    if dtype == torch.bfloat16 and not interpreting():
        return tl.bfloat16
    if dtype == torch.float16 and not interpreting():
        return tl.float16
    return tl.float32


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 products for float32 inputs (no TF32: parity with the reference)."""
    return "ieee" if dtype in (torch.float32, torch.float64) or interpreting() else "tf32"
