"""How one micro-batch's tokens are spread over ranks, and the collectives between the views.

One object owns every sequence-dimension decision of sequence parallelism (SP) and context
parallelism (CP) — which rank holds which tokens and how a tensor moves between views — so no
layer recomputes "is SP on" or reaches for a gather of its own. The views of a micro-batch:

* **context chunk** — the tokens of this CP rank: chunks ``r`` and ``2cp-1-r`` of each
  sequence (load-balanced, :mod:`.context_parallel`), at their global positions
  (``ctx.positions``). Attention queries, the indexer and everything inside a tensor-parallel
  region run on the whole context chunk.
* **stream shard** — under SP, a 1/tp slice of the context chunk: the residual streams,
  norms, mHC and Engram outside the tensor-parallel regions (without SP: the context chunk).
* **routed shard** — 1/tp of the context chunk, the tokens this rank routes through the MoE
  experts (with or without SP: every rank of the tp x ep dispatch domain routes different tokens).
* **full sequence** — all tokens in position order: compressed KV is pooled over it.

The pairs (entry/exit of a tensor-parallel region, gather/slice) are Megatron's conjugate
collectives from :mod:`.mappings`; every method is the identity where the layout does not cut.
A :class:`~megatron_s2.parallel.groups.ParallelGroups` hands out its ``sequence`` sharding;
layers keep it from construction and read per-micro-batch positions from the forward context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.context_parallel import gather_sequence_ordered, window_keys_with_halo
from megatron_s2.parallel.groups import Group

__all__ = ["SequenceSharding"]


@dataclass(frozen=True)
class SequenceSharding:
    tp: Group
    """Tensor-parallel group (also the SP group)."""
    cp: Group
    """Context-parallel group."""
    sp: bool = False
    """Sequence parallelism active: streams are sharded over tp outside tensor-parallel regions."""

    def __post_init__(self) -> None:
        if self.sp and not self.tp.active:
            raise ValueError("sequence parallelism needs a tensor-parallel group of size > 1")

    @classmethod
    def of(cls, tp: Group | None = None, cp: Group | None = None, sequence_parallel: bool = False) -> "SequenceSharding":
        """The sharding of a layout; ``sequence_parallel`` takes effect only with tp > 1."""
        tp, cp = tp or Group(), cp or Group()
        return cls(tp, cp, bool(sequence_parallel and tp.active))

    # ---- tensor-parallel regions (column entry / row exit) --------------------------------
    def enter_tp_region(self, x: torch.Tensor) -> torch.Tensor:
        """Stream shard -> the whole context chunk on every tp rank (column-parallel entry)."""
        return mappings.all_gather_sequence(x, self.tp, dim=1) if self.sp else mappings.copy_to_group(x, self.tp)

    def exit_tp_region(self, y: torch.Tensor) -> torch.Tensor:
        """Partial sums over tp of the context chunk -> summed stream shard (row-parallel exit)."""
        return mappings.reduce_scatter_sequence(y, self.tp, dim=1) if self.sp else mappings.reduce_from_group(y, self.tp)

    # ---- per-token work on the stream shard, consumed inside the tp region ----------------
    def enter_local(self, x: torch.Tensor) -> torch.Tensor:
        """A stream-shard input to per-token projections run once per rank before a gather
        (CSA2 latents): without SP it is replicated, so its gradient is summed over tp."""
        return x if self.sp else mappings.copy_to_group(x, self.tp)

    def gather_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """Per-token results of the stream shard -> the context chunk (all-gather over tp under SP)."""
        return mappings.all_gather_sequence(t, self.tp, dim=1) if self.sp else t

    def gather_full(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-token results of the stream shard -> the whole sequence in position order."""
        return gather_sequence_ordered(self.gather_chunk(t), positions, self.cp)

    def window_keys(self, kv: torch.Tensor, positions: torch.Tensor, window: int, doc_ids: torch.Tensor | None = None,
                    full_doc_ids: torch.Tensor | None = None):
        """Sliding-window keys of the context chunk plus the CP halo (the ``window`` tokens before
        each chunk): ``(keys, key positions [b, n], key document ids [b, n] or None)``; halo slots
        before the sequence start have position < 0 and document -1."""
        if not self.cp.active:
            return kv, positions, doc_ids
        keys, k_pos = window_keys_with_halo(kv, positions, window, self.cp)
        k_doc = None if doc_ids is None else torch.where(k_pos >= 0, full_doc_ids.gather(1, k_pos.clamp_min(0)), -1)
        return keys, k_pos, k_doc

    def full_sequence(self, local: torch.Tensor | None, full: torch.Tensor | None) -> torch.Tensor | None:
        """The whole sequence's copy of a per-token input: ``full`` (carried by a context-parallel
        micro-batch) under CP, else the local one."""
        return full if self.cp.active else local

    def stream_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's stream shard of a per-token tensor ``[b, s_chunk, ...]`` (ids, masks)."""
        return self._slice(t, "sequence parallelism") if self.sp else t

    def stream_length(self, chunk_tokens: int) -> int:
        return chunk_tokens // self.tp.size if self.sp else chunk_tokens

    # ---- the MoE layer's routed shard ------------------------------------------------------
    def enter_routed(self, x: torch.Tensor) -> torch.Tensor:
        """Streams -> the tokens this rank routes (a disjoint 1/tp of the context chunk)."""
        if not self.tp.active or self.sp:
            return x
        self._check_split(x.size(1), "the MoE layer's token split")
        return mappings.scatter_to_group(x, self.tp, dim=1)

    def leave_routed(self, y: torch.Tensor) -> torch.Tensor:
        """Routed outputs -> the streams' view (all-gather over tp without SP)."""
        if not self.tp.active or self.sp:
            return y
        return mappings.gather_from_group(y, self.tp, dim=1)

    def routed_slice(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's routed tokens of a per-token tensor covering the context chunk."""
        return t if t is None or not self.tp.active else self._slice(t, "the MoE layer's token split")

    # ---- helpers ---------------------------------------------------------------------------
    def _check_split(self, length: int, what: str) -> None:
        if length % self.tp.size:
            raise ValueError(f"{what}: {length} tokens do not split over tp={self.tp.size}; training.seq_length "
                             "must be a multiple of the layout's seq_len_divisor")

    def _slice(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self._check_split(t.size(1), what)
        step = t.size(1) // self.tp.size
        return t[:, self.tp.rank * step:(self.tp.rank + 1) * step]
