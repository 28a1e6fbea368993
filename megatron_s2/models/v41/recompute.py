"""Activation recomputation that keeps cross-layer shared state correct (report §3.1.2).

Full recomputation re-runs a whole block in the backward pass. A CSA2 block *consumes*
states published by earlier layers (main KV, index K, top-k, candidates) and
*publishes* its own; the micro-batch registry releases a state after its last forward
consumer, so a recomputation cannot go back to it. Each recomputed block therefore runs
against a private registry preloaded with exactly the states it consumes (known statically
from the layer plan); the closure holds them until the block's backward has run, then they
are freed. Published states and auxiliary losses are handed to the micro-batch's context
only from the original forward pass; the recomputation writes into throwaway copies, and
MoE routing recorded for replay is rewound so the recomputation replays the same decisions.
This is the "micro-batch-level shared-state management" of §3.1.2: states live until their
last consumer is done across forward, recomputation and backward.

Selective recomputation checkpoints only the attention core (per query chunk,
``CSA2Attention.attend``) and the routed experts (``selective_checkpoint``), which consume no
shared state by construction.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.shared_state import SharedStateRegistry

__all__ = ["run_block_recomputed", "selective_checkpoint"]


def run_block_recomputed(block, x: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext):
    spec = block.spec
    consumed = {key: ctx.shared.consume(spec.index, *key) for key in spec.consumes()}
    plan = ctx.shared.plan
    first = {"done": False}
    outputs: dict = {}

    def fn(x_in: torch.Tensor, pre_in: torch.Tensor):
        local = SharedStateRegistry(plan)
        for (producer, kind), value in consumed.items():
            local.import_states({(producer, kind): value}, below=spec.index)
            local.drop_consumers_outside([spec.index])
        sub = dataclasses.replace(ctx, shared=_PublishCapture(local, plan), aux_losses={}, aux_metrics={})
        if first["done"] and ctx.routing is not None:
            ctx.routing.rewind(spec.index)
        y = block(x_in, pre_in, sub)
        if not first["done"]:
            first["done"] = True
            outputs["published"] = sub.shared.published
            outputs["aux"] = (sub.aux_losses, sub.aux_metrics)
        return y

    x_out, pre_out = checkpoint(fn, x, pre, use_reentrant=False)
    for (producer, kind), value in outputs["published"].items():
        ctx.shared.publish(producer, kind, value)
    losses, metrics = outputs["aux"]
    for name, value in losses.items():
        ctx.add_aux_loss(name, value)
    for name, value in metrics.items():
        ctx.add_metric(name, value)
    return x_out, pre_out


class _PublishCapture:
    """Registry facade for a recomputable block: reads from the private registry, records
    what the block publishes (also visible to the block's own later reads)."""

    def __init__(self, local: SharedStateRegistry, plan):
        self.local, self.plan = local, plan
        self.published: dict = {}

    def publish(self, producer, kind, value):
        self.published[(producer, kind)] = value
        self.local.publish(producer, kind, value)

    def consume(self, consumer, producer, kind):
        return self.local.consume(consumer, producer, kind)

    def peek(self, producer, kind):
        return self.local.peek(producer, kind)


def selective_checkpoint(fn, *args):
    """Checkpoint a shared-state-free piece (attention core, routed experts)."""
    return checkpoint(fn, *args, use_reentrant=False)
