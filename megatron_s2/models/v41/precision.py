"""Precision helpers: the float32 islands of the precision map (RoPE, norms, router, mHC,
LM head, attention softmax) compute in *at least* float32 — float64 inputs stay float64 so
gradient checks run in double precision."""

from __future__ import annotations

import torch

__all__ = ["wide"]


def wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()
