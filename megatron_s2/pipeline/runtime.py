"""This rank's pipeline stages at run time: topology, transport, and the family's cut messages.

A rank holds one model object with the union of its (virtual) stages' layers (global layer
names, so initialisation and checkpoints do not depend on the cut) and runs stage ``v`` as
``run_layers(hidden, ctx, layer_ids=stage_layers[v])``. What crosses a cut is the hidden state
plus whatever the family's :class:`~megatron_s2.models.family.base.StagePayloads` adds (for the
V4.1 backbone the CSA2 shared states, report §3.1.2); the transport moves the message as one
buffer. Each (micro-batch, stage) keeps its own forward context, so the states of concurrently
active micro-batches never mix; what the backward pass still needs lives in the autograd graph.
"""

from __future__ import annotations

from torch import nn

from megatron_s2.models.family.base import StagePayloads
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.p2p import PipelineTransport

__all__ = ["PipelineRuntime"]


class PipelineRuntime:
    def __init__(self, model: nn.Module, layout: ParallelLayout, groups: ParallelGroups, pp_rank: int,
                 payloads: StagePayloads):
        self.model, self.layout, self.groups, self.pp_rank = model, layout, groups, pp_rank
        self.payloads = payloads
        self.p, self.vpp = layout.pp, layout.vpp
        self.stages = layout.stages_of_rank(pp_rank)  # global stage ids, virtual order
        self.stage_layers = layout.stage_layers
        device = next(model.parameters()).device
        self.transport = PipelineTransport(groups.pp.ranks, self.vpp, device)
        self.payloads.refresh()
        self.peak_state_bytes = 0  # state bytes beyond the hidden state held by in-flight micro-batches
        self.peak_in_flight = 0    # most (stage, micro-batch) units alive at once
        self.metric_names: list[str] | None = None  # union over stages, agreed once

    # ---- topology ----------------------------------------------------------------------------
    def pp_of_stage(self, stage: int) -> int:
        return stage % self.p

    def num_stages(self) -> int:
        return len(self.stage_layers)

    def is_first(self, stage: int) -> bool:
        return stage == 0

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages() - 1

    # ---- the family's messages ---------------------------------------------------------------
    @property
    def num_hidden(self) -> int:
        return self.payloads.num_hidden

    def spec_for(self, stage: int, micro_batch: dict):
        return self.payloads.spec_for(stage, micro_batch)

    def export(self, stage: int, hidden, ctx, micro_batch: dict):
        return self.payloads.export(stage, hidden, ctx, micro_batch)

    def import_states(self, stage: int, spec, tensors, ctx) -> None:
        self.payloads.import_states(stage, spec, tensors, ctx)

    def request_exports(self, stage: int, ctx) -> None:
        if not self.is_last(stage):
            self.payloads.request_exports(stage, ctx)

    def refresh(self) -> None:
        """After each optimiser step (replicas follow their owners)."""
        self.payloads.refresh()

    def sync_grads(self) -> None:
        self.payloads.sync_grads()
