"""The Engram conditional-memory module of one hosting layer (report §2.4.2, §3.1.3).

Applied to the residual streams ``X [b, s, n, d]`` before the block of its layer:

1. hash ids ``[b, s, T]`` of the N-grams ending at every token (``T`` = orders x heads,
   :mod:`.hashing`), computed from ``ctx.input_ids`` / ``ctx.doc_ids`` / ``ctx.image_mask``;
2. rows ``[b, s, T, head_dim]`` from the row-partitioned table (:mod:`.table`), flattened and
   projected by ``linear_kv`` into one key per stream ``[n, d]`` and one shared value ``[d]``;
3. context-aware gating per stream ``i`` (reference semantics)::

       dot_i  = sum_d h_i * (q_weight_i * k_weight_i) * key_i * rms(h_i)^-1 * rms(key_i)^-1 / sqrt(d)
       gate_i = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, 1e-6)))
       X_i   <- X_i + gate_i * value

   image tokens (``ctx.image_mask``) close the gate and never enter an N-gram.

As in the report, the short causal convolution of the original Engram design is omitted.
``q_weight`` and ``k_weight`` start at ones, ``linear_kv`` and the table at ``N(0, init_std)``.

Parallelism: the table is partitioned over ``groups.engram`` (§3.1.3). Under context
parallelism the hashes need the tokens before the local chunk: the module hashes
``ctx.full_input_ids`` (and ``ctx.full_doc_ids``, ``ctx.full_image_mask``) and picks the
local tokens by ``ctx.positions``. Under sequence parallelism the streams are sequence-sharded
over tp and the module keeps this rank's stream shard of the hash ids; its replicated
parameters (including the table) then receive partial gradients over tp (the plan's
``"engram"`` section).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.init import constant_init
from megatron_s2.models.v41.engram.hashing import EngramHasher
from megatron_s2.models.v41.engram.table import EngramTable
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.linear import ReplicatedLinear
from megatron_s2.parallel.placement import mark_param

if TYPE_CHECKING:
    from megatron_s2.models.v41.context import ForwardContext

__all__ = ["GATE_CLAMP", "Engram", "engram_gate"]

GATE_CLAMP = 1.0e-6
"""Floor of |dot| under the signed square root of the gate (reference value)."""



def engram_gate(h: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gate ``[b, s, n]`` of streams ``h [b, s, n, d]`` against keys ``key [b, s, n, d]``."""
    d = h.size(-1)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * d ** -0.5
    root = dot.abs().clamp_min(GATE_CLAMP).sqrt()
    return torch.sigmoid(torch.where(dot >= 0, root, -root))


class Engram(nn.Module):
    """Engram of the model layer ``layer_number`` (zero-indexed, one of ``config.engram_layers``)."""

    PLAN_SECTION = "engram"

    def __init__(self, config: V41Config, layer_number: int, groups: ParallelGroups | None = None,
                 compressed_token_map: list[int] | None = None):
        super().__init__()
        if layer_number not in config.engram_layers:
            raise ValueError(f"layer {layer_number} is not an Engram layer (engram_layers={list(config.engram_layers)})")
        groups = groups or ParallelGroups.single()
        self.config, self.layer_number, self.groups = config, layer_number, groups
        self.n, self.hidden_size, self.eps = config.hc_mult, config.hidden_size, config.norm_eps
        self.seq = groups.sequence
        self.hasher = EngramHasher.from_config(config, compressed_token_map)
        dtype = getattr(torch, config.params_dtype)
        self.table = EngramTable(self.hasher.num_rows(layer_number), config.engram_head_dim, groups.engram,
                                 fp8=config.engram_fp8_tables, init_std=config.init_std, dtype=dtype)
        self.linear_kv = ReplicatedLinear(config.engram_num_tables * config.engram_head_dim,
                                          (self.n + 1) * self.hidden_size, dtype=dtype)
        self.q_weight = nn.Parameter(torch.empty(self.n, self.hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.empty(self.n, self.hidden_size, dtype=torch.float32))
        for p in (self.q_weight, self.k_weight):
            mark_param(p, (self.n, self.hidden_size), init=constant_init(1.0))
        apply_plan(self, groups, config)

    def set_compressed_token_map(self, compressed_token_map: list[int] | None) -> None:
        """Attach the tokenizer's compressed token map (model builder); changes the hashes."""
        self.hasher = EngramHasher.from_config(self.config, compressed_token_map)

    # ---- addressing ----------------------------------------------------------------------
    def hash_ids(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hash ids ``[b, s_local, T]`` of the tokens whose streams this rank holds, and their
        image mask ``[b, s_local]`` (or None)."""
        if ctx.full_input_ids is not None:  # context parallel: hash the whole sequence
            full_dead = getattr(ctx, "full_image_mask", None)
            if ctx.image_mask is not None and full_dead is None:
                raise ValueError("Engram under context parallelism needs ctx.full_image_mask alongside "
                                 "ctx.image_mask: N-grams must stop at image tokens of earlier chunks")
            ids = self.hasher(ctx.full_input_ids, self.layer_number, ctx.full_doc_ids, full_dead)
            ids = ids.gather(1, ctx.positions.unsqueeze(-1).expand(-1, -1, ids.size(-1)))
        elif ctx.prefix_ids is not None:  # incremental decode: n-grams reach into the history
            ids = self._hash_with_prefix(ctx)
        else:
            ids = self.hasher(ctx.input_ids, self.layer_number, ctx.doc_ids, ctx.image_mask)
        mask = ctx.image_mask
        return self.seq.stream_slice(ids), None if mask is None else self.seq.stream_slice(mask)

    def _hash_with_prefix(self, ctx: ForwardContext) -> torch.Tensor:
        """Hash ``prefix_ids ++ input_ids`` and keep the chunk's columns. History slots of -1
        are dead tokens, which block an n-gram exactly like the sequence start does."""
        prefix, h = ctx.prefix_ids, ctx.prefix_ids.size(1)
        if ctx.doc_ids is not None:
            raise ValueError("Engram: prefix_ids (incremental decode) and doc_ids cannot be combined")
        tokens = torch.cat([prefix.clamp_min(0).to(ctx.input_ids.dtype), ctx.input_ids], dim=1)
        dead = torch.zeros_like(ctx.input_ids, dtype=torch.bool) if ctx.image_mask is None else ctx.image_mask.bool()
        dead = torch.cat([prefix < 0, dead], dim=1)
        return self.hasher(tokens, self.layer_number, None, dead)[:, h:]

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ids, image_mask = self.hash_ids(ctx)
        if ids.shape[:2] != x.shape[:2]:
            raise ValueError(f"Engram: streams {tuple(x.shape)} do not match the {tuple(ids.shape[:2])} "
                             "tokens of the forward context")
        prefetched = ctx.engram_rows
        if prefetched is not None and prefetched.holds(self.layer_number):
            rows = prefetched.lookup(self.layer_number, ids)  # rows of the step's batch (§3.1.3)
        else:
            rows = self.table(ids)  # [b, s, T, head_dim]
        kv = self.linear_kv(rows.flatten(-2))
        nd = self.n * self.hidden_size
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = kv[..., :nd].to(wide).unflatten(-1, (self.n, self.hidden_size))
        value = kv[..., nd:].to(wide)
        h = x.to(wide)
        gate = engram_gate(h, key, (self.q_weight * self.k_weight).to(wide), self.eps)
        if image_mask is not None:
            gate = gate.masked_fill(image_mask.unsqueeze(-1).bool(), 0.0)
        return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}, streams={self.n}, tables={self.config.engram_num_tables}"
