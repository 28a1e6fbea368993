"""Run-time choice between a kernel's PyTorch reference and its Triton implementation.

Triton is optional: importing :mod:`megatron_s2` never imports it. A dispatch function in
:mod:`megatron_s2.kernels` asks :func:`use_triton` with its input tensors and runs the Triton
kernel when

* ``triton`` imports (checked once, lazily), and
* ``MEGATRON_S2_KERNELS`` is ``auto`` (default) and every input tensor is on a CUDA device,
  or ``MEGATRON_S2_KERNELS=triton`` (forces the kernels, e.g. on CPU tensors under
  ``TRITON_INTERPRET=1``; an error if Triton is missing), or never with ``reference``.

Model code calls the dispatch functions and never branches on the device itself.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from megatron_s2.config.schema import ConfigError

__all__ = ["triton_available", "kernel_mode", "use_triton", "MODES"]

MODES = ("auto", "reference", "triton")
ENV = "MEGATRON_S2_KERNELS"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install counts as absent: the reference still runs
        return False
    return True


def kernel_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}; unset it or pick one")
    return mode


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when the Triton kernel should run on these inputs (module docstring)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_available():
            raise ConfigError(f"{ENV}=triton but Triton is not importable; pip install triton or unset {ENV}")
        if not _interpreting() and not all(t.is_cuda for t in tensors if t is not None):
            raise ConfigError(f"{ENV}=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
                              f"environment before Python starts, or unset {ENV} (the reference runs on CPU)")
        return True
    if not triton_available():
        return False
    return all(t.is_cuda for t in tensors if t is not None)
