"""Loss normalisation that does not depend on the parallel layout.

The language-model loss of a step is the mean cross-entropy over every loss-bearing token of
the *global* batch. Each micro-batch contributes ``sum(ce * mask) / global_tokens``, so
gradients summed over micro-batches and data-parallel ranks are exactly the gradient of that
mean, whatever the split. Auxiliary losses (MoE sequence balance, indexer alignment) are
per-micro-batch means and are averaged over all micro-batches of the global batch.
"""

from __future__ import annotations

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group

__all__ = ["global_token_count", "micro_batch_objective"]


def global_token_count(micro_batches: list[dict[str, torch.Tensor]], dp: Group) -> torch.Tensor:
    local = sum(mb["loss_mask"].sum() for mb in micro_batches).float().reshape(1)
    return mappings.all_reduce_sum(local, dp).clamp_min(1.0)


def micro_batch_objective(token_loss: torch.Tensor, loss_mask: torch.Tensor, global_tokens: torch.Tensor,
                          aux: torch.Tensor | None, num_micro_global: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective to backpropagate, this micro-batch's summed token loss for logging)."""
    summed = (token_loss * loss_mask).sum()
    objective = summed / global_tokens.squeeze()
    if aux is not None:
        objective = objective + aux / num_micro_global
    return objective, summed.detach()
