"""Expert load balancing: multimodal auxiliary-loss-free biases and the sequence balance loss.

**Auxiliary-loss-free balancing with modality-specific biases** (report §2.1.1, "Multimodal
Auxiliary-loss-free Load Balancing for MoEs"; rate 0.001 in §4.2.2). Every router keeps one
correction bias per expert for text tokens and one for image tokens. The bias only steers
top-k selection; combine weights come from the unbiased scores. After each optimiser step the
two biases are updated independently from the expert loads of their own modality::

    b_m <- b_m + rate * sign(mean_i(load_m) - load_m)        (per modality m)

A modality that had no tokens in the step keeps its bias. Loads are counted by the routers
during the step and summed over every rank that holds the layer and routes different tokens
(``groups.stage`` = tp x cp x dp: the MoE layer splits routed tokens over tp, so tp ranks
route disjoint tokens too), so that every replica applies the identical update.
:func:`update_expert_biases` does this for all routers of a model with one all-reduce.

**Sequence-level balance loss** (§4.2.2: weight 0.0001 "to avoid extreme imbalance within
single sequences"; the DeepSeek-V3 complementary loss). For every sequence (batch row) of
T tokens, with N_r routed experts and K_r selected per token::

    f_i = N_r / (K_r T) * sum_t 1[token t selects expert i]
    P_i = 1 / T * sum_t s'_{i,t},   s'_{.,t} = s_{.,t} / sum_j s_{j,t}
    L   = coeff * sum_i f_i P_i,    averaged over the rows of the micro-batch.

Only rows that bear loss count (``rows``; post-training: a filler row of a multi-branch batch, or
any row whose labels are all masked, is left out of the average — it would otherwise pull the
router toward balancing a copy it is not trained on, :mod:`megatron_s2.posttrain.episode_rows`).

A row is a packed sequence: document boundaries inside it are not respected (the loss is a
regulariser; per row is what the report's "single sequences" means for packed training).
Selections f_i use the biased top-k (what actually ran). When a row is split over ranks
(tensor-parallel token split / sequence parallelism, context parallelism) the per-row sums
are all-reduced so the value equals the single-rank one. The sums have an identity
backward: every rank of the split adds the same loss value but backpropagates only its own
tokens' share, and the gradient finaliser *sums* those shares (the router weight is placed
tp-partial -> summed over tp; dense gradients summed over dp x cp, see
``megatron_s2.parallel.grad_finalize``), which gives exactly the single-rank gradient.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group

__all__ = ["expert_bias_update", "update_expert_biases", "sequence_balance_loss"]


def expert_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean(load) - load)`` along the last dim (shapes ``[..., num_experts]``).
    A row of ``load`` without tokens has mean = load = 0, so sign(0) = 0 leaves its bias unchanged."""
    load = load.to(torch.float64)
    step = rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
    return (bias.to(torch.float64) + step).to(bias.dtype)


@torch.no_grad()
def update_expert_biases(routers: Iterable, rate: float) -> torch.Tensor | None:
    """Apply the aux-free update to every router (one collective for all of them) and reset
    their load counters. Collective over the routers' statistics group: call it on every
    rank of the pipeline stage, once per optimiser step. Returns the summed loads
    ``[num_routers, num_modalities, num_experts]`` (for logging), or None without routers."""
    routers = list(routers)
    if not routers:
        return None
    groups = {r.stats_group.ranks for r in routers}
    if len(groups) != 1:
        raise ValueError(f"update_expert_biases: routers reduce over different groups {sorted(groups)}; "
                         "update each pipeline stage's routers separately")
    loads = torch.stack([r.tokens_per_expert for r in routers])
    group = routers[0].stats_group
    if group.active:
        loads = loads.clone()
        dist.all_reduce(loads, group=group.pg)
    for router, load in zip(routers, loads, strict=True):
        router.apply_bias_update(load, rate)
    return loads


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, coeff: float, *,
                          row_split: Sequence[Group] = (), partial: Sequence[Group] = (),
                          rows: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over rows (``rows`` [b] bool: only those;
    None: all).

    ``scores``: ``[b, t, N_r]`` unbiased router scores of this rank's tokens (differentiable);
    ``indices``: ``[b, t, K_r]`` selected experts; ``row_split``: the groups over which each
    row's tokens are split (tp for the routed-token split), whose partial sums are all-reduced
    with an identity backward, so every rank holds the whole loss; ``partial``: groups that also
    split the rows (cp) but whose ranks keep their own share of the loss — it is linear in the
    per-row score sums, so the shares add up to the whole loss (the step's metric reduction over
    dp x cp sums them) and each share's gradient is the whole loss's gradient for this rank's
    tokens. The expert counts are always reduced over both.
    """
    b, _, num_experts = scores.shape
    topk = indices.size(-1)
    with torch.no_grad():
        counts = torch.zeros(b, num_experts, dtype=torch.float32, device=scores.device)
        picks = indices.flatten(1)
        counts.scatter_add_(1, picks, torch.ones(picks.shape, device=scores.device))
        for group in (*row_split, *partial):
            counts = mappings.all_reduce_sum(counts, group)
        tokens = counts.sum(dim=-1, keepdim=True) / topk
        f = counts * (num_experts / topk) / tokens.clamp(min=1)
    normed = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    prob_sum = normed.sum(dim=1)
    for group in row_split:
        prob_sum = mappings.reduce_from_group(prob_sum, group)
    p = prob_sum / tokens.clamp(min=1)
    if rows is None:
        return coeff * (f * p).sum() / max(b, 1)
    rows = rows.to(p.device, torch.bool)
    return coeff * (f * p)[rows].sum() / rows.sum().clamp(min=1)
