"""Patch-length planning for the time-series encoder (Intern-S2 report §2.2.1, Stages 1-2).

The encoder keeps "a controllable output sequence length for heterogeneous long time series" by
"dynamically adjusting the temporal patching process according to input length". With patch
length ``L`` raw samples and ``Q`` Q-Former queries per patch, a series of ``T`` steps yields
``Q * ceil(T / L)`` tokens. Given a token budget ``B`` the patch length grows with ``T`` so the
token count does not:

    L = ceil(T / floor(B / Q))          (= ceil(Q * T / B) when Q divides B, the walkthrough's form)

Worked numbers (walkthrough, Worked example 1): T = 300,000, B = 1,024, Q = 4 gives L = 1,172
(256 patches, 1,024 tokens); a 4,096-sample radar burst gives L = 16 (again 1,024 tokens),
where a fixed L = 1,172 would have squeezed it into 4 patches = 16 tokens.

Writing ``L`` as ``T`` over the number of patches the budget allows (rather than ``Q * T / B``)
keeps the count within budget when ``Q`` does not divide ``B``. The token count is *not*
monotone in ``T``: when ``L`` steps up by one the patch count drops (T = 256 → 256 patches of 1,
T = 257 → 129 patches of 2), a saw-tooth between half the budget and the budget once
``T`` exceeds ``B / Q``. ``L`` itself is monotone.

Stage 1 (temporal chunking) cuts the series into chunks of whole patches, ``patches_per_chunk``
each (capped at ``max_chunk_samples`` raw samples), so the CNN embedder and the Q-Former run
chunk by chunk with activations bounded by one chunk, whatever ``T`` is. No torch here, so the
data side can size (reserve) the series-token positions without building a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PatchPlan", "plan_patching", "patch_length"]


@dataclass(frozen=True)
class PatchPlan:
    """How one series of ``length`` steps is cut into chunks and patches."""

    length: int
    """T: raw samples of the series (per channel)."""
    patch_length: int
    """L: raw samples per patch (the last patch is zero-padded and masked)."""
    num_patches: int
    """ceil(T / L)."""
    queries_per_patch: int
    """Q: Q-Former outputs per patch."""
    patches_per_chunk: int
    """Patches in one Stage-1 temporal chunk (the last chunk may hold fewer)."""

    @property
    def num_tokens(self) -> int:
        """Series tokens handed to the backbone: Q per patch."""
        return self.num_patches * self.queries_per_patch

    @property
    def padded_length(self) -> int:
        """T rounded up to whole patches."""
        return self.num_patches * self.patch_length

    @property
    def chunk_length(self) -> int:
        """Raw samples per full temporal chunk."""
        return self.patches_per_chunk * self.patch_length

    @property
    def num_chunks(self) -> int:
        """Stage-1 chunks: ceil(num_patches / patches_per_chunk)."""
        return -(-self.num_patches // self.patches_per_chunk)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def patch_length(length: int, token_budget: int, queries_per_patch: int) -> int:
    """L = ceil(T / floor(B / Q)): the smallest patch length whose Q * ceil(T / L) fits B."""
    _positive("series length", length)
    _positive("token_budget", token_budget)
    _positive("queries_per_patch", queries_per_patch)
    max_patches = token_budget // queries_per_patch
    if max_patches < 1:
        raise ValueError(f"token_budget {token_budget} is below queries_per_patch {queries_per_patch}: "
                         f"raise the budget to at least {queries_per_patch} or lower the queries")
    return math.ceil(length / max_patches)


def plan_patching(length: int, token_budget: int, queries_per_patch: int, *,
                  patches_per_chunk: int = 64, min_patch_length: int = 1,
                  max_chunk_samples: int | None = None) -> PatchPlan:
    """Stage 1 + Stage 2 plan of one series: adaptive patch length, patch count, chunks.

    ``min_patch_length`` floors ``L`` for very short series (fewer tokens than the budget then:
    Q queries summarising a single sample would spend budget on nothing). ``max_chunk_samples``
    caps a chunk's raw samples (fewer patches per chunk as ``L`` grows, never fewer than one), so
    a chunk's activations stay the same size however long the series: without it a chunk grows
    with ``L`` and, past the caches, the per-sample cost rose (measured: 2.7x the CNN time per
    chunk for 2x the chunk at T = 300,000)."""
    _positive("patches_per_chunk", patches_per_chunk)
    _positive("min_patch_length", min_patch_length)
    chosen = max(patch_length(length, token_budget, queries_per_patch), min_patch_length)
    if max_chunk_samples is not None:
        _positive("max_chunk_samples", max_chunk_samples)
        patches_per_chunk = max(1, min(patches_per_chunk, max_chunk_samples // chosen))
    return PatchPlan(length=length, patch_length=chosen, num_patches=math.ceil(length / chosen),
                     queries_per_patch=queries_per_patch, patches_per_chunk=patches_per_chunk)
