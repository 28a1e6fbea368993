"""The float32 islands of the precision map: ``wide`` lifts a tensor to float32 (float64 stays).

RoPE, RMSNorm, the MoE router, mHC coefficients, softmax and the LM head compute in float32
whatever the activation dtype (report §2.4.4's precision map; Intern-S2 walkthrough Ch. 1);
the kernels and the model code call this one helper, so float64 tests keep full precision.
"""

from __future__ import annotations

import torch

__all__ = ["cast", "wide"]

# Both helpers return the tensor itself when it already has the dtype, without calling into
# ``Tensor.to`` / ``Tensor.float``: those return ``self`` too, but each call is a dispatched
# ATen operator (~2-8 us of host time), and a decode step made ~2,400 of them (issue 20).


def wide(t: torch.Tensor) -> torch.Tensor:
    dt = t.dtype
    return t if dt is torch.float32 or dt is torch.float64 else t.float()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without an operator call when ``t`` already has ``dtype``."""
    return t if t.dtype is dtype else t.to(dtype)
