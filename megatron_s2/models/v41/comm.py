"""Analytic communication volume of one optimiser step, per rank, by parallel dimension.

Bytes that leave one rank per step ("wire" bytes: ring all-reduce ``2 (g-1)/g N``,
all-gather / reduce-scatter ``(g-1)/g N`` of the full tensor, all-to-all the off-rank part,
point-to-point the message), for ``m`` micro-batches of ``T = b s / cp`` local tokens and
the layers of the rank's stages. It ranks layouts (``megatron-s2 plan layouts``), so it keeps
the terms that grow with the model and the batch and drops scalars:

* **TP / SP** — per layer and micro-batch, the attention and shared-expert region boundaries
  (all-reduce of ``T d``, or the all-gather + reduce-scatter pair under SP: the same bytes),
  forward and backward, and the routed-token gather of the MoE region; the embedding and LM
  head boundaries; the latents gathered over the sequence inside attention under SP;
* **EP** — per MoE layer and micro-batch: dispatch and combine of the routed rows, forward
  and backward (4 all-to-all of ``T/tp * k * d``);
* **ETP** — the routed rows all-gathered and partial outputs reduce-scattered over etp;
* **DP** — the gradient all-reduce over data x context (dense) and expert-data (experts);
  ZeRO-1's reduce-scatter of gradients + all-gather of parameters moves the same bytes;
* **PP** — the payload (``PayloadSpec``: streams + shared states) sent forward and its
  gradient sent back, per micro-batch and cut of the rank;
* **CP** — the all-gather of the compressor projections (C and Z) of every Full layer and of
  the window halo, forward and backward;
* **Engram** — rows fetched from and gradients returned to the row owners (all-to-all).
"""

from __future__ import annotations

from megatron_s2.models.v41.layer_plan import CSA2Mode
from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.models.family.base import CommVolume
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["comm_volume"]

F = 4  # bytes per element (float32 activations and gradients)


def _ring(g: int) -> float:
    return 2 * (g - 1) / g if g > 1 else 0.0


def _gather(g: int) -> float:
    return (g - 1) / g if g > 1 else 0.0


def comm_volume(recipe: RecipeConfig, layout: ParallelLayout, pp_rank: int, grad_bytes: float,
                expert_grad_bytes: float = 0.0) -> CommVolume:
    """Wire bytes of one step on a rank of pipeline stage ``pp_rank``.

    ``grad_bytes`` / ``expert_grad_bytes``: the rank's dense / expert gradient bytes (from
    the model-state count), reduced over data x context / expert-data parallelism."""
    from megatron_s2.models.v41.pipeline.payload import PayloadModes, PayloadSpec

    c, t, out = recipe.model, recipe.training, CommVolume()
    m = t.global_batch_size // (t.micro_batch_size * layout.dp)
    b, s = t.micro_batch_size, t.seq_length
    T = b * s / layout.cp
    d, tp = c.hidden_size, layout.tp
    stages = layout.stages_of_rank(pp_rank)
    layers = [c.plan[i] for st in stages for i in layout.stage_layers[st]]
    last = len(layout.stage_layers) - 1
    # ---- tensor / sequence parallel -------------------------------------------------------
    per_layer = 4 * T * d * _ring(tp) + 2 * T * d * _gather(tp)  # attn + shared expert, fwd+bwd; MoE gather
    if layout.sequence_parallel:
        per_layer += 2 * T * (c.q_lora_rank + 2 * c.head_dim + c.index_num_heads) * _gather(tp)
    ends = (0 in stages) + (last in stages)
    out.add("tp", F * m * (len(layers) * per_layer + ends * 2 * T * d * _ring(tp)))
    # ---- expert (tensor) parallel ---------------------------------------------------------
    rows = T / tp * c.moe_topk
    out.add("ep", F * m * len(layers) * 4 * rows * d * _gather(layout.ep))
    out.add("etp", F * m * len(layers) * 4 * rows * d * layout.etp * _gather(layout.etp))
    # ---- data parallel --------------------------------------------------------------------
    dense_group, expert_group = layout.dp * layout.cp, layout.edp
    # ZeRO-1 reduce-scatters gradients to their owners and all-gathers the updated parameters:
    # (g-1)/g N each, the wire of plain data parallelism's all-reduce (whole-parameter padding aside).
    out.add("dp", _ring(dense_group) * grad_bytes + _ring(expert_group) * expert_grad_bytes)
    # ---- pipeline -------------------------------------------------------------------------
    if layout.pp > 1:
        modes = PayloadModes(recipe.parallel.payload_index_k, recipe.parallel.payload_candidates)
        local = s // layout.cp
        stream = local // tp if layout.sequence_parallel else local
        for st in stages:
            if st < last:
                spec = PayloadSpec.build(c, c.plan, layout.stage_layers[st + 1][0], modes, batch=b, local_seq=local,
                                         full_seq=s, stream_seq=stream, tp_size=tp)
                grads = sum(f.nbytes for f in spec.fields if f.requires_grad)
                out.add("pp", m * (spec.nbytes + grads))
    # ---- context parallel -----------------------------------------------------------------
    if layout.cp > 1:
        for spec in layers:
            width = c.head_dim * (2 if spec.mode is CSA2Mode.FULL and spec.compress_ratio > 1 else 1)
            full = b * s * width if spec.mode is CSA2Mode.FULL else 0.0
            out.add("cp", F * m * 2 * (full * _gather(layout.cp) + b * c.window_size * c.head_dim))
    # ---- engram ---------------------------------------------------------------------------
    if layout.engram > 1:
        hosts = sum(1 for spec in layers if spec.has_engram)
        width = c.engram_num_tables * c.engram_head_dim
        out.add("engram", F * m * hosts * 2 * T / (tp if layout.sequence_parallel else 1) * width * _gather(layout.engram))
    return out
