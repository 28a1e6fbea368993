"""How a family attaches the time-series lane (Intern-S2 report §2.2.1, "projected to the LLM
space ... inserted at series-token positions"): one helper each for building, encoding, merging.

A family whose ``model.timeseries`` is set builds :func:`build_series_encoder` beside its word
embedding (first pipeline stage) as ``model.timeseries``, and its ``embed(tokens, series=...)``
calls :func:`merge_series`. ``series`` is either the raw per-row
:class:`~megatron_s2.models.timeseries.insertion.SeriesPlacement` lists of a micro-batch
(``data.kind: timeseries``) or an :class:`EncodedSeries` made once per micro-batch by
:func:`encode_series` — the forecasting phase encodes first, so its objective reads the same
encoding (tokens and the retained mu / sigma) the backbone was given.

Initialisation stays layout-independent (:mod:`megatron_s2.models.init`): :func:`tag_inits`
marks norms' weights 1 and biases 0; every matrix takes the family's normal(0, init_std) from
(seed, name). The parameters are unmarked by any parallel plan: whole, replicated, reduced over
the data-parallel group. Under tensor parallelism every tp rank holds the same replica and,
with sequence parallelism too, gets the same gradient (:func:`merge_series`); under pipeline
parallelism the first stage owns it (:mod:`.replica`). Layouts:
:func:`megatron_s2.training.run_checks.check_series_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import nn

from megatron_s2.models.init import constant_init
from megatron_s2.models.timeseries.encoder import (SeriesInput, TimeSeriesEncoder, TimeSeriesEncoderConfig,
                                                   TimeSeriesEncoding)
from megatron_s2.models.timeseries.insertion import SeriesPlacement, merge_series_embeddings
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.mappings import copy_to_group

__all__ = ["EncodedSeries", "build_series_encoder", "encoder_config", "encode_series", "merge_series", "tag_inits"]


@dataclass
class EncodedSeries:
    """The series of one micro-batch after one encoder call."""

    placements: list
    """Per row, its :class:`SeriesPlacement` list (row order, then span order)."""
    encoding: TimeSeriesEncoding | None
    """The encoder's output over the flattened placements; None when the micro-batch has no series."""


def encoder_config(model_cfg) -> TimeSeriesEncoderConfig:
    """The encoder's shape from ``model.timeseries`` and the backbone width."""
    ts = model_cfg.timeseries
    return TimeSeriesEncoderConfig(
        output_hidden=model_cfg.hidden_size, hidden=ts.hidden, heads=ts.heads, token_budget=ts.token_budget,
        queries_per_patch=ts.queries_per_patch, patches_per_chunk=ts.patches_per_chunk,
        chunk_samples=ts.chunk_samples, min_patch_length=ts.min_patch_length, cnn_kernel=ts.cnn_kernel,
        max_channels=ts.max_channels, channel_layers=ts.channel_layers, temporal_layers=ts.temporal_layers)


def tag_inits(module: nn.Module) -> nn.Module:
    """Norm weights start at 1 and biases at 0 (the family's initialiser draws the rest)."""
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.init_fn = constant_init(0.0)
    for sub in module.modules():
        if isinstance(sub, nn.LayerNorm):
            sub.weight.init_fn = constant_init(1.0)
    return module


def build_series_encoder(model_cfg) -> TimeSeriesEncoder | None:
    """The encoder of a model with ``model.timeseries`` (None without)."""
    if getattr(model_cfg, "timeseries", None) is None:
        return None
    return tag_inits(TimeSeriesEncoder(encoder_config(model_cfg)))


def _on(placement: SeriesPlacement, device: torch.device) -> SeriesPlacement:
    values = placement.series.values
    if values.device == device:
        return placement
    return SeriesPlacement(placement.start, SeriesInput(values.to(device), placement.series.sample_rate))


def encode_series(encoder: TimeSeriesEncoder | None, placements: Sequence[Sequence[SeriesPlacement] | None]
                  ) -> EncodedSeries:
    """Encode every series of a micro-batch in one call (mixed lengths, rates, channel counts)."""
    if isinstance(placements, EncodedSeries):
        return placements
    rows = [list(row or ()) for row in placements]
    flat = [place for row in rows for place in row]
    if not flat:
        return EncodedSeries(rows, None)
    if encoder is None:
        raise ValueError("series given, but this model has no time-series encoder (set model.timeseries)")
    device = encoder.rate.weight.device
    rows = [[_on(place, device) for place in row] for row in rows]
    return EncodedSeries(rows, encoder([place.series for row in rows for place in row]))


def merge_series(h: torch.Tensor, series, encoder: TimeSeriesEncoder | None, sp_group: Group | None = None
                 ) -> torch.Tensor:
    """Embeddings [b, s, d] with every series span overwritten by its tokens (``series``: raw
    placements or an :class:`EncodedSeries`).

    ``sp_group``: the tensor-parallel group under sequence parallelism, where ``h`` [b, s / tp, d]
    is this rank's contiguous slice of the sequence: only the span rows inside it are written, and
    the tokens enter through :func:`~megatron_s2.parallel.mappings.copy_to_group`, whose backward
    sums the slices' gradients over tp — the encoder then sees the whole spans' gradient on every
    tp rank, identical replicas like the rest of its placement (never a tp-partial sum)."""
    encoded = encode_series(encoder, series)
    encoding = encoded.encoding
    if encoding is None:
        return h
    window = None
    if sp_group is not None and sp_group.active:
        encoding = replace(encoding, tokens=copy_to_group(encoding.tokens, sp_group))
        window = (sp_group.rank * h.size(1), sp_group.size * h.size(1))
    merged, _ = merge_series_embeddings(h, encoded.placements, encoder, encoding=encoding, window=window)
    return merged
