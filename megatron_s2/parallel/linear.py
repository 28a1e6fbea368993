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
from megatron_s2.kernels.precision import cast
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.placement import mark_param
from megatron_s2.parallel.sequence import SequenceSharding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear"]


class _RowsLinear(torch.autograd.Function):
    """``F.linear(x, w)`` for ``x`` [..., in] (more than two dims), whose input gradient is a
    tensor of its own rather than a view of the GEMM's result.

    Autograd sums the gradients of an input read by several layers (the CSA2 layer's input
    feeds q_down, the window KV and the compressor's KV and gate) in place only when the
    gradient it holds owns its storage outright. Through ``F.linear`` a [b, s, in] input's
    gradient is ``(g W).view(b, s, in)``, a view whose base keeps a second reference to the
    storage, so the first sum is out of place: the held gradient, the arriving one and their
    sum, three ``[s, in]`` buffers at once, at the end of the layer's backward. Here the
    product is written into a fresh [..., in] tensor (``mm(out=)`` on its row view), so every
    sum after the first arrival is in place. Forward and gradients are the ones ``F.linear``
    computes, bit for bit: the same GEMMs with the same operand layouts as its matmul folding
    (``mm_mat1_backward`` / ``mm_mat2_backward``); tests/parallel/test_linear_rows.py."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = g.new_empty(x.shape)
            torch.mm(g, weight, out=gx.view(-1, x.size(-1)))
        if ctx.needs_input_grad[1]:
            gw = g.t().mm(x.reshape(-1, x.size(-1)))
        return gx, gw


def _linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x W^T`` in ``dtype`` (default: the weight's); no cast when the dtype matches.
    Under autograd a [..., in] input (more than two dims) goes through :class:`_RowsLinear`
    (same values; its gradient can be summed in place with other readers' gradients)."""
    dtype = dtype or weight.dtype
    x, weight = cast(x, dtype), cast(weight, dtype)
    if x.dim() > 2 and torch.is_grad_enabled() and x.requires_grad:
        return _RowsLinear.apply(x, weight)
    return F.linear(x, weight)


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
