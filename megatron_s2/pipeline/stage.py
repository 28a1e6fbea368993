"""Per-rank pipeline runtime: this rank's (virtual) stages of the backbone and how one
micro-batch moves through them.

A rank holds one model object with the union of its stages' layers (global layer names, so
initialisation and checkpoints do not depend on the cut) and runs stage ``v`` as
``run_layers(layer_ids=stage_layers[v])``. Crossing a cut, the registry of the micro-batch
exports the payload's shared states (:mod:`.payload`); the next stage imports them into a
fresh registry, re-deriving what the payload modes ask to recompute with shadow replicas
(:mod:`.shadows`). Each (micro-batch, stage) keeps its own registry, so the states of
concurrently active micro-batches never mix; what the backward pass still needs lives in the
autograd graph and is released by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_s2.config.layer_plan import SharedStateKind as K
from megatron_s2.config.model import ModelConfig
from megatron_s2.models.v41.attention.visibility import entry_doc_ids
from megatron_s2.models.v41.model import V41Model
from megatron_s2.kernels.quantize import fake_quant_fp4_e4m3
from megatron_s2.models.v41.rope import apply_rope, rope_frequencies
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.p2p import PipelineTransport
from megatron_s2.pipeline.payload import PayloadModes, PayloadSpec, payload_keys
from megatron_s2.pipeline.shadows import ShadowSet, shadow_components

__all__ = ["PipelineRuntime", "build_pipeline_model", "StageInput"]


@dataclass
class StageInput:
    x: torch.Tensor | None
    pre: torch.Tensor | None
    states: dict


class PipelineRuntime:
    def __init__(self, model: V41Model, layout: ParallelLayout, groups: ParallelGroups, pp_rank: int,
                 modes: PayloadModes):
        self.model, self.layout, self.groups, self.pp_rank, self.modes = model, layout, groups, pp_rank, modes
        self.cfg: ModelConfig = model.config
        self.plan = model.plan
        self.p, self.vpp = layout.pp, layout.vpp
        self.stages = layout.stages_of_rank(pp_rank)  # global stage ids, virtual order
        self.stage_layers = layout.stage_layers
        self.inv_freq = rope_frequencies(self.cfg.rope_head_dim, self.cfg.compress_rope_theta,
                                         self.cfg.rope_scaling_original_seq_len, self.cfg.rope_scaling_factor,
                                         self.cfg.rope_beta_fast, self.cfg.rope_beta_slow)
        components = shadow_components(self.plan, self.stage_layers, self.pp_of_stage,
                                       lambda cut: payload_keys(self.plan, cut, modes))
        self.shadows = ShadowSet(self.cfg, groups, components, pp_rank, model)
        device = next(model.parameters()).device
        self.transport = PipelineTransport(groups.pp.ranks, self.vpp, device)
        self.shadows.refresh()
        self.peak_state_bytes = 0  # shared-state bytes held at stage boundaries by in-flight micro-batches
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

    def spec_for(self, stage: int, mb: dict) -> PayloadSpec:
        """Payload entering ``stage`` for micro-batch ``mb`` (shapes from this rank's slice)."""
        b, local = mb["tokens"].shape
        full = mb.get("full_seq", local)
        stream = self.groups.sequence.stream_length(local)
        return PayloadSpec.build(self.cfg, self.plan, self.stage_layers[stage][0], self.modes, batch=b,
                                 local_seq=local, full_seq=full, stream_seq=stream, tp_size=self.groups.tp.size)

    # ---- payload export / import -------------------------------------------------------------
    def export(self, stage: int, x, pre, ctx, mb: dict) -> list[torch.Tensor]:
        """The outgoing payload, checked field by field against what the next stage expects
        (a dtype or shape mismatch would otherwise be silently reinterpreted by the transport)."""
        spec = self.spec_for(stage + 1, mb)
        states = ctx.shared.export(spec.keys)
        tensors = [x, pre, *[states[k] for k in spec.keys]]
        out = []
        for t, f in zip(tensors, spec.fields):
            if not f.requires_grad and t.dtype != f.dtype:
                t = t.to(f.dtype)  # index fields are sent compactly
            if t.dtype != f.dtype or tuple(t.shape) != f.shape:
                raise RuntimeError(f"pipeline payload field '{f.name}' at the cut before layer {spec.cut}: "
                                   f"expected {f.dtype} {f.shape}, produced {t.dtype} {tuple(t.shape)}")
            out.append(t)
        return out

    def request_exports(self, stage: int, ctx) -> None:
        if not self.is_last(stage):
            ctx.shared.requested = set(payload_keys(self.plan, self.stage_layers[stage + 1][0], self.modes))

    def import_states(self, stage: int, spec: PayloadSpec, tensors: list[torch.Tensor], ctx) -> None:
        first = self.stage_layers[stage][0]
        received = {key: (t.long() if t.dtype == torch.int32 else t) for key, t in zip(spec.keys, tensors[2:])}
        crossing = set(self.plan.crossing(first))
        out: dict = {}
        order = {K.LATENT: 0, K.INDEX_K: 1, K.CANDIDATE_QUERY: 2}
        for (producer, kind), value in sorted(received.items(), key=lambda kv: order.get(kv[0][1], -1)):
            if kind is K.LATENT:
                ratio = self.plan[producer].compress_ratio
                n = value.size(1)
                pos = (torch.arange(n, device=value.device) * ratio).expand(value.size(0), n)
                main_kv = apply_rope(value, pos, self.inv_freq)
                if self.cfg.fp4_main_kv:
                    main_kv = fake_quant_fp4_e4m3(main_kv)
                out[(producer, K.MAIN_KV)] = main_kv
                if (producer, K.INDEX_K) in crossing:
                    out[(producer, K.INDEX_K)] = self.shadows.module(producer, "index_key")(value.detach(), pos,
                                                                                          self.inv_freq)
                out[(producer, K.LATENT)] = value
            elif kind is K.CANDIDATE_QUERY:
                indexer = self.shadows.module(producer, "candidate_query")
                qr, weights = value[..., :self.cfg.q_lora_rank], value[..., self.cfg.q_lora_rank:]
                index_k = out.get((producer, K.INDEX_K), received.get((producer, K.INDEX_K)))
                ratio = self.plan[producer].compress_ratio
                with torch.no_grad():
                    q_idx = indexer.queries(qr, ctx.positions, self.inv_freq)
                    sel = indexer.select(q_idx, weights, index_k, ctx.positions, ratio, ctx.doc_ids,
                                         entry_doc_ids(ctx.full_doc_ids if ctx.full_doc_ids is not None
                                                       else ctx.doc_ids, ratio, index_k.size(1)),
                                         make_candidates=True)
                out[(producer, K.CANDIDATES)] = sel.candidates
                out[(producer, K.CANDIDATE_QUERY)] = value
            else:
                out[(producer, kind)] = value
        ctx.shared.import_states(out, below=first)


def build_pipeline_model(cfg: ModelConfig, layout: ParallelLayout, groups: ParallelGroups, rank: int, *,
                         seed: int, modes: PayloadModes | None = None) -> tuple[V41Model, PipelineRuntime]:
    """This rank's stages (one model object with the union of their layers) and the runtime
    that moves micro-batches through them; the model itself knows nothing of the pipeline."""
    pp_rank = layout.coords(rank)["pp"]
    stages = layout.stages_of_rank(pp_rank)
    layers = [layer for s in stages for layer in layout.stage_layers[s]]
    model = V41Model(cfg, groups, layers=layers, pre_process=0 in stages,
                     post_process=len(layout.stage_layers) - 1 in stages).init_weights(seed)
    return model, PipelineRuntime(model, layout, groups, pp_rank, modes or PayloadModes())
