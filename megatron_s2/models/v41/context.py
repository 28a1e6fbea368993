"""Per-micro-batch forward context handed to every layer of the backbone.

Layers read what they need from here instead of from module attributes or globals: token
positions (global, so context-parallel chunks keep their true positions), document ids for
sample-level attention masks (§4.2.2), the image mask that selects the image correction
bias (§2.1.1), the shared-state registry (§3.1.2), the routing recorder/replayer, the
accumulator of auxiliary losses (MoE sequence balance loss, indexer alignment loss), and — for
incremental decode only — the per-request cached state the attention layers extend and the
tokens preceding this chunk (Engram's n-gram history).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_s2.models.v41.layer_plan import LayerPlan
from megatron_s2.models.v41.shared_state import SharedStateRegistry

if TYPE_CHECKING:
    from megatron_s2.models.v41.engram.prefetch import EngramPrefetch
    from megatron_s2.models.family.routing_replay import RoutingReplay

__all__ = ["AttentionCache", "ForwardContext"]


class AttentionCache(Protocol):
    """Cached attention state of the requests in an incremental-decode step (implemented by
    :class:`megatron_s2.models.v41.inference.kv_step.KVCacheStep`). The attention forward calls it at the
    two places where keys come from earlier tokens; everything else is the training path."""

    def window(self, attn, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's SWA KV [b, s, hd]; return (keys, each query's window indices)."""
        ...

    def compress(self, attn, kv: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool this step's compressor projections with the carried partial block, append the
        completed entries; return every cached (main KV, index K) entry of each request."""
        ...


@dataclass
class ForwardContext:
    input_ids: torch.Tensor
    """[b, s] token ids of this (chunk of the) sequence; Engram hashes them."""
    positions: torch.Tensor
    """[b, s] global positions of the tokens in the full sequence (int64)."""
    shared: SharedStateRegistry
    """Shared attention states of this micro-batch."""
    doc_ids: torch.Tensor | None = None
    """[b, s] document ids; attention and n-grams never cross a document boundary."""
    image_mask: torch.Tensor | None = None
    """[b, s] True for image-span tokens (image routing bias, no Engram contribution)."""
    routing: "RoutingReplay | None" = None
    """Records or replays MoE routing decisions (Rollout Routing Replay)."""
    aux_rows: torch.Tensor | None = None
    """[b] bool: the rows the auxiliary losses see — the MoE balance loss, the indexer alignment
    loss (post-training: rows with a loss-bearing label, not a filler row,
    :mod:`megatron_s2.posttrain.episode_rows`); None: all."""
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses added to the objective, summed over layers (already weighted)."""
    aux_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached diagnostics (e.g. unweighted indexer KL) for logging."""
    full_input_ids: torch.Tensor | None = None
    """[b, S] token ids of the whole sequence when this rank holds a context-parallel chunk."""
    full_doc_ids: torch.Tensor | None = None
    """[b, S] document ids of the whole sequence under context parallelism."""
    full_image_mask: torch.Tensor | None = None
    """[b, S] image mask of the whole sequence under context parallelism."""
    engram_rows: "EngramPrefetch | None" = None
    """Engram rows prefetched for the whole step (§3.1.3); None: each Engram looks its rows up."""
    kv_cache: AttentionCache | None = None
    """Incremental decode: the requests' cached attention state (None = whole-sequence forward)."""
    prefix_ids: torch.Tensor | None = None
    """Incremental decode: [b, h] the tokens right before ``input_ids`` (-1 = before the
    sequence start), so Engram hashes n-grams across the chunk boundary."""
    capture: "dict[int, torch.Tensor | None] | None" = None
    """Layers whose outputs (the mean of the streams, [b, s, d]) the forward records here — the
    DSpark drafter's target layers (§2.4.3); None records nothing."""
    swa_from: torch.Tensor | None = None
    """Train-aware Decoder SWA Bounded Replay (report §3.2.2): [b] replay start s per row; a
    decoder query at position i >= s attends SWA keys in [max(s, i-W+1), i] only, as the engine
    that generated the row did (None = ordinary windows)."""

    @classmethod
    def create(cls, input_ids: torch.Tensor, plan: LayerPlan, *, positions: torch.Tensor | None = None,
               doc_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
               routing=None) -> "ForwardContext":
        if positions is None:
            positions = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        return cls(input_ids=input_ids, positions=positions, shared=SharedStateRegistry(plan),
                   doc_ids=doc_ids, image_mask=image_mask, routing=routing)

    def add_aux_loss(self, name: str, value: torch.Tensor) -> None:
        self.aux_losses[name] = self.aux_losses[name] + value if name in self.aux_losses else value

    def add_metric(self, name: str, value: torch.Tensor) -> None:
        value = value.detach()
        self.aux_metrics[name] = self.aux_metrics[name] + value if name in self.aux_metrics else value

    def total_aux_loss(self) -> torch.Tensor | None:
        if not self.aux_losses:
            return None
        return sum(self.aux_losses.values())
