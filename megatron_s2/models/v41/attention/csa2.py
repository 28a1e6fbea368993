"""The attention layer of the V4.1 backbone: sliding window + CSA2 (report §2.2–§2.3).

Every layer computes its own query and its own sliding-window (SWA) KV from its own hidden
state. A CSA2 layer additionally attends to top-k entries of a compressed main KV, in the
same softmax as the window (§2.3). How it obtains main KV, index K and top-k depends on its
statically assigned mode (§2.3.1; plan in :mod:`megatron_s2.config.layer_plan`):

=========  ===================================  ===========================  ===============
mode       main KV                              index K                      top-k
=========  ===================================  ===========================  ===============
Full       own compressor (decoder: from H_L/2)  projected from own main KV   own indexer
Reindex    reused from the latest Full layer     reused with it               own indexer
Reuse      reused from the latest Full layer     not needed                   reused
=========  ===================================  ===========================  ===============

Shared states go through ``ctx.shared`` keyed by the producing layer, never through module
attributes. The output path removes the query RoPE from the attention output, then applies
the grouped low-rank projection (o_groups groups of H/G heads -> o_lora_rank each -> d).

Tensor parallelism (the ``"attention"``, ``"index_key"`` and ``"indexer"`` sections of
:mod:`megatron_s2.models.v41.parallel_plan`): query heads, indexer heads, output groups and
sink logits are split over tp. The latent projections (window KV, compressor, index K,
q_down) are replicated: they are small per-token projections shared by all heads, computed
once per rank on the tokens the rank holds (its stream shard under SP) and gathered over the
sequence by the layer's :class:`~megatron_s2.parallel.sequence.SequenceSharding` (which also
owns the CP gather and the window halo); the plan marks their gradients tp-partial.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_s2.config.layer_plan import CSA2Mode, LayerSpec, SharedStateKind as K
from megatron_s2.config.model import ModelConfig
from megatron_s2.kernels import sparse_attention
from megatron_s2.models.init import constant_init
from megatron_s2.models.v41.attention.compressor import Compressor
from megatron_s2.models.v41.attention.indexer import IndexKeyProjection, Indexer
from megatron_s2.models.v41.attention.visibility import entry_doc_ids, window_indices
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.models.v41.precision import wide
from megatron_s2.models.v41.quant import fake_quant_fp4_e4m3, fake_quant_fp8
from megatron_s2.models.v41.recompute import selective_checkpoint
from megatron_s2.models.v41.rope import apply_rope, rope_frequencies
from megatron_s2.models.v41.spec import LinearSubmodules
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import mark_param

__all__ = ["CSA2Attention"]


class CSA2Attention(nn.Module):
    PLAN_SECTION = "attention"

    def __init__(self, config: ModelConfig, spec: LayerSpec, groups: ParallelGroups,
                 linears: LinearSubmodules | None = None):
        super().__init__()
        L = linears or LinearSubmodules()
        tp = groups.tp
        self.config, self.spec, self.tp, self.cp = config, spec, tp, groups.cp
        self.seq = groups.sequence
        d, h, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.local_heads = h // tp.size
        self.local_groups = config.o_groups // tp.size
        self.head_dim, self.window = hd, config.window_size
        self.scale = hd ** -0.5

        self.linear_q_down = L.replicated_linear(d, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
        self.linear_q_up = L.column_parallel_linear(config.q_lora_rank, h * hd, tp, region_entry=False)
        self.linear_kv = L.replicated_linear(d, hd)
        self.kv_norm = RMSNorm(hd, config.norm_eps)
        self.attn_sink = None
        if config.attn_sink:
            self.attn_sink = nn.Parameter(torch.zeros(self.local_heads))
            mark_param(self.attn_sink, (h,), [(0, tp.rank, tp.size)], init=constant_init(0.0))
        group_in = h * hd // config.o_groups
        self.linear_out_a = nn.Parameter(torch.empty(self.local_groups * config.o_lora_rank, group_in))
        mark_param(self.linear_out_a, (config.o_groups * config.o_lora_rank, group_in), [(0, tp.rank, tp.size)])
        self.linear_out_b = L.row_parallel_linear(config.o_groups * config.o_lora_rank, d, tp,
                                                  sequence_parallel=self.seq.sp)

        csa2 = spec.is_csa2
        theta = config.compress_rope_theta if csa2 else config.rope_theta
        yarn = config.rope_scaling_original_seq_len if csa2 else 0
        self.register_buffer("inv_freq", rope_frequencies(
            config.rope_head_dim, theta, yarn, config.rope_scaling_factor,
            config.rope_beta_fast, config.rope_beta_slow), persistent=False)

        self.selective_recompute = False  # checkpoint the attention core (set by the model)
        self.compressor = self.index_key = self.indexer = None
        if spec.mode is CSA2Mode.FULL:
            self.compressor = Compressor(config, spec.compress_ratio, from_encoder_output=spec.uses_encoder_output,
                                         linears=L)
            self.index_key = IndexKeyProjection(config, tp, linears=L)
        if spec.runs_indexer:
            self.indexer = Indexer(config, tp, linears=L)
        apply_plan(self, groups, config)

    # ---- helpers ---------------------------------------------------------------------------
    def _window(self, kv: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys (with the CP halo) and each query's window indices into them."""
        keys, k_pos, k_doc = self.seq.window_keys(kv, ctx.positions, self.window, ctx.doc_ids, ctx.full_doc_ids)
        return keys, window_indices(ctx.positions, k_pos, self.window, ctx.doc_ids, k_doc)

    # ---- main-KV / top-k acquisition (§2.3.1) ----------------------------------------------
    def _main_kv(self, x_in: torch.Tensor, ctx: ForwardContext):
        spec, ratio = self.spec, self.spec.compress_ratio
        if spec.mode is not CSA2Mode.FULL:
            main_kv = ctx.shared.consume(spec.index, spec.kv_source, K.MAIN_KV)
            index_k = ctx.shared.consume(spec.index, spec.kv_source, K.INDEX_K) if spec.runs_indexer else None
            return main_kv, index_k
        src = x_in
        if spec.uses_encoder_output:  # CED (§2.2, Eq. 1): main KV from H_{L/2}
            src = self.seq.enter_local(ctx.shared.consume(spec.index, spec.encoder_source, K.ENCODER_OUTPUT))
        kv, gate = self.compressor.project(src)
        kv = self.seq.gather_full(kv, ctx.positions)
        gate = self.seq.gather_full(gate, ctx.positions) if gate is not None else None
        latent = self.compressor.pool(kv, gate)  # [b, n, hd], RoPE-free
        n = latent.size(1)
        entry_pos = (torch.arange(n, device=latent.device) * ratio).expand(latent.size(0), n)
        index_k = self.index_key(latent.detach(), entry_pos, self.inv_freq)
        main_kv = apply_rope(latent, entry_pos, self.inv_freq)
        if self.config.fp4_main_kv:  # FP4 QAT after RoPE (§2.4.4)
            main_kv = fake_quant_fp4_e4m3(main_kv)
        ctx.shared.publish(spec.index, K.MAIN_KV, main_kv)
        ctx.shared.publish(spec.index, K.INDEX_K, index_k)
        ctx.shared.publish(spec.index, K.LATENT, latent)  # kept only when a pipeline cut asks for it
        return main_kv, index_k

    def _topk(self, x_in, qr, index_k, n_entries, ctx: ForwardContext):
        spec = self.spec
        if not spec.runs_indexer:
            return ctx.shared.consume(spec.index, spec.index_source, K.TOPK), None
        ratio, pos, doc = spec.compress_ratio, ctx.positions, ctx.doc_ids
        weights = self.indexer.local_weights(self.seq.gather_chunk(self.indexer.head_weights(x_in.detach())))
        q_idx = self.indexer.queries(qr.detach(), pos, self.inv_freq)
        candidates = None
        if spec.candidate_source is not None and not spec.is_candidate_source:
            candidates = ctx.shared.consume(spec.index, spec.candidate_source, K.CANDIDATES)
        e_doc = entry_doc_ids(self.seq.full_sequence(ctx.doc_ids, ctx.full_doc_ids), ratio, n_entries)
        sel = self.indexer.select(q_idx, weights, index_k, pos, ratio, doc, e_doc, candidates=candidates,
                                  make_candidates=spec.is_candidate_source)
        ctx.shared.publish(spec.index, K.TOPK, sel.topk)
        if spec.is_candidate_source:
            ctx.shared.publish(spec.index, K.CANDIDATES, sel.candidates)
            ctx.shared.publish(spec.index, K.CANDIDATE_QUERY, torch.cat([qr.detach().float(), weights.detach()], -1))
        self.last_scored_per_query = sel.scored_per_query
        return sel.topk, (q_idx, weights)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [b, s_local, d] (normalised block input; sequence shard under SP)."""
        x_in = self.seq.enter_local(x)
        pos = ctx.positions
        qr = self.seq.gather_chunk(self.q_norm(self.linear_q_down(wide(x_in))))
        q = self.linear_q_up(qr).unflatten(-1, (self.local_heads, self.head_dim))
        q = apply_rope(q, pos, self.inv_freq)
        kv = self.seq.gather_chunk(self.kv_norm(self.linear_kv(wide(x_in))))
        kv = apply_rope(kv, pos, self.inv_freq)
        if self.config.fp8_swa_kv:
            kv = fake_quant_fp8(kv)
        kv, indices = self._window(kv, ctx)
        split, indexer_inputs = None, None
        if self.spec.is_csa2:
            main_kv, index_k = self._main_kv(x_in, ctx)
            topk, indexer_inputs = self._topk(x_in, qr, index_k, main_kv.size(1), ctx)
            n_window = kv.size(1)
            kv = torch.cat([kv, main_kv.to(kv.dtype)], dim=1)
            indices = torch.cat([indices, torch.where(topk >= 0, topk + n_window, -1)], dim=-1)
            split = self.window
        want_mass = indexer_inputs is not None and self.training and self.config.indexer_loss_coeff > 0
        split = split if want_mass else None
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            o, mass = selective_checkpoint(lambda q_, kv_: sparse_attention(q_, kv_, indices, self.attn_sink, self.scale,
                                                                            split=split), q, kv)
        else:
            o, mass = sparse_attention(q, kv, indices, self.attn_sink, self.scale, split=split)
        if want_mass:
            q_idx, weights = indexer_inputs
            kl_sum, n = self.indexer.alignment_loss(q_idx, weights, index_k, topk, mass)
            n = mappings.all_reduce_sum(n.float().reshape(1), self.cp)  # mean over the whole sequence
            kl = kl_sum / n.clamp_min(1).squeeze()
            ctx.add_aux_loss("indexer_kl", self.config.indexer_loss_coeff * kl)
            ctx.add_metric("indexer_kl", kl)
        o = apply_rope(o, pos, self.inv_freq, inverse=True)
        b, s = o.shape[:2]
        o = o.reshape(b, s, self.local_groups, -1)
        wo_a = self.linear_out_a.view(self.local_groups, self.config.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a.to(o.dtype)).flatten(2)
        return self.linear_out_b(o)
