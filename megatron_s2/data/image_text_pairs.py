"""Image-caption pairs for the contrastive phase (``phase.kind: contrastive``).

A small adapter with the data iterator's interface (``next_step`` / ``state_dict`` /
``load_state_dict``) over the embedded procedural source
(:mod:`megatron_s2.data.procedural_images`). Step ``s`` of a run takes items
``s*G .. s*G + G - 1`` of the source (``G`` = global batch), and data-parallel rank ``r`` of
``dp`` the ``r``-th contiguous ``G / dp`` of them, so the global batch of a step does not depend
on the layout (DP parity). Held-out pairs are another seed of the same source
(:func:`heldout_pairs`). When image-text loading from local files arrives
(``megatron_s2/data/loader.py``), only :func:`build_pair_source` changes: the trainer reads
``(Pillow image, caption)`` pairs and nothing else.
"""

from __future__ import annotations

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError
from megatron_s2.data.procedural_images import procedural_items

__all__ = ["ProceduralPairs", "build_pair_source", "heldout_pairs", "HELDOUT_SEED_OFFSET"]

HELDOUT_SEED_OFFSET = 1_000_003
"""Held-out items are the source seeded ``training.seed + HELDOUT_SEED_OFFSET``."""


class ProceduralPairs:
    """This rank's share of each step's global batch of procedural (image, caption) pairs."""

    def __init__(self, *, seed: int, image_size: int, global_batch_size: int, dp_rank: int, dp_size: int):
        if global_batch_size % dp_size:
            raise ConfigError(f"training.global_batch_size: {global_batch_size} pairs do not split over {dp_size} "
                              "data-parallel ranks; use a multiple of dp")
        self.seed, self.image_size = seed, image_size
        self.global_batch_size, self.per_rank = global_batch_size, global_batch_size // dp_size
        self.first = dp_rank * self.per_rank
        self.step = 0

    def next_step(self) -> list[tuple[object, str]]:
        start = self.step * self.global_batch_size + self.first
        self.step += 1
        items = procedural_items(self.per_rank, seed=self.seed, start=start, size=self.image_size)
        return [(item.image, item.caption) for item in items]

    def state_dict(self) -> dict:
        return {"source": "procedural", "seed": self.seed, "step": self.step,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("source") != "procedural" or state.get("seed") != self.seed \
                or state.get("global_batch_size") != self.global_batch_size:
            raise DataError(f"the checkpoint's pair source {state} is not this run's (procedural, seed {self.seed}, "
                            f"global batch {self.global_batch_size})")
        self.step = int(state["step"])


def build_pair_source(contrastive, *, seed: int, global_batch_size: int, dp_rank: int, dp_size: int):
    """The phase's pair source (``contrastive.source``)."""
    return ProceduralPairs(seed=seed, image_size=contrastive.image_size, global_batch_size=global_batch_size,
                           dp_rank=dp_rank, dp_size=dp_size)


def heldout_pairs(n: int, *, seed: int, image_size: int) -> list[tuple[object, str]]:
    """``n`` pairs no training step sees (module docstring)."""
    return [(item.image, item.caption)
            for item in procedural_items(n, seed=seed + HELDOUT_SEED_OFFSET, size=image_size)]
