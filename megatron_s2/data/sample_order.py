"""Which packed row is global sample *g*: epoch-seeded shuffling and weighted blending.

The trainer consumes an infinite stream of packed rows, global sample 0, 1, 2, ...; step *k*
takes samples ``[k * global_batch_size, (k + 1) * global_batch_size)``. The stream is a pure
function of the sample index (no hidden iterator state), which makes resuming exact and makes
the token order independent of the data-parallel layout.

The stream is cut into *blend epochs* of ``E`` samples. Dataset *d* (with ``P_d`` packed rows)
contributes ``n_d`` samples to every blend epoch:

* one dataset: ``n_0 = P_0``, so a blend epoch is one pass over the data;
* several datasets without weights: ``n_d = P_d`` (natural proportions);
* with weights ``w_d``: ``E = sum(P_d)`` and ``n_d`` is ``E * w_d / sum(w)`` rounded by
  largest remainder (at least 1), so the blend matches the weights in every epoch.

Dataset *d* walks its own infinite stream of rows, a fresh seeded permutation of its ``P_d``
rows per dataset epoch; blend epoch *e* takes entries ``[e * n_d, (e + 1) * n_d)`` of it, so
an up-weighted dataset repeats rows only after using all of them, and a down-weighted one
cycles through all of its rows over successive epochs. The ``E`` chosen ``(dataset, row)``
pairs are then shuffled by a permutation seeded with ``(seed, e)``: a new order every epoch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_s2.data.errors import DataError

__all__ = ["BlendedSampleOrder", "blend_counts"]

_DATASET_STREAM = 0x5EED_D5
_BLEND_STREAM = 0xB1E_0D


def blend_counts(rows_per_dataset: Sequence[int], weights: Sequence[float] | None) -> np.ndarray:
    """Samples each dataset contributes to one blend epoch (see module docstring)."""
    rows = np.asarray(rows_per_dataset, dtype=np.int64)
    if len(rows) == 0 or np.any(rows < 1):
        raise DataError(f"blend: every dataset needs at least one packed row, got {rows.tolist()}")
    if not weights:
        return rows.copy()
    if len(weights) != len(rows):
        raise DataError(f"blend: {len(weights)} weights for {len(rows)} datasets")
    total = int(rows.sum())
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    # Largest remainder; ties go to the earlier dataset (stable sort).
    leftover = total - int(counts.sum())
    counts[np.argsort(-(shares - counts), kind="stable")[:leftover]] += 1
    return np.maximum(counts, 1)


class BlendedSampleOrder:
    """Maps global sample indices to ``(dataset, row)`` pairs; deterministic in ``seed``."""

    def __init__(self, rows_per_dataset: Sequence[int], weights: Sequence[float] | None, seed: int) -> None:
        if seed < 0:
            raise DataError(f"seed: the shuffle seed must be non-negative, got {seed}")
        self.rows_per_dataset = np.asarray(rows_per_dataset, dtype=np.int64)
        self.counts = blend_counts(rows_per_dataset, weights)
        self.seed = seed
        self._cached_epoch = -1
        self._epoch_datasets = np.empty(0, dtype=np.int64)
        self._epoch_rows = np.empty(0, dtype=np.int64)

    @property
    def epoch_length(self) -> int:
        """Samples per blend epoch."""
        return int(self.counts.sum())

    def lookup(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset ids, row ids)`` of the given global sample indices (any order)."""
        samples = np.asarray(samples, dtype=np.int64)
        datasets = np.empty_like(samples)
        rows = np.empty_like(samples)
        epochs = samples // self.epoch_length
        for epoch in np.unique(epochs).tolist():
            where = epochs == epoch
            epoch_datasets, epoch_rows = self._epoch(epoch)
            within = samples[where] - epoch * self.epoch_length
            datasets[where] = epoch_datasets[within]
            rows[where] = epoch_rows[within]
        return datasets, rows

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch != self._cached_epoch:
            dataset_ids, row_ids = [], []
            for dataset, (count, num_rows) in enumerate(zip(self.counts.tolist(), self.rows_per_dataset.tolist())):
                stream = np.arange(epoch * count, (epoch + 1) * count, dtype=np.int64)
                picked = np.empty(count, dtype=np.int64)
                dataset_epochs = stream // num_rows
                for dataset_epoch in np.unique(dataset_epochs).tolist():
                    where = dataset_epochs == dataset_epoch
                    picked[where] = self._dataset_permutation(dataset, dataset_epoch)[stream[where] % num_rows]
                dataset_ids.append(np.full(count, dataset, dtype=np.int64))
                row_ids.append(picked)
            shuffle = np.random.default_rng([self.seed, _BLEND_STREAM, epoch]).permutation(self.epoch_length)
            self._epoch_datasets = np.concatenate(dataset_ids)[shuffle]
            self._epoch_rows = np.concatenate(row_ids)[shuffle]
            self._cached_epoch = epoch
        return self._epoch_datasets, self._epoch_rows

    def _dataset_permutation(self, dataset: int, dataset_epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _DATASET_STREAM, dataset, dataset_epoch])
        return rng.permutation(int(self.rows_per_dataset[dataset]))
