"""The forward/backward schedules of one optimiser step, and the one function that picks one.

:func:`get_forward_backward_func` is the selector the training loop imports (megatron-core's
convention; nothing here imports the loop back): without pipeline parallelism a plain loop
over micro-batches (:func:`forward_backward_no_pipelining`), with it 1F1B or interleaved 1F1B
over the rank's :class:`~megatron_s2.pipeline.runtime.PipelineRuntime`. Every schedule takes
``(model, StepInputs)`` and returns a ``StepResult`` (:mod:`megatron_s2.pipeline.step`).

The order of work on each rank follows megatron-core's schedules (warm-up forwards, steady
one-forward-one-backward, cool-down backwards; with ``v`` virtual stages per rank micro-batches
advance in groups of ``p`` through the virtual stages). Each unit is a (virtual stage,
micro-batch) pair; its forward imports the incoming payload, runs the stage's layers and
exports the outgoing payload, keeping (float inputs, float outputs, auxiliary objective) for
its backward. The last stage computes the token loss normalised by the global token count
(layout-independent, see ``training.losses``); every stage backpropagates its own auxiliary
losses (MoE balance, indexer alignment) together with the gradients received from below.

Bubble fraction of 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.p2p import BACKWARD, FORWARD
from megatron_s2.pipeline.losses import global_token_count, micro_batch_objective
from megatron_s2.pipeline.step import StepInputs, StepResult, make_context, reduce_metrics

if TYPE_CHECKING:
    from megatron_s2.pipeline.runtime import PipelineRuntime

__all__ = ["get_forward_backward_func", "forward_backward_no_pipelining", "forward_backward_pipelined",
           "schedule_order", "image_inputs"]

Schedule = Callable[..., StepResult]


def get_forward_backward_func(layout, pipeline: "PipelineRuntime | None" = None) -> Schedule:
    """The schedule for ``layout``, called as ``schedule(model, inputs)``: a plain loop without
    pipelining; 1F1B / interleaved 1F1B over ``pipeline`` (this rank's runtime) otherwise."""
    if layout.pp == 1:
        return forward_backward_no_pipelining
    if pipeline is None:
        raise ValueError(f"pp={layout.pp} needs this rank's PipelineRuntime (see build_stage_model)")
    return functools.partial(forward_backward_pipelined, runtime=pipeline)


def image_inputs(mb: dict) -> dict:
    """``{"images": ...}`` for a micro-batch with images (``data.kind: image_text``) and
    ``{"series": ...}`` for one with time series (``data.kind: timeseries``), else ``{}``:
    text-only families and micro-batches are called exactly as before."""
    return {key: mb[key] for key in ("images", "series") if mb.get(key) is not None}


def _prepare_step(model, inputs: StepInputs):
    """The family's once-per-step work over the whole local batch (V4.1: Engram rows, §3.1.3)."""
    return model.prepare_step(inputs.micro_batches, lambda mb: make_context(model, mb))


def forward_backward_no_pipelining(model, inputs: StepInputs) -> StepResult:
    groups = inputs.groups
    tokens = global_token_count(inputs.micro_batches, groups.dp_cp)
    loss_sum = torch.zeros((), device=tokens.device)
    metric_sums: dict[str, torch.Tensor] = {}
    step_state = _prepare_step(model, inputs)
    for mb in inputs.micro_batches:
        ctx = make_context(model, mb, inputs.routing, step_state)
        if inputs.loss_fn is not None:  # post-training objective on the logits
            objective, summed = inputs.loss_fn(model, model(mb["tokens"], ctx, **image_inputs(mb)), mb, ctx)
            aux = ctx.total_aux_loss()
            if aux is not None:
                objective = objective + aux / inputs.num_micro_global
        else:
            token_loss = model(mb["tokens"], ctx, labels=mb["labels"], **image_inputs(mb))
            objective, summed = micro_batch_objective(token_loss, mb["loss_mask"], tokens, ctx.total_aux_loss(),
                                                      inputs.num_micro_global)
        objective.backward()
        loss_sum = loss_sum + summed
        for name, value in list(ctx.aux_losses.items()) + [(f"{k}_raw", v) for k, v in ctx.aux_metrics.items()]:
            metric_sums[name] = metric_sums.get(name, 0) + value.detach()
    if step_state is not None:
        step_state.finish()
    loss = mappings.all_reduce_sum(loss_sum.reshape(1), groups.dp_cp)
    return StepResult(float(loss) / float(tokens), int(tokens), reduce_metrics(metric_sums, groups, inputs.num_micro_global))


@dataclass
class _Unit:
    inputs: list[torch.Tensor]           # received float tensors (leaves) in payload order
    input_grad_mask: list[bool]
    outputs: list[torch.Tensor] | None   # exported tensors (None on the last stage)
    objective: torch.Tensor | None       # loss + aux of the last stage, aux of the others
    num_hidden: int = 1                  # leading message fields that are the hidden state

    def state_bytes(self) -> int:
        """Shared-state tensors this in-flight micro-batch keeps alive at the stage boundary
        (payload fields beyond the hidden state, received and sent)."""
        h = self.num_hidden
        held = list(self.inputs[h:]) + list((self.outputs or [])[h:])
        return sum(t.numel() * t.element_size() for t in held)


def schedule_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(F|B, virtual index, micro-batch) in execution order for pipeline rank ``rank``."""
    total = m * v

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        mb = group * p + within % p
        return (v - 1 - chunk if backward else chunk), mb

    if v == 1:
        warmup = min(p - rank - 1, m)
    else:
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order, f, b = [], 0, 0
    for _ in range(warmup):
        order.append(("F", *chunk_mb(f, False)))
        f += 1
    while f < total:
        order.append(("F", *chunk_mb(f, False)))
        f += 1
        order.append(("B", *chunk_mb(b, True)))
        b += 1
    while b < total:
        order.append(("B", *chunk_mb(b, True)))
        b += 1
    return order


def forward_backward_pipelined(model, inputs: StepInputs, *, runtime: "PipelineRuntime") -> StepResult:
    rt = runtime
    groups = inputs.groups
    mbs = inputs.micro_batches
    tokens = global_token_count(mbs, groups.dp_cp)
    order = schedule_order(rt.p, rt.vpp, len(mbs), rt.pp_rank)
    units: dict[tuple[int, int], _Unit] = {}
    loss_sum = torch.zeros((), device=tokens.device)
    metric_sums: dict[str, torch.Tensor] = {}
    transport = rt.transport
    step_state = _prepare_step(model, inputs)
    for op, vi, k in order:
        stage = rt.stages[vi]
        mb = mbs[k]
        if op == "F":
            ctx = make_context(model, mb, inputs.routing, step_state)
            rt.request_exports(stage, ctx)
            inputs_f: list[torch.Tensor] = []
            if rt.is_first(stage):
                hidden = model.embed(mb["tokens"], **image_inputs(mb))  # images: first stage only
                spec = None
            else:
                spec = rt.spec_for(stage, mb)
                received = transport.recv(spec, rt.pp_of_stage(stage - 1), k, vi, FORWARD)
                for t, f in zip(received, spec.fields):
                    if f.requires_grad:
                        t.requires_grad_(True)
                hidden = tuple(received[:rt.num_hidden])
                rt.import_states(stage, spec, received, ctx)
                inputs_f = received
            hidden = model.run_layers(hidden, ctx, layer_ids=rt.stage_layers[stage])
            aux = ctx.total_aux_loss()
            if rt.is_last(stage):
                if inputs.loss_fn is not None:  # post-training objective on the logits
                    objective, summed = inputs.loss_fn(model, model.head(*hidden), mb, ctx)
                    if aux is not None:
                        objective = objective + aux / inputs.num_micro_global
                else:
                    token_loss = model.loss(model.head(*hidden), mb["labels"])
                    objective, summed = micro_batch_objective(token_loss, mb["loss_mask"], tokens, aux,
                                                              inputs.num_micro_global)
                loss_sum = loss_sum + summed
                units[(vi, k)] = _Unit(inputs_f, [f.requires_grad for f in spec.fields] if spec else [], None, objective,
                                       rt.num_hidden)
            else:
                outputs = rt.export(stage, hidden, ctx, mb)
                transport.send(outputs, rt.pp_of_stage(stage + 1), k, (vi + (1 if rt.pp_of_stage(stage) == rt.p - 1 else 0)),
                               FORWARD)
                aux_obj = aux / inputs.num_micro_global if aux is not None else None
                units[(vi, k)] = _Unit(inputs_f, [f.requires_grad for f in spec.fields] if spec else [],
                                       outputs, aux_obj, rt.num_hidden)
            # after the loss_fn: its metrics (e.g. the drafter's draft_*) join the layers' own
            for name, value in list(ctx.aux_losses.items()) + [(f"{n}_raw", v) for n, v in ctx.aux_metrics.items()]:
                metric_sums[name] = metric_sums.get(name, 0) + value.detach()
        else:
            unit = units.pop((vi, k))
            if rt.is_last(stage):
                torch.autograd.backward(unit.objective)
            else:
                spec_next = rt.spec_for(stage + 1, mb)
                grads = transport.recv(spec_next, rt.pp_of_stage(stage + 1), k, vi, BACKWARD)
                outs, gs = [], []
                float_outputs = [t for t, f in zip(unit.outputs, spec_next.fields) if f.requires_grad]
                for t, g in zip(float_outputs, grads):
                    if t.requires_grad:
                        outs.append(t)
                        gs.append(g)
                if unit.objective is not None and unit.objective.requires_grad:  # not from frozen layers
                    outs.append(unit.objective)
                    gs.append(torch.ones_like(unit.objective))
                if outs:
                    torch.autograd.backward(outs, gs)
            if not rt.is_first(stage):
                grads_in = [(t.grad if t.grad is not None else torch.zeros_like(t))
                            for t, need in zip(unit.inputs, unit.input_grad_mask) if need]
                prev_vi = vi - (1 if rt.pp_of_stage(stage) == 0 else 0)
                transport.send(grads_in, rt.pp_of_stage(stage - 1), k, prev_vi, BACKWARD)
        live = sum(u.state_bytes() for u in units.values())
        rt.peak_state_bytes = max(rt.peak_state_bytes, live)
        rt.peak_in_flight = max(rt.peak_in_flight, len(units))
    if step_state is not None:
        step_state.finish()
    transport.flush()
    rt.sync_grads()
    # the step's tail: loss and every metric in one tensor, one all-reduce per group
    names = _metric_names(rt, metric_sums, groups)
    local = torch.stack([loss_sum.float().reshape(()),
                         *[torch.as_tensor(metric_sums.get(n, 0.0), device=loss_sum.device).float().reshape(()) for n in names]])
    totals = mappings.all_reduce_sum(mappings.all_reduce_sum(local, groups.dp_cp), groups.pp)
    metrics = {n: float(v) / max(inputs.num_micro_global, 1) for n, v in zip(names, totals[1:])}
    return StepResult(float(totals[0]) / float(tokens), int(tokens), metrics)


def _metric_names(rt, local: dict, groups) -> list[str]:
    """Metric names are produced by layers, which differ per stage: agree on the union once."""
    if rt.metric_names is None:
        names = sorted(local)
        if groups.pp.active:
            import torch.distributed as dist

            gathered: list = [None] * groups.pp.size
            dist.all_gather_object(gathered, names, group=groups.pp.pg)
            names = sorted({n for part in gathered for n in part})
        rt.metric_names = names
    return rt.metric_names
