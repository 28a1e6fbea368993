"""Top-k router with modality-specific correction biases (report §2.1.1, §4.2.1, §4.2.2).

Semantics follow the public DeepSeek-V4.1-Flash reference ``Gate`` so released checkpoints
route identically:

* scores = score_fn(x W^T) in float32 (precision map: the router always runs in float32),
  score_fn one of softmax, sigmoid, sqrtsoftplus = sqrt(softplus(z));
* the correction bias is added **only for selection**: ids = topk(scores + bias), where image
  tokens (``image_mask``) use the image bias and all other tokens the text bias (§2.1.1);
* combine weights = scores gathered at the ids, renormalised to sum to one when
  ``moe_norm_topk_prob`` and k > 1 (denominator + 1e-20), times ``moe_route_scale``.

With routing replay the ids come from the record instead of top-k; the weights are still the
current scores at those ids. The reference's gate temperature is not a config field yet (it
is 1 for the released model).

The biases are **buffers** (saved in ``state_dict``, never touched by the optimiser). During
training the router counts, per modality, how many tokens selected each expert;
:func:`megatron_s2.models.v41.moe.load_balancing.update_expert_biases` turns the counts into
the aux-loss-free update once per optimiser step and resets them.

Placement (the MoE layer's section of the parallel plan): the router weight is replicated
over tp, but the MoE layer routes a disjoint 1/tp of the tokens on each tp rank, so its
gradient is a partial sum over tp whenever tp > 1 (the finaliser all-reduces it over tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.precision import cast
from megatron_s2.models.init import normal_init
from megatron_s2.models.v41.moe.load_balancing import expert_bias_update, update_expert_biases
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import mark_param

__all__ = ["SCORE_FUNCTIONS", "RoutingDecision", "TopKRouter"]

TEXT, IMAGE = 0, 1

SCORE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
}


@dataclass
class RoutingDecision:
    """One router call over N tokens."""

    indices: torch.Tensor
    """[N, K] int64 selected experts (biased top-k, or replayed)."""
    probs: torch.Tensor
    """[N, K] float32 combine weights (differentiable w.r.t. the router weight and input)."""
    scores: torch.Tensor
    """[N, num_experts] float32 unbiased scores (for the sequence balance loss)."""


class TopKRouter(nn.Module):
    def __init__(self, config: V41Config, groups: ParallelGroups):
        super().__init__()
        self.num_experts, self.topk = config.num_routed_experts, config.moe_topk
        self.norm_topk_prob, self.route_scale = config.moe_norm_topk_prob, config.moe_route_scale
        self.score_fn = SCORE_FUNCTIONS[config.moe_score_func]
        self.stats_group = groups.stage
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        mark_param(self.weight, (self.num_experts, config.hidden_size), init=normal_init(config.init_std))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.modality_biases = config.moe_modality_biases
        if self.modality_biases:
            self.register_buffer("image_expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        num_modalities = 2 if self.modality_biases else 1
        self.register_buffer("tokens_per_expert", torch.zeros(num_modalities, self.num_experts, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                replayed: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> RoutingDecision:
        """``x``: [N, hidden]; ``image_mask``: [N] bool or None; ``replayed``: [N, K] ids to
        use instead of top-k (routing replay) or None; ``counted``: [N] bool, the tokens whose
        selections count toward the expert loads of the bias update (None: all)."""
        scores = self.score_fn(F.linear(cast(x, torch.float32), cast(self.weight, torch.float32)))
        if replayed is None:
            with torch.no_grad():
                indices = (scores + self._selection_bias(image_mask)).topk(self.topk, dim=-1).indices
        else:
            indices = self._check_replayed(replayed, x.size(0))
        probs = scores.gather(1, indices)
        if self.norm_topk_prob and self.topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * self.route_scale
        if self.training:
            if counted is None:
                self._count(indices, image_mask)
            else:
                counted = counted.to(indices.device)
                self._count(indices[counted], None if image_mask is None else image_mask[counted])
        return RoutingDecision(indices=indices, probs=probs, scores=scores)

    def _selection_bias(self, image_mask: torch.Tensor | None) -> torch.Tensor:
        if image_mask is None or not self.modality_biases:
            return cast(self.expert_bias, torch.float32)
        return torch.where(image_mask.unsqueeze(-1), self.image_expert_bias.float(), self.expert_bias.float())

    def _check_replayed(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if tuple(ids.shape) != (num_tokens, self.topk):
            raise ValueError(f"routing replay: expected ids of shape {(num_tokens, self.topk)}, "
                             f"got {tuple(ids.shape)}; was the record made with a different batch, "
                             "sequence length or moe_topk?")
        ids = ids.to(device=self.weight.device, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"routing replay: expert ids outside 0..{self.num_experts - 1}")
        return ids

    @torch.no_grad()
    def _count(self, indices: torch.Tensor, image_mask: torch.Tensor | None) -> None:
        modality = torch.full(indices.shape[:1], TEXT, dtype=torch.int64, device=indices.device)
        if image_mask is not None and self.modality_biases:
            modality = torch.where(image_mask, IMAGE, TEXT)
        flat = (modality.unsqueeze(-1) * self.num_experts + indices).reshape(-1)
        counts = torch.bincount(flat, minlength=self.tokens_per_expert.numel())
        self.tokens_per_expert += counts.view_as(self.tokens_per_expert)

    # ---- aux-loss-free bias update (once per optimiser step) --------------------------------
    def update_expert_bias(self, rate: float) -> torch.Tensor:
        """Update this router's biases from its counts summed over ``stats_group``; reset the
        counts. Collective. Returns the summed loads [num_modalities, num_experts]."""
        return update_expert_biases([self], rate)[0]

    @torch.no_grad()
    def apply_bias_update(self, load: torch.Tensor, rate: float) -> None:
        """Apply the sign rule with already-reduced loads and reset the counters."""
        self.expert_bias.copy_(expert_bias_update(self.expert_bias, load[TEXT], rate))
        if self.modality_biases:
            self.image_expert_bias.copy_(expert_bias_update(self.image_expert_bias, load[IMAGE], rate))
        self.tokens_per_expert.zero_()
