"""One forward of a family model with the forecasting branch, for training and for answering
(Intern-S2 report §2.2.2): the backbone reads the prompt with the series inserted, the branch
reads the backbone's last hidden state over the prompt and the encoder's tokens.

:func:`forecast_inputs` gathers, for every placed series of a micro-batch, the LLM context
(its row's final hidden state between the document's first token and the last prompt token),
the encoder's tokens and the forecaster rows; :func:`forecast_loss` is the training loss and
:func:`forecast` the de-normalised numbers a request gets back.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_s2.models.timeseries.attach import EncodedSeries, encode_series
from megatron_s2.models.timeseries.forecaster import ForecastBranch, ForecastRows
from megatron_s2.parallel.mappings import gather_sequence

__all__ = ["forecast_inputs", "forecast_loss", "forecast", "full_final_hidden", "prompt_hidden"]


def prompt_hidden(model, tokens: torch.Tensor, ctx, series) -> tuple[tuple, EncodedSeries, torch.Tensor]:
    """(hidden state, the micro-batch's EncodedSeries, final hidden [b, s, d]) of one forward."""
    encoded = encode_series(model.timeseries, series)
    hidden = model.run_layers(model.embed(tokens, series=encoded), ctx)
    return hidden, encoded, model.final_hidden(*hidden)


def full_final_hidden(model, hidden: tuple) -> torch.Tensor:
    """The final hidden state [b, s, d] of the whole sequence from the last stage's ``run_layers``
    output. Under sequence parallelism each tp rank holds a slice: gathered, with the gradient
    split back (the forecaster is replicated over tp, so each rank's gradient of the whole is
    already the full one — a reduce-scatter would count it tp times)."""
    final = model.final_hidden(*hidden)
    groups = model.groups
    return gather_sequence(final, groups.tp, dim=1) if groups.sequence.sp else final


def forecast_inputs(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries,
                    spans: Sequence[Sequence[tuple[int, int]]]) -> tuple[torch.Tensor, ForecastRows]:
    """(cond [S, 2Q, D], rows) of the S series of ``encoded``; ``spans[i]``: (first, last) row
    positions of the LLM context of each series of row ``i`` (row order, then span order)."""
    rows_of, masks = [], []
    positions = torch.arange(final_hidden.size(1), device=final_hidden.device)
    for row, row_spans in enumerate(spans):
        for first, last in row_spans:
            rows_of.append(row)
            masks.append((positions >= first) & (positions <= last))
    encoding = encoded.encoding
    llm = final_hidden[torch.tensor(rows_of, device=final_hidden.device)]
    cond = branch.condition(llm, torch.stack(masks), encoding.tokens, encoding.token_mask)
    values = [place.series.values for row in encoded.placements for place in row]
    rows = ForecastRows.build(values, encoding.mu, encoding.sigma, branch.context, branch.eps)
    return cond, rows


def _future_rows(futures: list[torch.Tensor], rows: ForecastRows, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised futures [R, H_max] (the encoder's mu / sigma of each row) and their validity."""
    longest = max(f.shape[1] for f in futures)
    flat = torch.cat([torch.nn.functional.pad(f, (0, longest - f.shape[1])) for f in futures])
    valid = torch.cat([(torch.arange(longest, device=f.device) < f.shape[1]).expand(f.shape[0], -1) for f in futures])
    normalised = (flat.to(rows.mu.dtype) - rows.mu[:, None]) / (rows.sigma[:, None] + eps)
    return normalised, valid


def forecast_loss(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries, targets: list
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean absolute error of the teacher-forced forecasts in the normalised space, the same on
    the original scale) over every future value of the micro-batch's series (``targets``: per
    row, the data's ``SeriesTarget`` list, aligned with the placements)."""
    spans = [[(t.context_start, t.prompt_end) for t in row] for row in targets]
    cond, rows = forecast_inputs(branch, final_hidden, encoded, spans)
    device = rows.mu.device
    futures = [torch.as_tensor(t.future, device=device) for row in targets for t in row]
    future, valid = _future_rows(futures, rows, branch.eps)
    predicted = branch.teacher_forced(cond, rows, future)
    error = (predicted - future).abs()
    loss = error[valid].mean()
    scale = (rows.sigma[:, None] + branch.eps).expand_as(error)
    return loss, (error * scale)[valid].mean().detach()


@torch.no_grad()
def forecast(model, tokens: torch.Tensor, series, spans: Sequence[Sequence[tuple[int, int]]],
             horizons: Sequence[int]) -> list[torch.Tensor]:
    """Real-valued forecasts [C_k, horizon_k] of every placed series of ``tokens`` [b, s]
    (``series``: per row, its placements; ``spans``: the LLM context of each, as in
    :func:`forecast_inputs`; ``horizons``: from the horizon predictor, one per series)."""
    ctx = model.make_context({"tokens": tokens})
    _, encoded, final = prompt_hidden(model, tokens, ctx, series)
    branch = model.forecaster
    cond, rows = forecast_inputs(branch, final, encoded, spans)
    normalised = branch.generate(cond, rows, max(horizons))
    values = branch.denormalise(normalised, rows)
    out = []
    for k, horizon in enumerate(horizons):
        out.append(values[rows.series == k, :horizon])
    return out
