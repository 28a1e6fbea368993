"""Parallel layout section of a recipe (``parallel:``).

Sizes only; the rank grid, the groups and the validation against a model and a world size
live in :mod:`megatron_s2.parallel.layout`, which the trainer and the launcher's pre-flight
check both use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: attention/indexer heads, output groups, expert FFN width, vocab."""
    sequence_parallel: bool = False
    """Split norms, mHC streams and other non-tensor-parallel regions over the sequence (needs tp > 1)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""
    pipeline_layers: tuple[int, ...] = ()
    """Layers per (virtual) pipeline stage, first to last; empty = even split (an uneven split
    must be written out, it is never guessed)."""
    payload_index_k: Literal["send", "shadow"] = "send"
    """How a pipeline cut carries a Full layer's main KV + index K to later stages: send both,
    or send the RoPE-free latent and re-derive index K with a shadow of the owner's
    projection (§3.1.2 shadow indexers)."""
    payload_candidates: Literal["send", "shadow"] = "send"
    """How a cut carries the hierarchical indexer's candidate pool: send the ids, or send the
    candidate source's indexer inputs and re-select with a shadow of its query projection."""
    cp: int = 1
    """Context-parallel size: each sequence split into 2*cp load-balanced chunks."""
    ep: int = 1
    """Expert-parallel size: routed experts split over ep ranks."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's FFN width split over etp ranks."""
    dp: int = 0
    """Data-parallel size; 0 = derived as world_size / (tp * pp * cp)."""
    engram_parallel: int = 1
    """Engram-parallel size: Engram table rows partitioned over this many ranks (§3.1.3)."""
    distributed_optimizer: bool = False
    """ZeRO-1: shard optimiser state over data-parallel replicas (gradients reduce-scattered to
    their owners, updated parameters all-gathered: plain data parallelism's wire)."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recomputation: none, full (whole layers) or selective (the attention core, run in
    checkpointed query chunks, and the routed experts' SwiGLU: SELECTIVE_RECOMPUTE of
    models/v41/parallel_plan.py). Selective bounds a CSA2 layer's attention memory (no
    [s, heads, head_dim] tensor kept) at the price of recomputing the core in backward."""
    grad_bucket_mb: float = 25.0
    """Size of the gradient all-reduce buckets in MiB."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto = nccl with GPUs, gloo on CPU."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "engram_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ConfigError(f"parallel.dp: must be >= 0 (0 derives it from the world size), got {self.dp}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel: needs tp > 1; set parallel.tp or turn it off")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp: virtual stages need pp > 1")
        if any(n < 1 for n in self.pipeline_layers):
            raise ConfigError(f"parallel.pipeline_layers: every stage needs >= 1 layer, got {list(self.pipeline_layers)}")
        if self.pipeline_layers and len(self.pipeline_layers) != self.pp * self.vpp:
            raise ConfigError(f"parallel.pipeline_layers: {len(self.pipeline_layers)} entries for pp*vpp = "
                              f"{self.pp * self.vpp} stages; give one layer count per (virtual) stage")
        if self.grad_bucket_mb <= 0:
            raise ConfigError("parallel.grad_bucket_mb: must be positive")

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def world_size(self) -> int | None:
        """World size implied by the sizes, or None when dp is derived."""
        return self.model_parallel_size() * self.dp if self.dp else None
