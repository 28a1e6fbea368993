"""Forward/backward over the micro-batches of one optimiser step.

:func:`get_forward_backward_func` is the one place that picks the schedule for a layout
(megatron-core's convention): without pipeline parallelism it is a plain loop over
micro-batches; with pipeline parallelism the pipeline runtime provides 1F1B or interleaved
1F1B over the same :class:`StepInputs`. Every schedule returns a :class:`StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.training.losses import global_token_count, micro_batch_objective

__all__ = ["StepInputs", "StepResult", "forward_backward_no_pipelining", "get_forward_backward_func",
           "make_context"]


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


def make_context(model, mb: dict[str, torch.Tensor], routing=None) -> ForwardContext:
    if routing is None:
        routing = mb.get("routing")  # per-micro-batch replay (post-training R3)
    ctx = ForwardContext.create(mb["tokens"], model.plan, positions=mb.get("position_ids"),
                                doc_ids=mb.get("doc_ids"), image_mask=mb.get("image_mask"), routing=routing)
    ctx.swa_from = mb.get("swa_from")
    if "full_tokens" in mb:  # context-parallel chunk of a longer sequence
        ctx.full_input_ids = mb["full_tokens"]
        ctx.full_doc_ids = mb.get("full_doc_ids")
        ctx.full_image_mask = mb.get("full_image_mask")
    return ctx


def _reduce_metrics(sums: dict[str, torch.Tensor], count: int, groups: ParallelGroups, num_micro_global: int) -> dict[str, float]:
    out = {}
    for name, value in sorted(sums.items()):
        total = mappings.all_reduce_sum(value.detach().float().reshape(1), groups.dp_cp)
        out[name] = float(total) / max(num_micro_global, 1)
    return out


def forward_backward_no_pipelining(model, inputs: StepInputs) -> StepResult:
    groups = inputs.groups
    tokens = global_token_count(inputs.micro_batches, groups.dp_cp)
    loss_sum = torch.zeros(())
    metric_sums: dict[str, torch.Tensor] = {}
    for mb in inputs.micro_batches:
        ctx = make_context(model, mb, inputs.routing)
        if inputs.loss_fn is not None:
            objective, summed = inputs.loss_fn(model, model(mb["tokens"], ctx), mb, ctx)
            aux = ctx.total_aux_loss()
            if aux is not None:
                objective = objective + aux / inputs.num_micro_global
        else:
            token_loss = model(mb["tokens"], ctx, labels=mb["labels"])
            objective, summed = micro_batch_objective(token_loss, mb["loss_mask"], tokens, ctx.total_aux_loss(),
                                                      inputs.num_micro_global)
        objective.backward()
        loss_sum = loss_sum + summed
        for name, value in list(ctx.aux_losses.items()) + [(f"{k}_raw", v) for k, v in ctx.aux_metrics.items()]:
            metric_sums[name] = metric_sums.get(name, 0) + value.detach()
    loss = mappings.all_reduce_sum(loss_sum.reshape(1), groups.dp_cp)
    return StepResult(float(loss) / float(tokens), int(tokens), _reduce_metrics(metric_sums, 0, groups, inputs.num_micro_global))


def get_forward_backward_func(layout) -> Callable[..., StepResult]:
    """The schedule for ``layout``: a plain loop without pipelining, the pipeline runtime's
    1F1B / interleaved 1F1B otherwise."""
    if layout.pp == 1:
        return forward_backward_no_pipelining
    from megatron_s2.pipeline.schedules import get_pipeline_schedule

    return get_pipeline_schedule(layout)
