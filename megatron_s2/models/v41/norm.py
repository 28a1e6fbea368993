"""RMSNorm in float32 (precision map: norms always run in fp32)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_s2.models.init import constant_init
from megatron_s2.kernels.precision import cast, wide
from megatron_s2.parallel.placement import mark_param

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    h = wide(x)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * wide(weight)
    return cast(h, x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        """Whether the weight's gradient is a partial sum over tp (sequence-sharded input) is
        the parallel plan's business (:mod:`megatron_s2.models.v41.parallel_plan`)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        mark_param(self.weight, (dim,), init=constant_init(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
