"""Routed and shared SwiGLU experts (report §4.2.1: 1 shared + routed experts, SwiGLU clamped at 10).

Expert FFN, as in the public reference ``Expert``::

    gate = x W1^T, up = x W3^T                  (upcast to at least float32)
    up   = clamp(up, -limit, limit); gate = clamp(gate, max=limit)      (limit > 0)
    out  = (silu(gate) * up * weight) W2^T      (weight = combine weight, applied before W2)

:class:`GroupedExperts` holds this rank's routed experts as grouped 3-D parameters
``w1, w3: [E_local, F_local, hidden]`` and ``w2: [E_local, hidden, F_local]``. Their
ShardSpec is the full ``[num_experts, ...]`` tensor split ``(0, ep_rank, ep)`` (contiguous
blocks of experts per expert-parallel rank) and then over the FFN width ``(1 | 2,
etp_rank, etp)`` (expert tensor parallelism: W1/W3 column-split, W2 row-split), so names and
full shapes do not depend on the layout. Each etp rank returns a *partial* output that the
token dispatcher sums over the etp group. Their placement (style ``experts`` in the parallel
plan) has the expert-data-parallel group as replicas: the finaliser reduces their gradients
over it, not over dp.

The compute is a loop of dense matmuls over the local experts that received tokens, on their
contiguous blocks of the expert-sorted rows (an empty expert costs nothing; under autograd with
no token at all one expert still runs, so the weights' gradient is defined), and one SwiGLU over
all rows; a grouped-GEMM kernel is a drop-in replacement of :meth:`GroupedExperts.forward`.

:class:`SharedExpert` is the dense SwiGLU every token goes through, tensor-parallel over
``groups.tp``: W1/W3 column-parallel, W2 row-parallel, one entry collective for both column
projections (all-gather of the sequence under SP, copy otherwise) and one exit collective
(reduce-scatter under SP, all-reduce otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.precision import cast
from megatron_s2.models.init import normal_init
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.placement import mark_param

__all__ = ["swiglu", "GroupedExperts", "SharedExpert"]



def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Clamped SwiGLU in at least float32; ``weight`` ([n, 1]) scales each row (combine weight)."""
    # float64 stays (gradcheck), anything else is lifted to float32: promote_types without its
    # ATen operator call (one per expert per layer at decode)
    dtype = torch.float64 if gate.dtype is torch.float64 else torch.float32
    gate, up = cast(gate, dtype), cast(up, dtype)
    if limit > 0:
        up = up.clamp(min=-limit, max=limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    return h if weight is None else h * cast(weight, dtype)


class GroupedExperts(nn.Module):
    gemm_dtype: torch.dtype | None = None
    """Dtype of the expert GEMMs (the model's compute_dtype); None = the weights' dtype."""

    def __init__(self, config: V41Config, ep: Group, etp: Group):
        super().__init__()
        num_experts, ffn, hidden = config.num_routed_experts, config.moe_ffn_hidden_size, config.hidden_size
        if num_experts % ep.size:
            raise ValueError(f"ep={ep.size} does not divide num_routed_experts={num_experts}; change parallel.ep")
        if ffn % etp.size:
            raise ValueError(f"etp={etp.size} does not divide moe_ffn_hidden_size={ffn}; change parallel.etp")
        self.num_local_experts = num_experts // ep.size
        self.local_expert_offset = ep.rank * self.num_local_experts
        self.swiglu_limit = config.swiglu_limit
        dtype, init = getattr(torch, config.params_dtype), normal_init(config.init_std)
        e, f = self.num_local_experts, ffn // etp.size
        expert_split = (0, ep.rank, ep.size)
        self.w1 = nn.Parameter(torch.empty(e, f, hidden, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(e, f, hidden, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, hidden, f, dtype=dtype))
        for param, full, width_dim in ((self.w1, (num_experts, ffn, hidden), 1),
                                       (self.w3, (num_experts, ffn, hidden), 1),
                                       (self.w2, (num_experts, hidden, ffn), 2)):
            mark_param(param, full, [expert_split, (width_dim, etp.rank, etp.size)], init=init)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens``: [M, hidden] sorted by local expert, ``tokens_per_expert[e]`` rows each;
        ``probs``: [M] combine weights. Returns [M, hidden] (a partial sum when etp > 1)."""
        if len(tokens_per_expert) != self.num_local_experts or sum(tokens_per_expert) != tokens.size(0):
            raise ValueError(f"expert token counts {tokens_per_expert} do not match {tokens.size(0)} rows "
                             f"for {self.num_local_experts} local experts")
        x = cast(tokens, self.gemm_dtype or self.w1.dtype)
        # Only experts that received tokens run: with top-k of E experts most are empty at decode
        # (6 of 384 in the flagship), and an empty expert would still cost three GEMM launches and
        # the SwiGLU. Under autograd one empty expert keeps the weights in the graph when every
        # expert is empty, so their gradient is defined (zero) as the reducers expect.
        active = [e for e, n in enumerate(tokens_per_expert) if n]
        if not active and torch.is_grad_enabled():
            active = [0]
        if not active:
            return x.new_zeros((0, x.size(-1)), dtype=tokens.dtype)
        # The GEMMs run per non-empty expert on its contiguous block of rows; the elementwise
        # SwiGLU runs once over all rows (the empty experts' blocks hold none, so the active
        # blocks cover every row in order): the same values as per expert, without SwiGLU's
        # operators repeated for each of them (measured in bench/decode.py's operator counts).
        sizes = [tokens_per_expert[e] for e in active]
        row_blocks = torch.split(x, tokens_per_expert)
        gate = self._cat([self.gemm(row_blocks[e], self.w1[e]) for e in active])
        up = self._cat([self.gemm(row_blocks[e], self.w3[e]) for e in active])
        h = cast(swiglu(gate, up, self.swiglu_limit, probs.unsqueeze(-1)), x.dtype)
        h_blocks = (h,) if len(active) == 1 else torch.split(h, sizes)
        outputs = [self.gemm(h_e, self.w2[e]) for e, h_e in zip(active, h_blocks)]
        return cast(self._cat(outputs), tokens.dtype)

    @staticmethod
    def _cat(blocks: list[torch.Tensor]) -> torch.Tensor:
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=0)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One expert's product ``x W^T`` in ``x``'s dtype (overridden by the FP8 subclass)."""
        return F.linear(x, cast(weight, x.dtype))


class SharedExpert(nn.Module):
    gemm_dtype: torch.dtype | None = None
    """Dtype of the expert GEMMs (the model's compute_dtype); None = the weights' dtype."""

    def __init__(self, config: V41Config, groups: ParallelGroups):
        super().__init__()
        tp = groups.tp
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        if ffn % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the shared expert width moe_ffn_hidden_size={ffn}")
        self.tp, self.seq = tp, groups.sequence
        self.swiglu_limit = config.swiglu_limit
        dtype, init = getattr(torch, config.params_dtype), normal_init(config.init_std)
        f = ffn // tp.size
        self.w1 = nn.Parameter(torch.empty(f, hidden, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(f, hidden, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(hidden, f, dtype=dtype))
        mark_param(self.w1, (ffn, hidden), [(0, tp.rank, tp.size)], init=init)
        mark_param(self.w3, (ffn, hidden), [(0, tp.rank, tp.size)], init=init)
        mark_param(self.w2, (hidden, ffn), [(1, tp.rank, tp.size)], init=init)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s, hidden] (sequence-sharded under SP) -> same shape and dtype."""
        x = cast(self.seq.enter_tp_region(hidden), self.gemm_dtype or self.w1.dtype)
        h = swiglu(self.gemm(x, self.w1), self.gemm(x, self.w3), self.swiglu_limit)
        y = self.gemm(cast(h, x.dtype), self.w2)
        return cast(self.seq.exit_tp_region(y), hidden.dtype)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The local product ``x W^T`` in ``x``'s dtype (overridden by the FP8 subclass)."""
        return F.linear(x, cast(weight, x.dtype))
