"""The MoE block of every V4.1-Flash layer (report §2.1, §2.1.1, §4.2.1, §4.2.2, §5.2.1).

``forward`` reads route -> dispatch -> compute -> combine, plus the shared expert:

* **route** — :class:`TopKRouter` (float32; modality-specific correction biases for
  selection; routing record/replay through ``ctx.routing``), and the sequence-level balance
  loss added with ``ctx.add_aux_loss("moe_seq_balance", ...)`` in training;
* **dispatch / combine** — :class:`AllToAllTokenDispatcher` (dropless; all-to-all over ep,
  all-gather / reduce-scatter over etp);
* **compute** — :class:`GroupedExperts` (this rank's experts, width-split over etp);
* **shared expert** — :class:`SharedExpert`, tensor-parallel over tp, on every token.

**Tensor parallelism.** The routed path is not split over tp by width; instead each tp rank
routes a disjoint 1/tp of the tokens (Megatron's tp x ep dispatch domain): without SP the
replicated input is split along the sequence on entry (``scatter_to_group``, all-gather
backward) and the routed output is all-gathered on exit (split backward); with SP the input
is already the rank's sequence chunk and nothing changes. Consequently every rank of the
stage routes different tokens: the ep/etp dispatch needs no deduplication, load counts are
summed over ``groups.stage`` (tp x cp x dp), the router weight's gradient is a partial sum
over tp (the plan's ``"moe"`` section), and the sequence balance loss sums its per-row
statistics over tp (and cp). The split is the routed shard of the layer's
:class:`~megatron_s2.parallel.sequence.SequenceSharding`; the sequence length each tp rank
sees must divide by tp (the layout's ``seq_len_divisor`` guarantees it).

**Selective recomputation** (``parallel.recompute: selective``, ``SELECTIVE_RECOMPUTE`` of
the plan) checkpoints the routed experts' compute: the SwiGLU intermediates of every routed
slot are recomputed in backward instead of being kept (the dispatch collectives, the router
and its counters run once).

``ctx.image_mask`` and routing records cover the tokens of ``ctx.input_ids`` (the whole tp
group's sequence chunk): under tp the layer takes this rank's slice before routing and
gathers the selected ids over tp before recording, so records are layout-independent.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.precision import cast
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.moe.experts import GroupedExperts, SharedExpert
from megatron_s2.models.v41.moe.load_balancing import sequence_balance_loss
from megatron_s2.models.v41.moe.router import RoutingDecision, TopKRouter
from megatron_s2.parallel.token_dispatch import AllToAllTokenDispatcher
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.models.v41.recompute import selective_checkpoint
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    PLAN_SECTION = "moe"

    def __init__(self, config: V41Config, layer_number: int, groups: ParallelGroups,
                 experts: type = GroupedExperts, shared_expert: type = SharedExpert):
        """``experts`` / ``shared_expert``: the classes the provider picked (spec.py)."""
        super().__init__()
        self.config, self.layer_number, self.groups = config, layer_number, groups
        self.tp, self.seq = groups.tp, groups.sequence
        self.router = TopKRouter(config, groups)
        self.token_dispatcher = AllToAllTokenDispatcher(config.num_routed_experts, groups.ep, groups.etp)
        self.experts = experts(config, groups.ep, groups.etp)
        self.shared_expert = shared_expert(config, groups) if config.num_shared_experts else None
        self.selective_recompute = False  # checkpoint the routed experts' compute (set by the model)
        apply_plan(self, groups, config)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[b, s, hidden] (sequence-sharded under SP, already normalised) -> same shape."""
        tokens = self.seq.enter_routed(hidden)
        b, s, d = tokens.shape
        decision = self._route(tokens, ctx)
        dispatched = self.token_dispatcher.dispatch(tokens.reshape(b * s, d), decision.probs, decision.indices)
        expert_output = self._compute(dispatched)
        routed = self.token_dispatcher.combine(expert_output, dispatched.state).view(b, s, d)
        output = self.seq.leave_routed(routed)  # float32 accumulator, like the reference
        if self.shared_expert is not None:
            output = output + self.shared_expert(hidden)
        return cast(output, hidden.dtype)

    # ---- compute -----------------------------------------------------------------------------
    def _compute(self, dispatched) -> torch.Tensor:
        counts = dispatched.tokens_per_expert
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            return selective_checkpoint(lambda t, p: self.experts(t, p, counts), dispatched.tokens, dispatched.probs)
        return self.experts(dispatched.tokens, dispatched.probs, counts)

    # ---- route -----------------------------------------------------------------------------
    def _route(self, tokens: torch.Tensor, ctx: ForwardContext) -> RoutingDecision:
        b, s, d = tokens.shape
        image_mask = self.seq.routed_slice(ctx.image_mask)
        if image_mask is not None and tuple(image_mask.shape) != (b, s):
            raise ValueError(f"MoE layer {self.layer_number}: ctx.image_mask has shape {tuple(ctx.image_mask.shape)}, "
                             "expected [batch, seq] of ctx.input_ids")
        replayed = ctx.routing.stored_indices(self.layer_number) if ctx.routing is not None else None
        replayed = self.seq.routed_slice(replayed)
        counted = self.seq.routed_slice(ctx.routing.counted) if ctx.routing is not None else None
        decision = self.router(
            tokens.reshape(b * s, d),
            None if image_mask is None else image_mask.reshape(-1).bool(),
            None if replayed is None else replayed.reshape(-1, self.config.moe_topk),
            None if counted is None else counted.reshape(-1).bool(),
        )
        if ctx.routing is not None:
            with torch.no_grad():
                ids = decision.indices.view(b, s, self.config.moe_topk)
                ctx.routing.commit(self.layer_number, mappings.gather_from_group(ids, self.tp, dim=1))
        if self.training and self.config.moe_seq_aux_loss_coeff > 0:
            loss = sequence_balance_loss(
                decision.scores.view(b, s, self.config.num_routed_experts),
                decision.indices.view(b, s, self.config.moe_topk), self.config.moe_seq_aux_loss_coeff,
                row_split=(self.tp,), partial=(self.groups.cp,), rows=ctx.aux_rows)
            ctx.add_aux_loss("moe_seq_balance", loss)
        return decision
