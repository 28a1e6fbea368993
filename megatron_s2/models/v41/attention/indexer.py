"""CSA2 indexer (report §2.3, §2.3.1) — the lightweight scorer that picks top-k entries.

* **Index keys** are projected from the main-KV latent (CSA2 replaces CSA's separate
  compression path): K^I = RMSNorm(c W^K), RoPE on the tail, MXFP4 QAT. Only Full layers
  own this projection; Reindex layers reuse the keys (a shadow replica runs it when the
  owner sits on another pipeline stage, §3.1.2).
* **Index scores** of query t against entry j: I(t, j) = sum_h w_{t,h} ReLU(q^I_{t,h} . K^I_j),
  with q^I projected from the compressed query (q_lora) and per-head weights w from the
  hidden state, scaled by d_I^-1/2 * H_I^-1/2 (reference semantics).
* Only causally complete entries of the query's document are visible; the top-k visible
  entries are selected (fewer when fewer are visible, -1 fills the rest). Equal scores go
  to the newer entry (:mod:`.selection`), so the selection does not depend on how many
  entries exist past the query's visible range (whole sequence vs incremental decode).
* **Training.** Top-k selection is not differentiable. The indexer learns by aligning its
  score distribution over the selected entries with the main attention's probability mass
  on them (KL, summed over heads and renormalised; the DeepSeek-V3.2 sparse-stage
  recipe). Its inputs are detached, so this loss trains only the indexer.
* **Hierarchical Sparse Indexer** (§2.3.2): see :mod:`.candidates`.

Scores for selection are computed without autograd in query chunks, so memory is
O(chunk x entries), and summed over tensor-parallel ranks (index heads are split over tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.indexer import indexer_gathered_scores, indexer_scores
from megatron_s2.kernels.sparse_attention import CHUNK_ELEMENTS, chunk_rows
from megatron_s2.models.v41.attention.candidates import select_candidate_blocks
from megatron_s2.models.v41.attention.selection import topk_newest_on_ties
from megatron_s2.models.v41.attention.visibility import compressed_visible
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.kernels.precision import wide
from megatron_s2.kernels import fake_quant_mxfp4
from megatron_s2.models.v41.rope import apply_rope
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.linear import ColumnParallelLinear, ReplicatedLinear

__all__ = ["IndexKeyProjection", "Indexer", "IndexerSelection"]


class IndexKeyProjection(nn.Module):
    """Main-KV latent -> index keys (owned by the Full layer that produces the main KV)."""

    PLAN_SECTION = "index_key"

    def __init__(self, config: V41Config, tp: Group | None = None, linears=None):
        super().__init__()
        linear = linears.replicated_linear if linears is not None else ReplicatedLinear
        self.linear = linear(config.head_dim, config.index_head_dim)
        self.norm = RMSNorm(config.index_head_dim, config.norm_eps)
        self.fp4 = config.fp4_indexer
        apply_plan(self, ParallelGroups(tp=tp or Group()), config)

    def forward(self, latent: torch.Tensor, entry_pos: torch.Tensor, inv_freq: torch.Tensor,
                quantise: bool = True) -> torch.Tensor:
        """``quantise=False`` skips the MXFP4 QAT (a KV cache packs the raw keys itself)."""
        k = self.norm(self.linear(wide(latent)))
        k = apply_rope(k, entry_pos, inv_freq)
        return fake_quant_mxfp4(k) if self.fp4 and quantise else k


@dataclass
class IndexerSelection:
    topk: torch.Tensor                   # [b, s, k] entry ids, -1 = none
    candidates: torch.Tensor | None      # [b, s, pool] entry ids (candidate source only)
    scored_per_query: int                # entries each query scored (for the §2.3.2 bound)


class Indexer(nn.Module):
    PLAN_SECTION = "indexer"

    def __init__(self, config: V41Config, tp: Group, linears=None):
        super().__init__()
        column = linears.column_parallel_linear if linears is not None else ColumnParallelLinear
        replicated = linears.replicated_linear if linears is not None else ReplicatedLinear
        self.tp = tp
        self.n_heads = config.index_num_heads
        self.local_heads = config.index_num_heads // tp.size
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.fp4 = config.fp4_indexer
        self.block_size = config.candidate_block_size
        self.top_blocks = config.candidate_topk_blocks
        self.linear_q = column(config.q_lora_rank, self.n_heads * self.head_dim, tp, region_entry=False)
        # Per-head weights from the hidden state: replicated, computed on local tokens, the
        # local heads' columns sliced after the sequence gather.
        self.linear_weights = replicated(config.hidden_size, self.n_heads)
        self.scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        apply_plan(self, ParallelGroups(tp=tp), config)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, H_I] per-head weights from the (detached) hidden state of local tokens."""
        return self.linear_weights(wide(x)) * self.scale

    def queries(self, qr: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        q = self.linear_q(wide(qr)).unflatten(-1, (self.local_heads, self.head_dim))
        q = apply_rope(q, q_pos, inv_freq)
        return fake_quant_mxfp4(q) if self.fp4 else q

    def local_weights(self, weights: torch.Tensor) -> torch.Tensor:
        start = self.tp.rank * self.local_heads
        return weights[..., start:start + self.local_heads]

    @staticmethod
    def _score(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """q [b,s,h,d], k [b,s,n,d] or [b,n,d], w [b,s,h] -> [b,s,n] (local heads only)."""
        if k.dim() == 3:
            return indexer_scores(q, k, w)
        logits = torch.einsum("bshd,bsnd->bshn", q, k)
        return (F.relu(logits) * w.unsqueeze(-1)).sum(dim=2)

    @torch.no_grad()
    def select(self, q, w: torch.Tensor, index_k: torch.Tensor, q_pos: torch.Tensor,
               ratio: int, q_doc: torch.Tensor | None, e_doc: torch.Tensor | None, *,
               candidates: torch.Tensor | None = None, make_candidates: bool = False,
               chunk: int = 512) -> IndexerSelection:
        """Top-k entry ids per query (no autograd). ``q``: the indexer queries [b, s, h, d], or
        a function ``rows (slice) -> those queries`` so that they are built one chunk at a
        time (never [b, s, h, d] at once with their QAT temporaries). With ``candidates`` only
        those entries are scored (Reindex under the hierarchical indexer); with
        ``make_candidates`` the candidate pool is built from this layer's full-range scores
        (candidate source)."""
        queries = q if callable(q) else (lambda rows: q[:, rows])
        b, s = q_pos.shape
        n = index_k.size(1)
        k_eff = min(self.topk, n)
        if candidates is None:  # bound the [chunk, heads, entries] logits of the full scan
            chunk = chunk_rows(chunk, self.local_heads * n, budget=CHUNK_ELEMENTS * 2)
        tops, cands = [], []
        for start in range(0, s, chunk):
            sl = slice(start, start + chunk)
            pos = q_pos[:, sl]
            if candidates is None:
                scores = self._score(queries(sl), index_k, w[:, sl])
                scores = mappings.all_reduce_sum(scores, self.tp)
                vis = compressed_visible(pos, ratio, n, None if q_doc is None else q_doc[:, sl], e_doc)
                scores = scores.masked_fill(~vis, float("-inf"))
                if make_candidates:
                    cands.append(select_candidate_blocks(scores, pos, ratio, self.top_blocks, self.block_size))
                ids = torch.arange(n, device=index_k.device).expand(b, scores.size(1), n)
            else:
                ids = candidates[:, sl]
                keys = torch.gather(index_k, 1, ids.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, index_k.size(-1)))
                keys = keys.view(b, ids.size(1), ids.size(2), index_k.size(-1))
                scores = self._score(queries(sl), keys, w[:, sl])
                scores = mappings.all_reduce_sum(scores, self.tp)
                scores = scores.masked_fill(ids < 0, float("-inf"))
            kk = min(k_eff, scores.size(-1))
            values, indices = topk_newest_on_ties(scores, kk)
            picked = torch.gather(ids, 2, indices)
            picked = torch.where(torch.isfinite(values), picked, -1)
            if kk < k_eff:
                picked = F.pad(picked, (0, k_eff - kk), value=-1)
            tops.append(picked)
        topk = torch.cat(tops, dim=1)
        scored = n if candidates is None else candidates.size(-1)
        return IndexerSelection(topk, torch.cat(cands, dim=1) if make_candidates else None, scored)

    def gathered_scores(self, q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor,
                        topk: torch.Tensor) -> torch.Tensor:
        """This rank's index scores (local heads) of each query's selected entries [b, s, k]
        (0 where none) from indexer queries ``q`` [b, s, h_local, d] kept under autograd.
        The keys are gathered per chunk and regathered in backward (no [b, s, k, d] kept)."""
        return indexer_gathered_scores(q, index_k, w, topk)

    def selected_scores(self, qr: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor, w: torch.Tensor,
                        index_k: torch.Tensor, topk: torch.Tensor, rows: int) -> torch.Tensor:
        """:meth:`gathered_scores` under selective recomputation: the same scores, with autograd
        to the indexer's query projection, ``w`` and ``index_k``, from the (detached)
        compressed query ``qr`` instead of kept indexer queries.

        Queries run in chunks of ``rows`` under activation checkpointing: the indexer queries,
        their MXFP4 QAT and the gathered keys of a chunk are recomputed in backward, so only
        ``qr``, ``w`` and the ids stay alive."""
        def chunk(qr_c, pos_c, w_c, keys, ids_c):
            return indexer_gathered_scores(self.queries(qr_c, pos_c, inv_freq), keys, w_c, ids_c)

        recorded = torch.is_grad_enabled()
        parts = []
        for start in range(0, qr.size(1), rows):
            sl = slice(start, start + rows)
            args = (qr[:, sl], q_pos[:, sl], w[:, sl], index_k, topk[:, sl])
            parts.append(checkpoint(chunk, *args, use_reentrant=False, preserve_rng_state=False)
                         if recorded else chunk(*args))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def alignment_loss(self, q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, topk: torch.Tensor,
                       target_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(p_attn || softmax(I)) over each query's selected entries, from indexer queries
        ``q`` [b, s, h_local, d] (:meth:`alignment_loss_from_scores`)."""
        return self.alignment_loss_from_scores(self.gathered_scores(q, w, index_k, topk), topk, target_mass)

    def alignment_loss_from_scores(self, local_scores: torch.Tensor, topk: torch.Tensor, target_mass: torch.Tensor,
                                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(p_attn || softmax(I)) over each query's selected entries.

        local_scores: [b, s, k] index scores of the selected entries summed over this rank's
        heads (:meth:`gathered_scores` / :meth:`selected_scores`); target_mass: [b, s, k]
        attention mass (summed over the local heads, detached) on them; rows: [b] bool, the rows
        whose queries count (post-training: not a filler row; None: all). Returns (sum of
        per-query KL, number of queries with a selection).
        """
        valid = topk >= 0
        scores = mappings.reduce_from_group(local_scores, self.tp)
        mass = mappings.all_reduce_sum(target_mass, self.tp).masked_fill(~valid, 0.0)
        p = mass / mass.sum(-1, keepdim=True).clamp_min(1e-20)
        log_q = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-20)) - log_q), torch.zeros_like(p)).sum(-1)
        has = valid.any(-1)
        if rows is not None:
            has = has & rows.to(has.device, torch.bool).unsqueeze(-1)
        return kl.masked_fill(~has, 0.0).sum(), has.sum()
