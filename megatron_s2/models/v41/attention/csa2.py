"""The attention layer of the V4.1 backbone: sliding window + CSA2 (report §2.2–§2.3).

Every layer computes its own query and its own sliding-window (SWA) KV from its own hidden
state. A CSA2 layer additionally attends to top-k entries of a compressed main KV, in the
same softmax as the window (§2.3). How it obtains main KV, index K and top-k depends on its
statically assigned mode (§2.3.1; plan in :mod:`megatron_s2.models.v41.layer_plan`):

=========  ===================================  ===========================  ===============
mode       main KV                              index K                      top-k
=========  ===================================  ===========================  ===============
Full       own compressor (decoder: H_L/2)      projected from own main KV   own indexer
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

Memory under autograd (training) depends on ``parallel.recompute`` (top-k selection itself
runs without autograd, over query chunks; without the alignment loss, e.g. in inference, the
indexer builds its queries one scoring chunk at a time):

* ``none`` (or ``full``, which recomputes the whole block around this): one pass over all
  queries; autograd keeps the query heads ``[s, heads, head_dim]``, the grouped output and
  the indexer's queries, computed once for selection and the alignment loss (the sparse
  attention kernel itself saves only its inputs, :mod:`megatron_s2.kernels.sparse_attention`).
* ``selective`` — Megatron's *selective recomputation*: the core attention is recomputed.
  The attention core (query heads, window + top-k indices, sparse attention, output
  projection) runs in checkpointed query chunks (:meth:`CSA2Attention.attend`), the
  compressed query, the window KV (projection and norm), the compressor (projections,
  pooling, norm) and the index-key projection keep only their outputs, and the indexer
  recomputes its queries per chunk for its alignment loss (``Indexer.selected_scores``).
  What stays from forward to backward is per-token latents (qr, window KV, compressed
  entries, top-k ids), never ``[s, heads, head_dim]``, and the transient working set is one
  chunk's; the price is the recomputation in backward. ``bench/csa2_vs_dense.py`` measures
  both modes side by side. The end of the backward holds at most two ``[s, d]`` input
  gradients at once: the compressor's C and Z come from one GEMM
  (:meth:`Compressor.project`) and the linears' input gradients are summed in place
  (:mod:`megatron_s2.parallel.linear`).

Both modes compute the same values (outputs, losses and gradients agree to float rounding:
``tests/models/test_csa2.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_s2.models.v41.layer_plan import CSA2Mode, LayerSpec, SharedStateKind as K
from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels import sparse_attention
from megatron_s2.kernels.sparse_attention import chunk_rows
from megatron_s2.models.init import constant_init
from megatron_s2.models.v41.attention.compressor import Compressor
from megatron_s2.models.v41.attention.indexer import IndexKeyProjection, Indexer
from megatron_s2.models.v41.attention.visibility import entry_doc_ids, truncate_window, window_indices
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.kernels.precision import cast, wide
from megatron_s2.kernels import fake_quant_fp4_e4m3, fake_quant_fp8
from megatron_s2.models.v41.rope import apply_rope, rope_frequencies
from megatron_s2.models.v41.spec import LinearSubmodules
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import mark_param

__all__ = ["CSA2Attention", "ATTENTION_CHUNK_ELEMENTS"]

ATTENTION_CHUNK_ELEMENTS = 1 << 20
"""Queries per attention chunk under autograd: at most this many ``rows x local heads x
head_dim`` elements (4 MiB in float32) and at most 1024 rows (:meth:`CSA2Attention.attend`)."""


class CSA2Attention(nn.Module):
    PLAN_SECTION = "attention"

    def __init__(self, config: V41Config, spec: LayerSpec, groups: ParallelGroups,
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

        # parallel.recompute == "selective" (set by V41Model.set_recompute): recompute the attention
        # core per query chunk in backward (recomputes_core)
        self.selective_recompute = False
        self.attention_chunk_rows: int | None = None  # queries per recomputed chunk; None: attention_rows()
        self.compressor = self.index_key = self.indexer = None
        if spec.mode is CSA2Mode.FULL:
            self.compressor = Compressor(config, spec.compress_ratio, linears=L)
            self.index_key = IndexKeyProjection(config, tp, linears=L)
        if spec.runs_indexer:
            self.indexer = Indexer(config, tp, linears=L)
        apply_plan(self, groups, config)

    # ---- helpers ---------------------------------------------------------------------------
    def recomputes_core(self) -> bool:
        """Whether this forward runs the attention core in checkpointed query chunks
        (selective recomputation while training under autograd)."""
        return self.selective_recompute and self.training and torch.is_grad_enabled()

    def _window(self, kv: torch.Tensor, ctx: ForwardContext):
        """Window keys (with the CP halo) and a function: slice of queries -> their window
        indices into those keys (built per attention chunk, never for all queries at once)."""
        keys, k_pos, k_doc = self.seq.window_keys(kv, ctx.positions, self.window, ctx.doc_ids, ctx.full_doc_ids)
        pos, doc, truncate = ctx.positions, ctx.doc_ids, ctx.swa_from is not None and not self.spec.is_encoder

        def indices(sl: slice) -> torch.Tensor:
            idx = window_indices(pos[:, sl], k_pos, self.window, None if doc is None else doc[:, sl], k_doc)
            if truncate:  # train-aware bounded replay (§3.2.2)
                idx = truncate_window(idx, pos[:, sl], k_pos, ctx.swa_from)
            return idx

        return keys, indices

    # ---- pieces shared by the training forward and incremental decode ---------------------
    # The forward below is the only attention code path. Incremental decode
    # (:mod:`megatron_s2.inference`) runs the same forward with ``ctx.kv_cache`` set: the two
    # places where keys come from *earlier* tokens (the sliding window and the compressed
    # main KV) then read and extend the request's cached state instead of the sequence.
    def compressed_query(self, x_in: torch.Tensor) -> torch.Tensor:
        """The compressed query qr [b, s, q_lora] of the context chunk: the input of the query
        heads (:meth:`attention_chunk`) and of the indexer."""
        def local(x: torch.Tensor) -> torch.Tensor:
            return self.q_norm(self.linear_q_down(wide(x)))

        if self.recomputes_core():  # keep only qr: its norm's inputs are recomputed
            return self.seq.gather_chunk(checkpoint(local, x_in, use_reentrant=False, preserve_rng_state=False))
        return self.seq.gather_chunk(local(x_in))

    def window_kv(self, x_in: torch.Tensor, positions: torch.Tensor, quantise: bool = True) -> torch.Tensor:
        """The layer-local SWA KV latent of each token [b, s, hd]: RoPE'd, then FP8 QAT
        (§2.4.4) unless ``quantise`` is False (a KV cache packs the raw values itself)."""
        def local(x: torch.Tensor) -> torch.Tensor:
            return self.kv_norm(self.linear_kv(wide(x)))

        if self.recomputes_core():  # the norm's inputs are recomputed in backward, as for qr
            kv = checkpoint(local, x_in, use_reentrant=False, preserve_rng_state=False)
        else:
            kv = local(x_in)
        kv = apply_rope(self.seq.gather_chunk(kv), positions, self.inv_freq)
        return fake_quant_fp8(kv) if self.config.fp8_swa_kv and quantise else kv

    def compressed_entries(self, latent: torch.Tensor, entry_pos: torch.Tensor,
                           quantise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE-free latents [b, n, hd] of entries at token positions ``entry_pos`` [b, n]
        (entry j sits at j*m) -> (main KV: RoPE'd, FP4 QAT after RoPE (§2.4.4); index K with
        MXFP4 QAT). ``quantise=False``: the raw values, for a KV cache that packs them."""
        if self.recomputes_core():  # keep only the latent: the key projection's norm is recomputed
            index_k = checkpoint(self.index_key, latent.detach(), entry_pos, self.inv_freq, quantise=quantise,
                                 use_reentrant=False, preserve_rng_state=False)
        else:
            index_k = self.index_key(latent.detach(), entry_pos, self.inv_freq, quantise=quantise)
        main_kv = apply_rope(latent, entry_pos, self.inv_freq)
        if self.config.fp4_main_kv and quantise:
            main_kv = fake_quant_fp4_e4m3(main_kv)
        return main_kv, index_k

    def attention_chunk(self, qr: torch.Tensor, kv: torch.Tensor, rows: slice, window_idx, topk: torch.Tensor | None,
                        n_window: int, positions: torch.Tensor,
                        split: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention core of one chunk of queries (``rows`` of the context chunk): query
        heads from the compressed query ``qr`` [b, c, q_lora]; the chunk's window indices
        (``window_idx(rows)``) followed by its top-k entry ids ``topk`` [b, c, top-k] offset by
        the ``n_window`` window keys; window + top-k in one softmax with the sink (§2.3); the
        query RoPE removed again; the grouped low-rank output -> this rank's partial output
        rows [b, c, d] (before the tensor-parallel exit) and the selected entries' attention
        mass (``split``)."""
        indices = window_idx(rows)
        if topk is not None:
            indices = torch.cat([indices, torch.where(topk >= 0, topk + n_window, -1)], dim=-1)
        q = self.linear_q_up(qr).unflatten(-1, (self.local_heads, self.head_dim))
        q = apply_rope(q, positions, self.inv_freq)
        o, mass = sparse_attention(q, kv, indices, self.attn_sink, self.scale, split=split)
        o = apply_rope(o, positions, self.inv_freq, inverse=True)
        b, c = o.shape[:2]
        o = o.reshape(b, c, self.local_groups, -1)
        wo_a = self.linear_out_a.view(self.local_groups, self.config.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, cast(wo_a, o.dtype)).flatten(2)
        return self.linear_out_b.gemm(o), mass

    def attention_rows(self) -> int:
        """Queries per recomputed attention chunk (``attention_chunk_rows`` overrides it)."""
        if self.attention_chunk_rows:
            return self.attention_chunk_rows
        return chunk_rows(1024, self.local_heads * self.head_dim, budget=ATTENTION_CHUNK_ELEMENTS)

    def attend(self, qr: torch.Tensor, kv: torch.Tensor, window_idx, topk: torch.Tensor | None, n_window: int,
               positions: torch.Tensor, split: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention core over all queries -> (output [b, s_local, d], mass or None).

        Under selective recomputation (:meth:`recomputes_core`) the queries run in chunks of
        :meth:`attention_rows`, each under activation checkpointing: only a chunk's inputs (its
        rows of ``qr`` and of the top-k ids, the KV array) stay for backward; its indices, query
        heads, gathered keys, probabilities and grouped output are recomputed per chunk in
        backward. No ``[s, heads, head_dim]`` tensor lives from forward to backward, and the
        transient working set is one chunk's. Otherwise all queries run in one pass, without
        recomputation. The tensor-parallel exit runs once, on all rows.
        ``window_idx(sl)``: the window indices of a slice of queries; a CSA2 layer's top-k
        entry ids follow them, offset by the ``n_window`` window keys."""
        s = qr.size(1)
        recompute = self.recomputes_core()
        rows = self.attention_rows() if recompute else s
        outs, masses = [], []
        # split, not sliced per chunk: a slice's backward is a zero-padded [b, s, q_lora] per chunk
        qr_chunks = qr.split(rows, dim=1) if recompute else (qr,)
        for i, start in enumerate(range(0, s, rows)):
            sl = slice(start, start + rows)
            top = topk if topk is None or rows >= s else topk[:, sl]
            # one chunk: the positions object itself, so RoPE's tables are shared across layers
            pos = positions if rows >= s else positions[:, sl]
            args = (qr_chunks[i], kv, sl, window_idx, top, n_window, pos, split)
            if recompute:
                out, mass = checkpoint(self.attention_chunk, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                out, mass = self.attention_chunk(*args)
            outs.append(out)
            masses.append(mass)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        mass = None if split is None else (masses[0] if len(masses) == 1 else torch.cat(masses, dim=1))
        return self.linear_out_b.seq.exit_tp_region(y), mass

    # ---- main-KV / top-k acquisition (§2.3.1) ----------------------------------------------
    def compressor_input(self, x_in: torch.Tensor) -> torch.Tensor:
        """What a Full layer's compressor reads: its own normalised attention input.

        The single definition used by training and decode alike. For the CED decoder's Full
        layer (the first decoder layer, §2.2 Eq. 1) this is attn_norm(H_{L/2}): under Single-Pass
        mHC its input is the encoder's final streams collapsed with the encoder's last mix, so
        no separate encoder-output path (or extra norm) exists — as in the released model."""
        return x_in

    def _main_kv(self, x_in: torch.Tensor, ctx: ForwardContext):
        spec, ratio = self.spec, self.spec.compress_ratio
        if spec.mode is not CSA2Mode.FULL:
            main_kv = ctx.shared.consume(spec.index, spec.kv_source, K.MAIN_KV)
            index_k = ctx.shared.consume(spec.index, spec.kv_source, K.INDEX_K) if spec.runs_indexer else None
            return main_kv, index_k
        if ctx.kv_cache is not None:  # decode: carry the partial block, append complete ones
            kv, gate = self.compressor.project(self.compressor_input(x_in))
            main_kv, index_k = ctx.kv_cache.compress(self, kv, gate)
        else:
            def compress(x: torch.Tensor) -> torch.Tensor:  # [b, n, hd], RoPE-free
                kv, gate = self.compressor.project(self.compressor_input(x))
                kv = self.seq.gather_full(kv, ctx.positions)
                gate = self.seq.gather_full(gate, ctx.positions) if gate is not None else None
                return self.compressor.pool(kv, gate)

            # selective: keep only the latent; C, softmax(Z) and the norm's inputs are recomputed
            latent = (checkpoint(compress, x_in, use_reentrant=False, preserve_rng_state=False)
                      if self.recomputes_core() else compress(x_in))
            n = latent.size(1)
            entry_pos = (torch.arange(n, device=latent.device) * ratio).expand(latent.size(0), n)
            main_kv, index_k = self.compressed_entries(latent, entry_pos)
            ctx.shared.publish(spec.index, K.LATENT, latent)  # kept only when a pipeline cut asks for it
        ctx.shared.publish(spec.index, K.MAIN_KV, main_kv)
        ctx.shared.publish(spec.index, K.INDEX_K, index_k)
        return main_kv, index_k

    def _topk(self, x_in, qr, index_k, n_entries, ctx: ForwardContext, keep_queries: bool):
        """Top-k entry ids of the local queries, and what the indexer's alignment loss needs:
        (detached qr, head weights, the indexer queries under autograd when ``keep_queries``
        — computed once for selection and loss — else None: built per scoring chunk)."""
        spec = self.spec
        if not spec.runs_indexer:
            return ctx.shared.consume(spec.index, spec.index_source, K.TOPK), None
        ratio, pos, doc = spec.compress_ratio, ctx.positions, ctx.doc_ids
        weights = self.indexer.local_weights(self.seq.gather_chunk(self.indexer.head_weights(x_in.detach())))
        qr_d = qr.detach()
        q_all = self.indexer.queries(qr_d, pos, self.inv_freq) if keep_queries else None

        def q_idx(rows: slice) -> torch.Tensor:  # one scoring chunk's queries (select runs without autograd)
            if q_all is not None:
                return q_all[:, rows]
            if rows.start == 0 and rows.stop >= pos.size(1):  # the positions object: RoPE's tables are shared
                return self.indexer.queries(qr_d, pos, self.inv_freq)
            return self.indexer.queries(qr_d[:, rows], pos[:, rows], self.inv_freq)

        candidates = None
        if spec.candidate_source is not None and not spec.is_candidate_source:
            candidates = ctx.shared.consume(spec.index, spec.candidate_source, K.CANDIDATES)
        e_doc = entry_doc_ids(self.seq.full_sequence(ctx.doc_ids, ctx.full_doc_ids), ratio, n_entries)
        sel = self.indexer.select(q_idx, weights, index_k, pos, ratio, doc, e_doc, candidates=candidates,
                                  make_candidates=spec.is_candidate_source)
        ctx.shared.publish(spec.index, K.TOPK, sel.topk)
        if spec.is_candidate_source:
            ctx.shared.publish(spec.index, K.CANDIDATES, sel.candidates)
            ctx.shared.publish(spec.index, K.CANDIDATE_QUERY, torch.cat([qr_d.float(), weights.detach()], -1))
        self.last_scored_per_query = sel.scored_per_query
        return sel.topk, (qr_d, weights, q_all)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [b, s_local, d] (normalised block input; sequence shard under SP)."""
        x_in = self.seq.enter_local(x)
        pos = ctx.positions
        qr = self.compressed_query(x_in)
        kv = self.window_kv(x_in, pos, quantise=ctx.kv_cache is None)  # a cache packs raw values
        if ctx.kv_cache is not None:  # decode: the request's cached window + these tokens
            kv, indices = ctx.kv_cache.window(self, kv, pos)
            window_idx = lambda sl: indices[:, sl]  # noqa: E731
        else:
            kv, window_idx = self._window(kv, ctx)
        split, indexer_inputs, topk, n_window = None, None, None, kv.size(1)
        want_mass = self.spec.runs_indexer and self.training and self.config.indexer_loss_coeff > 0
        if self.spec.is_csa2:
            main_kv, index_k = self._main_kv(x_in, ctx)
            keep = want_mass and not self.recomputes_core()
            topk, indexer_inputs = self._topk(x_in, qr, index_k, main_kv.size(1), ctx, keep_queries=keep)
            if ctx.kv_cache is not None:  # a decode step unpacks only the entries its top-k names
                main_kv, topk = ctx.kv_cache.attended_entries(main_kv, topk)
            kv = torch.cat([kv, cast(main_kv, kv.dtype)], dim=1)
            split = self.window
        out, mass = self.attend(qr, kv, window_idx, topk, n_window, pos, split if want_mass else None)
        if want_mass:
            qr_detached, weights, q_idx = indexer_inputs
            if q_idx is None:  # selective recomputation: the scores' queries are recomputed per chunk
                scores = self.indexer.selected_scores(qr_detached, pos, self.inv_freq, weights, index_k, topk,
                                                      self.attention_rows())
            else:
                scores = self.indexer.gathered_scores(q_idx, weights, index_k, topk)
            kl_sum, n = self.indexer.alignment_loss_from_scores(scores, topk, mass, ctx.aux_rows)
            n = mappings.all_reduce_sum(n.float().reshape(1), self.cp)  # mean over the whole sequence
            kl = kl_sum / n.clamp_min(1).squeeze()
            ctx.add_aux_loss("indexer_kl", self.config.indexer_loss_coeff * kl)
            ctx.add_metric("indexer_kl", kl)
        return out
