"""Prompt order and dispatch decisions with counter-based random streams (crash-safe by construction).

Every random decision of the orchestrator is drawn from ``numpy.random.default_rng([seed,
stream, counter])``: the RNG "state" of a stream is one integer, so a checkpoint restores it
exactly and a resumed run makes the same decisions as an uninterrupted one.

* :class:`PromptCursor` — each dataset is read in a fresh permutation per epoch (stream
  ``PERMUTATION``, keyed by the dataset name and epoch); its state is (epoch, position), so no
  prompt is skipped or repeated across a restart.
* :func:`choose_dataset` — the next prompt's dataset, drawn by weight among the datasets whose
  group still fits under the global in-flight bound and their own concurrency limit (report
  §5.2.2); stream ``DATASET``, counter = number of prompts dispatched so far.
* :func:`sample_seed` — the sampling seed of a generation attempt, from its sample id.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

__all__ = ["counter_rng", "sample_seed", "PromptCursor", "choose_dataset", "PERMUTATION", "DATASET", "SAMPLE"]

PERMUTATION, DATASET, SAMPLE = 1, 2, 3


def counter_rng(seed: int, stream: int, *counters: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, stream, *(int(c) for c in counters)])


def sample_seed(seed: int, sample_id: int) -> int:
    return int(counter_rng(seed, SAMPLE, sample_id).integers(0, 2 ** 31 - 1))


class PromptCursor:
    """Epoch-shuffled order over one dataset."""

    def __init__(self, name: str, size: int, seed: int):
        if size < 1:
            raise ValueError(f"prompt dataset '{name}' is empty")
        self.name, self.size, self.seed = name, size, seed
        self.epoch, self.position = 0, 0
        self._key = zlib.crc32(name.encode())
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return counter_rng(self.seed, PERMUTATION, self._key, epoch).permutation(self.size)

    def next(self) -> tuple[int, int]:
        """(prompt index, epoch) of the next prompt; advances the cursor."""
        if self.position == self.size:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        index = int(self._order[self.position])
        self.position += 1
        return index, self.epoch

    def state_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["name"] != self.name or state["size"] != self.size:
            raise ValueError(f"prompt cursor state is for dataset '{state['name']}' of {state['size']} prompts, "
                             f"not '{self.name}' of {self.size}; resume with the same datasets")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if not 0 <= self.position <= self.size:
            raise ValueError(f"prompt cursor position {self.position} outside 0..{self.size}")
        self._order = self._permutation(self.epoch)


def choose_dataset(names: Sequence[str], weights: Sequence[float], seed: int, counter: int) -> str:
    """Weighted draw among ``names`` (the eligible datasets) for dispatch number ``counter``."""
    if not names:
        raise ValueError("no eligible dataset")
    if len(names) == 1:
        return names[0]
    w = np.asarray(weights, dtype=np.float64)
    u = counter_rng(seed, DATASET, counter).random()
    return names[int(np.searchsorted(np.cumsum(w / w.sum()), u, side="right").clip(0, len(names) - 1))]
