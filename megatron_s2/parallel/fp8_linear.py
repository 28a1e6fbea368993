"""Native fine-grained FP8 linears: the parallel linears with an FP8 local GEMM.

Each class subclasses its parallel linear (:mod:`megatron_s2.parallel.linear`) and overrides
only ``gemm``: sharding, parameter metadata and the tensor/sequence-parallel communication are
inherited unchanged. The GEMM is :func:`megatron_s2.kernels.fp8_gemm.fp8_linear` (DeepSeek-V3
recipe: 1 x B activation tiles, B x B weight blocks, FP8 forward, dgrad and wgrad). A linear
whose local weight is not made of whole B x B blocks keeps the compute-dtype GEMM (``fp8``
is False in its repr).

:func:`fp8_linear_submodules` binds the tile edge B and returns the classes for a
:class:`~megatron_s2.models.v41.spec.LinearSubmodules`.
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.fp8_gemm import fp8_linear, fp8_shape_supported
from megatron_s2.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

__all__ = ["FP8ReplicatedLinear", "FP8ColumnParallelLinear", "FP8RowParallelLinear", "fp8_linear_classes"]


class _FP8Gemm:
    fp8_block = 128

    @property
    def fp8(self) -> bool:
        return fp8_shape_supported(self.weight.size(1), self.weight.size(0), self.fp8_block)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return super().gemm(x)
        return fp8_linear(x.to(self.gemm_dtype or self.weight.dtype), self.weight, self.fp8_block)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.fp8}, block={self.fp8_block}"


class FP8ReplicatedLinear(_FP8Gemm, ReplicatedLinear):
    pass


class FP8ColumnParallelLinear(_FP8Gemm, ColumnParallelLinear):
    pass


class FP8RowParallelLinear(_FP8Gemm, RowParallelLinear):
    pass


def fp8_linear_classes(block: int) -> tuple[type, type, type]:
    """(replicated, column, row) FP8 classes with tile edge ``block``."""
    return tuple(type(cls.__name__, (cls,), {"fp8_block": block})
                 for cls in (FP8ReplicatedLinear, FP8ColumnParallelLinear, FP8RowParallelLinear))
