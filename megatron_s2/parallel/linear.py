"""Tensor- and sequence-parallel linear layers (local provider, device-agnostic).

Activations are ``[batch, seq, hidden]``; under sequence parallelism the sequence dimension
(1) is split over the tensor-parallel group outside of tensor-parallel regions.

* :class:`ColumnParallelLinear` splits the output features; its input is all-gathered over
  the sequence (SP) or copied (no SP) on entry.
* :class:`RowParallelLinear` splits the input features; its partial outputs are
  reduce-scattered over the sequence (SP) or all-reduced (no SP) on exit.
* :class:`ReplicatedLinear` holds the full weight on every tensor-parallel rank. Whether its
  gradient is a partial sum over tp (sequence-sharded or tp-split inputs) is stated by the
  model's parallel plan, not by the layer.

The entry / exit collectives are those of :class:`~megatron_s2.parallel.sequence.SequenceSharding`.
Weights are stored ``[out, in]`` like ``torch.nn.Linear`` and record their shard (``mark_param``). The
product runs in ``gemm_dtype`` (the model's ``compute_dtype``, set by
:func:`~megatron_s2.models.v41.precision.set_gemm_dtype`): a float32 master weight is cast to
bfloat16 at use on GPUs; ``None`` multiplies in the weight's dtype.

The local matrix product is the method ``gemm(x)``; GEMM backends (native FP8,
:mod:`megatron_s2.parallel.fp8_linear`; Transformer Engine, :mod:`megatron_s2.parallel.te_linear`)
are subclasses that override only it, so sharding, communication and the parameters'
placement stay here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.placement import mark_param
from megatron_s2.parallel.sequence import SequenceSharding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear"]


def _linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x W^T`` in ``dtype`` (default: the weight's); ``.to`` is a no-op when the dtype matches."""
    dtype = dtype or weight.dtype
    return F.linear(x.to(dtype), weight.to(dtype))


class _LocalGemm(nn.Module):
    gemm_dtype: torch.dtype | None = None
    """Dtype of the product (module docstring); None = the weight's dtype."""

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The local product ``x W^T`` (overridden by the FP8 / TE subclasses)."""
        return _linear(x, self.weight, self.gemm_dtype)


class ReplicatedLinear(_LocalGemm):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        mark_param(self.weight, (out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


class ColumnParallelLinear(_LocalGemm):
    def __init__(self, in_features: int, out_features: int, tp: Group, sequence_parallel: bool = False,
                 gather_output: bool = False, dtype: torch.dtype = torch.float32, region_entry: bool = True):
        """``region_entry=False``: the caller already brought the input into the tensor-parallel
        region (gathered over the sequence / wrapped in copy_to_group), so no entry mapping."""
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"{out_features} output features do not split over tp={tp.size}")
        self.tp, self.seq, self.gather_output = tp, SequenceSharding.of(tp, sequence_parallel=sequence_parallel), gather_output
        self.region_entry = region_entry
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, dtype=dtype))
        mark_param(self.weight, (out_features, in_features), [(0, tp.rank, tp.size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region_entry:
            x = self.seq.enter_tp_region(x)
        y = self.gemm(x)
        if self.gather_output:
            y = mappings.gather_from_group(y, self.tp, dim=-1)
        return y


class RowParallelLinear(_LocalGemm):
    def __init__(self, in_features: int, out_features: int, tp: Group, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over tp={tp.size}")
        self.tp, self.seq = tp, SequenceSharding.of(tp, sequence_parallel=sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, dtype=dtype))
        mark_param(self.weight, (out_features, in_features), [(1, tp.rank, tp.size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq.exit_tp_region(self.gemm(x))
