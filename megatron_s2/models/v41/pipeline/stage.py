"""The V4.1 backbone's pipeline cut messages (report §3.1.2: pipeline payload extensions).

Crossing a cut, the shared-state registry of the micro-batch exports the payload's states
(:mod:`.payload`: derived from the layer plan); the next stage imports them into a fresh
registry, re-deriving what the payload modes ask to recompute with shadow replicas
(:mod:`.shadows`). The hidden state is the mHC streams and the single-pass input mix
(``num_hidden = 2``). The generic :class:`~megatron_s2.pipeline.runtime.PipelineRuntime` moves
the messages and runs the schedule.
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.quantize import fake_quant_fp4_e4m3
from megatron_s2.models.family.base import StagePayloads
from megatron_s2.models.family.pipeline import check_outgoing
from megatron_s2.models.v41.attention.visibility import entry_doc_ids
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.layer_plan import SharedStateKind as K
from megatron_s2.models.v41.pipeline.payload import PayloadModes, PayloadSpec, payload_keys
from megatron_s2.models.v41.pipeline.shadows import ShadowSet, shadow_components
from megatron_s2.models.v41.rope import apply_rope, rope_frequencies
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["V41StagePayloads"]


class V41StagePayloads(StagePayloads):
    num_hidden = 2  # (mHC streams, input mix)

    def __init__(self, model, layout: ParallelLayout, groups: ParallelGroups, pp_rank: int, modes: PayloadModes):
        self.model, self.layout, self.groups, self.pp_rank, self.modes = model, layout, groups, pp_rank, modes
        self.cfg: V41Config = model.config
        self.plan = model.plan
        self.stage_layers = layout.stage_layers
        self.inv_freq = rope_frequencies(self.cfg.rope_head_dim, self.cfg.compress_rope_theta,
                                         self.cfg.rope_scaling_original_seq_len, self.cfg.rope_scaling_factor,
                                         self.cfg.rope_beta_fast, self.cfg.rope_beta_slow)
        components = shadow_components(self.plan, self.stage_layers, lambda stage: stage % layout.pp,
                                       lambda cut: payload_keys(self.plan, cut, modes))
        self.shadows = ShadowSet(self.cfg, groups, components, pp_rank, model)

    def spec_for(self, stage: int, mb: dict) -> PayloadSpec:
        """Payload entering ``stage`` for micro-batch ``mb`` (shapes from this rank's slice)."""
        b, local = mb["tokens"].shape
        full = mb.get("full_seq", local)
        stream = self.groups.sequence.stream_length(local)
        return PayloadSpec.build(self.cfg, self.plan, self.stage_layers[stage][0], self.modes, batch=b,
                                 local_seq=local, full_seq=full, stream_seq=stream, tp_size=self.groups.tp.size)

    def export(self, stage: int, hidden, ctx, mb: dict) -> list[torch.Tensor]:
        """The outgoing payload: streams, input mix and the shared states the next stage needs."""
        spec = self.spec_for(stage + 1, mb)
        states = ctx.shared.export(spec.keys)
        tensors = [*hidden, *[states[k] for k in spec.keys]]
        return check_outgoing(tensors, spec, f"the cut before layer {spec.cut}")

    def request_exports(self, stage: int, ctx) -> None:
        ctx.shared.requested = set(payload_keys(self.plan, self.stage_layers[stage + 1][0], self.modes))

    def refresh(self) -> None:
        self.shadows.refresh()
        if self.model.capture_dspark and self.cfg.dspark_layers and self.layout.pp > 1:
            # the drafter on the last stage reads the first stage's embedding (§2.4.3): its replica follows
            self.model.sync_dspark_embedding(self.groups.pp, 0, self.layout.pp - 1)

    def sync_grads(self) -> None:
        self.shadows.sync_grads()

    def replica_parameters(self) -> list[torch.nn.Parameter]:
        return [p for replica in self.shadows.replicas.values() for p in replica.parameters()]

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
