"""Series tokens into a family's token embeddings (Intern-S2 report §2.2.1, "projection to the
LLM space"), the way images are (``models/v41/vision/tower.py::merge_image_embeddings``).

The data side reserves ``plan_patching(T, ...).num_tokens`` placeholder positions per series
(:meth:`TimeSeriesEncoder.plan` gives the same number); :func:`merge_series_embeddings` encodes
every series of the micro-batch in one encoder call (mixed lengths, rates and channel counts)
and overwrites each placeholder span with its series' tokens. Family-neutral: it needs only the
embeddings ``[b, s, d]`` a family computes before its layers, so a V4.1 or Intern-S2 model calls
it from ``embed`` like the vision merge. The retained ``mu``/``sigma`` come back for the
forecaster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_s2.models.timeseries.encoder import SeriesInput, TimeSeriesEncoder, TimeSeriesEncoding

__all__ = ["SeriesPlacement", "merge_series_embeddings"]


@dataclass(frozen=True)
class SeriesPlacement:
    """One series of a sequence and the first of its reserved token positions."""

    start: int
    series: SeriesInput


def merge_series_embeddings(h: torch.Tensor, placements: Sequence[Sequence[SeriesPlacement] | None],
                            encoder: TimeSeriesEncoder, *, encoding: TimeSeriesEncoding | None = None,
                            window: tuple[int, int] | None = None) -> tuple[torch.Tensor, TimeSeriesEncoding | None]:
    """Embeddings [b, s, d] with every series span overwritten by its series' tokens.

    ``placements[i]`` lists the series of sequence ``i`` (None or empty: text only). Out of place,
    like the image merge: gradients reach the encoder through the spans and the word embeddings
    through every other position. Returns the encoding too (mu/sigma per series, in the order of
    ``placements`` flattened), or None when there was no series. ``encoding``: the encoder's output
    over these placements when the caller already encoded them (it is not run again). ``window``:
    (first position, sequence length) when ``h`` holds only positions ``first .. first + h.size(1) - 1``
    of sequences of that length (sequence parallelism): only the span rows that fall there are written."""
    flat = [(i, place) for i, sample in enumerate(placements) for place in (sample or ())]
    if not flat:
        return h, None
    if len(placements) != h.size(0):
        raise ValueError(f"placements cover {len(placements)} sequences, the embeddings {h.size(0)}")
    if encoding is None:
        encoding = encoder([place.series for _, place in flat])
    first, length = window if window is not None else (0, h.size(1))
    rows, cols, values = [], [], []
    for k, (i, place) in enumerate(flat):
        count = encoding.plans[k].num_tokens
        if place.start < 0 or place.start + count > length:
            raise ValueError(f"series span {place.start}..{place.start + count - 1} of sequence {i} runs past its "
                             f"{length} positions; reserve plan_patching(...).num_tokens = {count} positions")
        lo, hi = max(place.start, first), min(place.start + count, first + h.size(1))  # the span inside the window
        if lo >= hi:
            continue
        rows.append(torch.full((hi - lo,), i, device=h.device))
        cols.append(torch.arange(lo - first, hi - first, device=h.device))
        values.append(encoding.tokens[k, lo - place.start:hi - place.start].to(h.dtype))
    if not rows:  # no span in this window: keep the tokens in the graph (a zero gradient reaches the encoder)
        return h + encoding.tokens.sum().to(h.dtype) * 0.0, encoding
    return h.index_put((torch.cat(rows), torch.cat(cols)), torch.cat(values)), encoding
