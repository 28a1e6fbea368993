"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton.language as tl

__all__ = ["interpreting", "dot_dtype", "dot_precision"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_interpreter_switch() -> None:
    """Triton decorates its standard library (``tl.zeros``, ``tl.max`` ...) once, when
    ``triton.language`` is first imported; a ``TRITON_INTERPRET=1`` set later makes our kernels
    interpreted but leaves those compiled, and every kernel then fails with "Cannot call
    @triton.jit'd outside of the scope of a kernel". Say so at import instead."""
    if interpreting() and type(tl.zeros).__name__ == "JITFunction":
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton.language had been imported (megatron-core and "
                           "transformers import it); set it in the environment before Python starts")


_check_interpreter_switch()


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
