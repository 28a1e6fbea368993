"""The time-series lane in the inference engine (Intern-S2 report §2.2.1-§2.2.2; walkthrough
§2.2.2 "through the engine and serve"), family-neutral like :mod:`.attach`.

A request's series take the place of images' spans: each placeholder id of the prompt
(``model.timeseries.placeholder_id``) is expanded by :func:`prepare_series` into the
``plan_patching(T, ...).num_tokens`` positions its series occupies, and the request carries one
:class:`SeriesSpan` per series. The executor of either family encodes all of a request's series
in **one** encoder call (the whole-sequence forward's ``embed(ids, series=[...])`` does the same
for that row, so the tokens are bit-identical), the first time a chunk reaches a span, and
overwrites the span's positions in every chunk that covers them (:func:`series_rows`). A cache
key over positions covers each series' content digest, never its placeholder ids (the V4.1 prefix
cache: two requests with different series never share a page).

:func:`forecast_from_hidden` is the numerical answer (§2.2.2): the forecasting branch over the
prompt's final hidden states and the same encoding — what :func:`.predict.forecast` computes out of
the engine from a whole-sequence forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megatron_s2.models.timeseries.attach import EncodedSeries, encode_series
from megatron_s2.models.timeseries.encoder import SeriesInput, TimeSeriesEncoding
from megatron_s2.models.timeseries.insertion import SeriesPlacement
from megatron_s2.models.timeseries.patching import plan_patching

__all__ = ["SeriesSpan", "series_key", "prepare_series", "series_rows", "forecast_from_hidden"]


@dataclass(eq=False)
class SeriesSpan:
    """One series of a request: the positions it occupies in ``request.tokens`` and its content."""

    start: int
    length: int
    """``plan_patching(T, ...).num_tokens`` positions."""
    key: bytes
    """Digest of the values and the sample rate (what cache keys over the span are made of)."""
    data: SeriesInput
    embeddings: torch.Tensor | None = None
    """[length, hidden] the span's tokens, computed once per request (:func:`series_rows`)."""
    encoding: TimeSeriesEncoding | None = None
    """The encoder's output over all the request's series (shared by its spans; the forecaster's mu / sigma)."""

    @property
    def end(self) -> int:
        return self.start + self.length


def series_key(series: SeriesInput) -> bytes:
    """Content digest of a series (dtype, shape, bytes, rate)."""
    from megatron_s2.models.family.engine import image_key

    return image_key(series.values, series.sample_rate)


def span_length(model_cfg, steps: int) -> int:
    ts = model_cfg.timeseries
    return plan_patching(steps, ts.token_budget, ts.queries_per_patch, patches_per_chunk=ts.patches_per_chunk,
                         min_patch_length=ts.min_patch_length, max_chunk_samples=ts.chunk_samples).num_tokens


def prepare_series(model_cfg, prompt: list[int], series: Sequence[Any]) -> tuple[list[int], list[SeriesSpan]]:
    """``prompt`` with each series placeholder expanded to its series' span, and the spans.
    ``series``: :class:`SeriesInput` (one per placeholder, in order), or :class:`SeriesSpan` whose
    positions ``prompt`` already holds. ValueError (one line) when the model has no time-series
    lane or the placeholders and series do not match."""
    ts = getattr(model_cfg, "timeseries", None)
    if ts is None:
        raise ValueError("series given, but this model has no time-series lane (model.timeseries is not set)")
    token = ts.placeholder_id(model_cfg.vocab_size)
    series = list(series)
    if all(isinstance(s, SeriesSpan) for s in series):
        for span in series:
            if span.start < 0 or span.end > len(prompt) or any(t != token for t in prompt[span.start:span.end]):
                raise ValueError(f"series at position {span.start}: the prompt does not hold its span of "
                                 f"{span.length} placeholder tokens ({token}) there")
        return list(prompt), series
    if not all(isinstance(s, SeriesInput) for s in series):
        raise ValueError("series: give SeriesInputs (one per placeholder) or prepared SeriesSpans, not a mix")
    found = [i for i, t in enumerate(prompt) if t == token]
    if len(found) != len(series):
        raise ValueError(f"series: the prompt has {len(found)} series placeholders ({token}) but {len(series)} series")
    out, spans, last = [], [], 0
    for at, s in zip(found, series):
        if s.values.dim() != 2 or s.values.numel() == 0:
            raise ValueError(f"series: a series is a non-empty [channels, steps] tensor, got {tuple(s.values.shape)}")
        if s.values.size(0) > ts.max_channels:
            raise ValueError(f"series: {s.values.size(0)} channels, above this model's model.timeseries.max_channels "
                             f"({ts.max_channels})")
        out += prompt[last:at]
        n = span_length(model_cfg, s.values.size(1))
        spans.append(SeriesSpan(len(out), n, series_key(s), s))
        out += [token] * n
        last = at + 1
    return out + prompt[last:], spans


def _encode(encoder, spans: list[SeriesSpan]) -> None:
    """All of a request's series in one encoder call (as the whole-sequence forward encodes a row)."""
    with torch.no_grad():
        encoded = encode_series(encoder, [[SeriesPlacement(s.start, s.data) for s in spans]])
    encoding = encoded.encoding
    for k, span in enumerate(spans):
        count = encoding.plans[k].num_tokens
        if count != span.length:
            raise ValueError(f"series at position {span.start}: the encoder plans {count} tokens, the span holds "
                             f"{span.length}")
        span.embeddings, span.encoding = encoding.tokens[k, :count], encoding


def series_rows(encoder, spans: list[SeriesSpan], start: int, length: int, dtype: torch.dtype
                ) -> list[tuple[int, torch.Tensor]]:
    """(offset in the chunk, span rows in ``dtype``) of the series positions in ``[start, start +
    length)``; the request's series are encoded once, on first use."""
    out = []
    for span in spans:
        lo, hi = max(start, span.start), min(start + length, span.end)
        if lo >= hi:
            continue
        if span.embeddings is None:
            _encode(encoder, spans)
        out.append((lo - start, span.embeddings[lo - span.start:hi - span.start].to(dtype)))
    return out


@torch.no_grad()
def forecast_from_hidden(branch, final_hidden: torch.Tensor, spans: list[SeriesSpan], encoder,
                         horizons: Sequence[int | None], context: tuple[int, int]) -> list[torch.Tensor]:
    """Real-valued forecasts [C_k, horizon_k] of each series of one request from its prompt's final
    hidden states ``final_hidden`` [P, D] (``context``: first and last prompt position the LLM
    context covers, as :func:`.predict.forecast_inputs` takes them; ``horizons``: None for the learned
    predictor's, the horizon answered is each result's length)."""
    from megatron_s2.models.timeseries.predict import forecast_inputs, learned_horizons

    if spans[0].encoding is None:
        _encode(encoder, spans)
    encoded = EncodedSeries([[SeriesPlacement(s.start, s.data) for s in spans]], spans[0].encoding)
    final, spans_of_row = final_hidden.unsqueeze(0), [[context] * len(spans)]
    horizons = learned_horizons(branch, final, encoded, spans_of_row, horizons)
    cond, rows = forecast_inputs(branch, final, encoded, spans_of_row)
    values = branch.denormalise(branch.generate(cond, rows, max(horizons)), rows)
    return [values[rows.series == k, :horizon] for k, horizon in enumerate(horizons)]
