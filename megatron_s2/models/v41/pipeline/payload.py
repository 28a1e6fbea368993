"""Pipeline payload extensions (report §3.1.2).

A conventional pipeline sends one hidden-state tensor between stages. A CSA2 backbone must
also send whatever shared attention state is produced above a cut and consumed below it:
main KV, index K, top-k indices, the candidate pool — plus the mHC streams (which carry
H_{L/2} to the CED decoder) and the single-pass input mix. :class:`PayloadSpec` derives the
fields of a cut from the layer plan (``LayerPlan.crossing``), never from a hand-written list, and fixes
their shapes and dtypes so the receiver can pre-allocate. Float fields (streams, KV, index
K) carry their gradients back; integer fields (indices) need none.

Two states can be *recomputed* on the consumer stage by a shadow replica instead of being
sent (``PayloadModes``):

* ``index_k="shadow"``: send the RoPE-free latent instead of main KV + index K; the receiver
  re-derives main KV (RoPE + FP4 QAT, parameter-free) and index K (shadow of the producer's
  index-key projection). Saves index_head_dim values per compressed entry.
* ``candidates="shadow"``: send the candidate source's indexer inputs (compressed query and
  head weights, detached) instead of the candidate pool; a shadow of its query projection
  re-scores and re-selects the blocks. The pool is ``2048 x 8`` ids per query in the
  flagship (64 KiB/token) against ``q_lora + H_I`` values (~5 KiB/token).

Under context parallelism every per-query field holds only this rank's chunks (partitioned
like the hidden state) while the compressed-entry fields hold the whole sequence's entries,
which every CP rank already has after the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_s2.models.v41.layer_plan import LayerPlan, SharedStateKind as K
from megatron_s2.models.v41.config import V41Config
from megatron_s2.parallel.p2p import PayloadField

__all__ = ["PayloadModes", "PayloadField", "PayloadSpec", "payload_keys"]

StateKey = tuple[int, K]


@dataclass(frozen=True)
class PayloadModes:
    index_k: Literal["send", "shadow"] = "send"
    candidates: Literal["send", "shadow"] = "send"


def payload_keys(plan: LayerPlan, cut: int, modes: PayloadModes) -> list[StateKey]:
    """Shared states (in sent representation) that cross a cut placed before layer ``cut``."""
    crossing = plan.crossing(cut)
    out: list[StateKey] = []
    for producer, kind in crossing:
        if modes.index_k == "shadow" and kind in (K.MAIN_KV, K.INDEX_K):
            if (producer, K.LATENT) not in out:
                out.append((producer, K.LATENT))
            continue
        if modes.candidates == "shadow" and kind is K.CANDIDATES:
            out.append((producer, K.CANDIDATE_QUERY))
            if modes.index_k == "send" and (producer, K.INDEX_K) not in crossing:
                out.append((producer, K.INDEX_K))
            continue
        out.append((producer, kind))
    return out


@dataclass
class PayloadSpec:
    """Fields of the payload crossing a cut, for one micro-batch on one rank."""

    cut: int
    keys: list[StateKey]
    fields: list[PayloadField] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: V41Config, plan: LayerPlan, cut: int, modes: PayloadModes, *, batch: int,
              local_seq: int, full_seq: int, stream_seq: int, tp_size: int) -> "PayloadSpec":
        """``local_seq``: queries held by this rank (CP chunk); ``stream_seq``: tokens of the
        streams on this rank (local_seq / tp under sequence parallelism)."""
        f32 = torch.float32
        act = getattr(torch, cfg.compute_dtype)  # the streams travel in the activation dtype
        ids = torch.int32  # indices travel as int32 (entry counts stay far below 2^31)
        fields = [PayloadField("x", (batch, stream_seq, cfg.hc_mult, cfg.hidden_size), act, True),
                  PayloadField("pre", (batch, stream_seq, cfg.hc_mult), f32, True)]
        keys = payload_keys(plan, cut, modes)
        for producer, kind in keys:
            ratio = plan[producer].compress_ratio
            entries = full_seq // ratio if ratio else 0
            name = f"{producer}:{kind.value}"
            if kind in (K.MAIN_KV, K.LATENT):
                fields.append(PayloadField(name, (batch, entries, cfg.head_dim), f32, True))
            elif kind is K.INDEX_K:
                fields.append(PayloadField(name, (batch, entries, cfg.index_head_dim), f32, True))
            elif kind is K.TOPK:
                fields.append(PayloadField(name, (batch, local_seq, cfg.index_topk), ids, False))
            elif kind is K.CANDIDATES:
                fields.append(PayloadField(name, (batch, local_seq, cfg.candidate_pool_size), ids, False))
            elif kind is K.CANDIDATE_QUERY:
                width = cfg.q_lora_rank + cfg.index_num_heads // tp_size
                fields.append(PayloadField(name, (batch, local_seq, width), f32, False))
            else:  # pragma: no cover - every kind is listed above
                raise ValueError(f"no payload layout for {kind}")
        return cls(cut, keys, fields)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def state_bytes(self) -> int:
        """Bytes of the shared-state extension alone (everything but the streams)."""
        return sum(f.nbytes for f in self.fields if f.name not in ("x", "pre"))
