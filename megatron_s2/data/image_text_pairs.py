"""Image-caption pairs for the contrastive phase (``phase.kind: contrastive``).

A small adapter with the data iterator's interface (``next_step`` / ``state_dict`` /
``load_state_dict``) over the embedded procedural source
(:mod:`megatron_s2.data.procedural_images`) or, with ``data.kind: image_text`` and a file
``source`` (folder / parquet / webdataset, :mod:`megatron_s2.data.image_text`), over local
pairs. Step ``s`` of a run takes items ``s*G .. s*G + G - 1`` of the source (``G`` = global
batch; local pairs wrap around, an epoch at a time), and data-parallel rank ``r`` of ``dp`` the
``r``-th contiguous ``G / dp`` of them, so the global batch of a step does not depend on the
layout (DP parity). Held-out pairs are another seed of the procedural source, or the last
``contrastive.eval_items`` local pairs, which training then never sees (:func:`heldout_pairs`).
The trainer reads ``(Pillow image, caption)`` pairs and nothing else.
"""

from __future__ import annotations

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError
from megatron_s2.data.procedural_images import procedural_items

__all__ = ["ProceduralPairs", "LocalPairs", "build_pair_source", "heldout_pairs", "HELDOUT_SEED_OFFSET"]

HELDOUT_SEED_OFFSET = 1_000_003
"""Held-out items are the source seeded ``training.seed + HELDOUT_SEED_OFFSET``."""


class _RankShare:
    """Step ``s`` of rank ``r``: global items ``s*G + r*G/dp .. + G/dp`` (module docstring)."""

    def __init__(self, *, global_batch_size: int, dp_rank: int, dp_size: int):
        if global_batch_size % dp_size:
            raise ConfigError(f"training.global_batch_size: {global_batch_size} pairs do not split over {dp_size} "
                              "data-parallel ranks; use a multiple of dp")
        self.global_batch_size, self.per_rank = global_batch_size, global_batch_size // dp_size
        self.first = dp_rank * self.per_rank
        self.step = 0

    def _next_start(self) -> int:
        """The global index of this rank's first item of the next step (and advance)."""
        start = self.step * self.global_batch_size + self.first
        self.step += 1
        return start


class ProceduralPairs(_RankShare):
    """This rank's share of each step's global batch of procedural (image, caption) pairs."""

    def __init__(self, *, seed: int, image_size: int, global_batch_size: int, dp_rank: int, dp_size: int):
        super().__init__(global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        self.seed, self.image_size = seed, image_size

    def next_step(self) -> list[tuple[object, str]]:
        items = procedural_items(self.per_rank, seed=self.seed, start=self._next_start(), size=self.image_size)
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


class LocalPairs(_RankShare):
    """This rank's share of each step's global batch of local (image, caption) pairs, in the
    order :func:`~megatron_s2.data.image_text.load_image_text_pairs` lists them; images are decoded
    when a batch needs them."""

    def __init__(self, pairs: list, *, global_batch_size: int, dp_rank: int, dp_size: int):
        super().__init__(global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        self.pairs = pairs

    def next_step(self) -> list[tuple[object, str]]:
        start = self._next_start()
        picked = [self.pairs[(start + i) % len(self.pairs)] for i in range(self.per_rank)]
        return [(pair.load(), caption_of(pair)) for pair in picked]

    def state_dict(self) -> dict:
        return {"source": "local", "pairs": len(self.pairs), "step": self.step, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("source") != "local" or state.get("pairs") != len(self.pairs) \
                or state.get("global_batch_size") != self.global_batch_size:
            raise DataError(f"the checkpoint's pair source {state} is not this run's (local, {len(self.pairs)} pairs, "
                            f"global batch {self.global_batch_size})")
        self.step = int(state["step"])


def caption_of(pair) -> str:
    """The text a contrastive pair matches: the caption, or a question and its answer."""
    return pair.text if pair.prompt is None else f"{pair.prompt} {pair.text}"


def _local_split(data, seed: int, eval_items: int) -> tuple[list, list]:
    """(training pairs, held-out pairs): the last ``eval_items`` local pairs are held out."""
    from megatron_s2.data.image_text import load_image_text_pairs

    pairs = load_image_text_pairs(data, seed)
    if len(pairs) <= eval_items:
        raise ConfigError(f"contrastive.eval_items: {eval_items} held-out pairs leave none of the {len(pairs)} "
                          f"pairs in data.paths to train on; lower it (0: no retrieval evaluation)")
    return (pairs[:-eval_items], pairs[-eval_items:]) if eval_items else (pairs, [])


def uses_local_pairs(data) -> bool:
    return data is not None and data.kind == "image_text" and data.source != "procedural"


def build_pair_source(contrastive, *, seed: int, global_batch_size: int, dp_rank: int, dp_size: int, data=None):
    """The phase's pair source: procedural, or the local pairs of ``data`` (module docstring)."""
    if uses_local_pairs(data):
        train, _ = _local_split(data, seed, contrastive.eval_items)
        return LocalPairs(train, global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return ProceduralPairs(seed=seed, image_size=contrastive.image_size, global_batch_size=global_batch_size,
                           dp_rank=dp_rank, dp_size=dp_size)


def heldout_pairs(n: int, *, seed: int, image_size: int, data=None) -> list[tuple[object, str]]:
    """``n`` pairs no training step sees (module docstring)."""
    if uses_local_pairs(data):
        _, held = _local_split(data, seed, n)
        return [(pair.load(), caption_of(pair)) for pair in held]
    return [(item.image, item.caption)
            for item in procedural_items(n, seed=seed + HELDOUT_SEED_OFFSET, size=image_size)]
