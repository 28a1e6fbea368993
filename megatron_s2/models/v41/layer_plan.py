"""The per-layer attention plan of the backbone, derived from :class:`V41Config`.

CSA2 (report §2.3.1) statically assigns every layer one of three modes; the first layers are
pure sliding-window attention (§2.1). A layer in

* **Full** mode computes its own main KV (compressor) and index K, runs its indexer and
  publishes fresh top-k indices;
* **Reindex** mode reuses the most recent main KV and its index K, computes its own indexer
  query and publishes fresh top-k indices;
* **Reuse** mode reuses the most recent main KV and the latest top-k computed against it.

Under the Causal Encoder-Decoder (§2.2, Eq. 1) the decoder's global KV is projected from the
last encoder layer's hidden state H_{L/2}. As in the released model, the decoder's only Full
layer is its *first* layer, and it compresses its own normalised attention input — which is
exactly ``attn_norm(H_{L/2})``: under Single-Pass mHC the first decoder block collapses the
encoder's final streams with the encoder's last mix. A Full layer deeper in the decoder would
compress decoder states, so prefill could no longer run the encoder alone; such plans are
refused. The Hierarchical Sparse Indexer (§2.3.2) makes that layer the *candidate source*;
later decoder Reindex layers search only its candidate pool.

The plan names, for every consumer, the *producer* layer of each shared state. Pipeline
payloads, shadow indexers and accounting are all derived from these producer links, never
hand-listed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
import functools
from functools import lru_cache
from typing import TYPE_CHECKING

from megatron_s2.config.schema import ConfigError

if TYPE_CHECKING:
    from megatron_s2.models.v41.config import V41Config

__all__ = ["CSA2Mode", "LayerSpec", "LayerPlan", "SharedStateKind"]


class CSA2Mode(str, enum.Enum):
    SWA = "swa"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


class SharedStateKind(str, enum.Enum):
    """What a producer layer publishes for later layers (§3.1.2 "shared states")."""

    MAIN_KV = "main_kv"            # compressed main KV after RoPE (+FP4 QAT): float [b, n_c, head_dim]
    INDEX_K = "index_k"            # indexer keys projected from main KV: float [b, n_c, index_head_dim]
    TOPK = "topk"                  # selected compressed positions: int [b, s, topk], -1 = none
    CANDIDATES = "candidates"      # candidate-pool positions: int [b, s, pool], -1 = none
    # Representations a pipeline cut may carry instead of the states above, so that a shadow
    # replica re-derives them on the consumer stage (§3.1.2 shadow indexers):
    LATENT = "latent"              # RoPE-free compressed latent: float [b, n_c, head_dim]
    CANDIDATE_QUERY = "candidate_query"  # candidate source's indexer inputs: float [b, s, q_lora + H_I/tp]

    @property
    def differentiable(self) -> bool:
        return self in (SharedStateKind.MAIN_KV, SharedStateKind.INDEX_K, SharedStateKind.LATENT)


@dataclass(frozen=True)
class LayerSpec:
    """Everything about one layer that follows from the plan (not from parameters)."""

    index: int
    mode: CSA2Mode
    compress_ratio: int
    is_encoder: bool
    kv_source: int | None        # producer of main KV and index K (self for Full)
    index_source: int | None     # producer of the top-k this layer attends with (self for Full/Reindex)
    candidate_source: int | None  # producer of the candidate pool this layer's indexer searches
    is_candidate_source: bool
    uses_encoder_output: bool    # CED: the decoder Full layer, whose attention input is H_{L/2} (Eq. 1)
    has_engram: bool

    @property
    def is_csa2(self) -> bool:
        return self.mode is not CSA2Mode.SWA

    @property
    def computes_main_kv(self) -> bool:
        return self.mode is CSA2Mode.FULL

    @property
    def runs_indexer(self) -> bool:
        return self.mode in (CSA2Mode.FULL, CSA2Mode.REINDEX)

    def consumes(self) -> list[tuple[int, SharedStateKind]]:
        """(producer layer, state) pairs this layer reads from *other* layers."""
        reads: list[tuple[int, SharedStateKind]] = []
        if self.mode is CSA2Mode.REINDEX:
            reads += [(self.kv_source, SharedStateKind.MAIN_KV), (self.kv_source, SharedStateKind.INDEX_K)]
        elif self.mode is CSA2Mode.REUSE:
            reads += [(self.kv_source, SharedStateKind.MAIN_KV), (self.index_source, SharedStateKind.TOPK)]
        if self.candidate_source is not None and self.candidate_source != self.index:
            reads.append((self.candidate_source, SharedStateKind.CANDIDATES))
        return reads

    def produces(self) -> list[SharedStateKind]:
        out: list[SharedStateKind] = []
        if self.mode is CSA2Mode.FULL:
            out += [SharedStateKind.MAIN_KV, SharedStateKind.INDEX_K]
        if self.runs_indexer:
            out.append(SharedStateKind.TOPK)
        if self.is_candidate_source:
            out.append(SharedStateKind.CANDIDATES)
        return out


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    num_encoder_layers: int

    @property
    def last_encoder_layer(self) -> int:
        return self.num_encoder_layers - 1

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def consumers(self, producer: int, kind: SharedStateKind) -> list[int]:
        """Layers that read ``kind`` produced by ``producer``."""
        return list(self._consumer_table.get((producer, kind), ()))

    @functools.cached_property
    def _consumer_table(self) -> dict[tuple[int, SharedStateKind], tuple[int, ...]]:
        """(producer, kind) -> the layers reading it, built once: the shared-state registry asks
        on every publish and consume (about 120 times a decode step of ``small``)."""
        table: dict[tuple[int, SharedStateKind], list[int]] = {}
        for spec in self.layers:
            for pair in spec.consumes():
                users = table.setdefault(pair, [])
                if spec.index not in users:
                    users.append(spec.index)
        return {pair: tuple(users) for pair, users in table.items()}

    def shared_states(self) -> list[tuple[int, SharedStateKind]]:
        """Every (producer, kind) read by some other layer, in producer order."""
        order = list(SharedStateKind)
        pairs = {pair for s in self.layers for pair in s.consumes()}
        return sorted(pairs, key=lambda p: (p[0], order.index(p[1])))

    def last_consumer(self, producer: int, kind: SharedStateKind) -> int | None:
        users = self.consumers(producer, kind)
        return max(users) if users else None

    def crossing(self, cut: int) -> list[tuple[int, SharedStateKind]]:
        """Shared states that must travel across a pipeline cut placed *before* layer ``cut``:
        produced below the cut and consumed at or above it (§3.1.2, payload extensions)."""
        return [
            (p, k) for p, k in self.shared_states()
            if p < cut and any(c >= cut for c in self.consumers(p, k))
        ]

    def summary(self) -> str:
        rows = []
        for s in self.layers:
            part = "enc" if s.is_encoder else "dec"
            extra = []
            if s.kv_source is not None and s.kv_source != s.index:
                extra.append(f"kv<-{s.kv_source}")
            if s.mode is CSA2Mode.REUSE:
                extra.append(f"topk<-{s.index_source}")
            if s.uses_encoder_output:
                extra.append("kv from encoder output")
            if s.is_candidate_source:
                extra.append("candidate source")
            elif s.candidate_source is not None:
                extra.append(f"candidates<-{s.candidate_source}")
            if s.has_engram:
                extra.append("engram")
            ratio = f"m={s.compress_ratio}" if s.is_csa2 else "   "
            rows.append(f"{s.index:3d} {part} {s.mode.value:8s} {ratio} {', '.join(extra)}")
        return "\n".join(rows)

    @staticmethod
    def from_config(cfg: "V41Config") -> "LayerPlan":
        return _build_plan(cfg.layer_groups, cfg.num_encoder_layers, tuple(cfg.engram_layers),
                           cfg.candidate_topk_blocks > 0)


@lru_cache(maxsize=64)
def _build_plan(groups, num_encoder_layers: int, engram_layers: tuple[int, ...], hierarchical: bool) -> LayerPlan:
    modes: list[tuple[CSA2Mode, int]] = []
    for g in groups:
        for _ in range(g.repeat):
            modes += [(CSA2Mode(m), g.compress_ratio) for m in g.modes]
    num_layers = len(modes)
    specs: list[LayerSpec] = []
    kv_src: int | None = None  # most recent Full layer
    idx_src: int | None = None  # most recent Full/Reindex layer against the current main KV
    candidate_src: int | None = None
    for i, (mode, ratio) in enumerate(modes):
        is_encoder = i < num_encoder_layers
        where = f"layer_groups: layer {i} ({mode.value}, m={ratio})"
        if mode is CSA2Mode.SWA:
            specs.append(LayerSpec(i, mode, 0, is_encoder, None, None, None, False, False, i in engram_layers))
            continue
        if mode is CSA2Mode.FULL:
            kv_src, idx_src = i, i
        else:
            if kv_src is None:
                raise ConfigError(f"{where} has no preceding Full layer to take main KV from; "
                                  "start the group with 'full'")
            if modes[kv_src][1] != ratio:
                raise ConfigError(f"{where} would reuse the main KV of layer {kv_src}, which has "
                                  f"compression ratio {modes[kv_src][1]}; give both the same ratio "
                                  "or start a new group with 'full'")
            if mode is CSA2Mode.REINDEX:
                idx_src = i
        uses_encoder_output = mode is CSA2Mode.FULL and not is_encoder
        if uses_encoder_output and i != num_encoder_layers:
            raise ConfigError(f"{where} is a Full layer inside the decoder; under the Causal Encoder-Decoder "
                              f"(§2.2, Eq. 1) the decoder's main KV is compressed from H_(L/2), which only the "
                              f"first decoder layer ({num_encoder_layers}) reads as its attention input; make "
                              "this layer 'reindex' or 'reuse', or move num_encoder_layers")
        is_cand_src = hierarchical and uses_encoder_output
        cand = None
        if is_cand_src:
            candidate_src = cand = i
        elif hierarchical and mode is CSA2Mode.REINDEX and not is_encoder and candidate_src is not None:
            cand = candidate_src  # the pool indexes the decoder's one main KV (no later Full layer)
        specs.append(LayerSpec(
            index=i, mode=mode, compress_ratio=ratio, is_encoder=is_encoder, kv_source=kv_src,
            index_source=idx_src, candidate_source=cand, is_candidate_source=is_cand_src,
            uses_encoder_output=uses_encoder_output, has_engram=i in engram_layers,
        ))
    if num_encoder_layers > num_layers:
        raise ConfigError(f"num_encoder_layers: {num_encoder_layers} exceeds the {num_layers} layers of layer_groups")
    return LayerPlan(tuple(specs), num_encoder_layers)
