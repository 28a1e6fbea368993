"""Routed and shared experts with native fine-grained FP8 GEMMs (report §4.2.1 precision list:
FP8 expert linears; DeepSeek-V3 recipe, :mod:`megatron_s2.kernels.fp8_gemm`).

Subclasses of :class:`GroupedExperts` / :class:`SharedExpert` that override only ``gemm``; the
SwiGLU, the combine weights, sharding and communication are inherited. Weights that are not
made of whole B x B blocks keep the compute-dtype GEMM.
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.fp8_gemm import fp8_linear, fp8_shape_supported
from megatron_s2.models.v41.moe.experts import GroupedExperts, SharedExpert

__all__ = ["FP8GroupedExperts", "FP8SharedExpert", "fp8_expert_classes"]


class _FP8ExpertGemm:
    fp8_block = 128

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not fp8_shape_supported(weight.size(1), weight.size(0), self.fp8_block):
            return super().gemm(x, weight)
        return fp8_linear(x, weight, self.fp8_block)  # x is already in the GEMM dtype


class FP8GroupedExperts(_FP8ExpertGemm, GroupedExperts):
    pass


class FP8SharedExpert(_FP8ExpertGemm, SharedExpert):
    pass


def fp8_expert_classes(block: int) -> tuple[type, type]:
    """(routed, shared) FP8 expert classes with tile edge ``block``."""
    return tuple(type(cls.__name__, (cls,), {"fp8_block": block}) for cls in (FP8GroupedExperts, FP8SharedExpert))
