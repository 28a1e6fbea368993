"""The float32 islands of the precision map: ``wide`` lifts a tensor to float32 (float64 stays).

RoPE, RMSNorm, the MoE router, mHC coefficients, softmax and the LM head compute in float32
whatever the activation dtype (report §2.4.4's precision map; Intern-S2 walkthrough Ch. 1);
the kernels and the model code call this one helper, so float64 tests keep full precision.
"""

from __future__ import annotations

import torch

__all__ = ["wide"]


def wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()
