"""What every forward/backward schedule of one optimiser step takes and returns.

:class:`StepInputs` (this rank's micro-batches and groups) goes in, :class:`StepResult`
(global mean loss, tokens, auxiliary metrics) comes out, and :func:`make_context` builds the
forward context of one micro-batch. The schedules themselves — and the one function that picks
one for a layout, ``get_forward_backward_func`` — live in :mod:`megatron_s2.pipeline.schedules`
(megatron-core's layout: the training loop imports only the selector, and nothing below the
loop imports it back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups

__all__ = ["StepInputs", "StepResult", "make_context", "reduce_metrics"]


@dataclass
class StepInputs:
    micro_batches: list[dict[str, torch.Tensor]]
    groups: ParallelGroups
    num_micro_global: int          # micro-batches of the global batch (all dp ranks)
    routing: object | None = None  # RoutingReplay shared by all micro-batches (optional)
    loss_fn: Callable | None = None
    """Optional objective replacing the token cross-entropy (post-training, megatron_s2/posttrain):
    ``loss_fn(model, logits, mb, ctx) -> (objective, summed)`` on the last stage, where
    ``objective`` is this micro-batch's share of the global objective (auxiliary losses are added
    by the schedule) and ``summed`` its logged loss sum (divided by the global token count)."""


@dataclass
class StepResult:
    loss: float                    # global mean token loss
    tokens: int                    # loss-bearing tokens of the global batch
    metrics: dict[str, float] = field(default_factory=dict)  # aux losses/diagnostics, global means


def make_context(model, mb: dict[str, torch.Tensor], routing=None, step_state=None):
    """The forward context of one micro-batch: the family model's own (``model.make_context``)."""
    return model.make_context(mb, routing=routing, step_state=step_state)


def reduce_metrics(sums: dict[str, torch.Tensor], groups: ParallelGroups, num_micro_global: int) -> dict[str, float]:
    """Per-micro-batch metric sums of this rank -> global means over the global batch."""
    out = {}
    for name, value in sorted(sums.items()):
        total = mappings.all_reduce_sum(value.detach().float().reshape(1), groups.dp_cp)
        out[name] = float(total) / max(num_micro_global, 1)
    return out
