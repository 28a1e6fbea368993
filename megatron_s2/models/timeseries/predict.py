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

__all__ = ["forecast_inputs", "horizon_logits", "horizon_loss", "learned_horizons", "forecast_loss", "forecast",
           "full_final_hidden", "prompt_hidden"]


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


def _llm_context(final_hidden: torch.Tensor, encoded: EncodedSeries, spans: Sequence[Sequence[tuple[int, int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LLM context [S, P, D], its mask [S, P], the instruction's mask [S, P]) of each series: the
    context between ``spans``' (first, last) positions; the instruction is that context less the
    row's series spans (what the horizon predictor reads)."""
    rows_of, masks, instruction = [], [], []
    positions = torch.arange(final_hidden.size(1), device=final_hidden.device)
    plans, k = encoded.encoding.plans, 0
    series_at = []
    for row in encoded.placements:   # the row's series positions (flattened order is row, then span)
        taken = torch.zeros_like(positions, dtype=torch.bool)
        for place in row:
            taken[place.start:place.start + plans[k].num_tokens] = True
            k += 1
        series_at.append(taken)
    for row, row_spans in enumerate(spans):
        for first, last in row_spans:
            rows_of.append(row)
            context = (positions >= first) & (positions <= last)
            masks.append(context)
            instruction.append(context & ~series_at[row])
    llm = final_hidden[torch.tensor(rows_of, device=final_hidden.device)]
    return llm, torch.stack(masks), torch.stack(instruction)


def forecast_inputs(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries,
                    spans: Sequence[Sequence[tuple[int, int]]]) -> tuple[torch.Tensor, ForecastRows]:
    """(cond [S, 2Q, D], rows) of the S series of ``encoded``; ``spans[i]``: (first, last) row
    positions of the LLM context of each series of row ``i`` (row order, then span order)."""
    llm, mask, _ = _llm_context(final_hidden, encoded, spans)
    encoding = encoded.encoding
    cond = branch.condition(llm, mask, encoding.tokens, encoding.token_mask)
    values = [place.series.values for row in encoded.placements for place in row]
    rows = ForecastRows.build(values, encoding.mu, encoding.sigma, branch.context, branch.eps)
    return cond, rows


def horizon_logits(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries,
                   spans: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """The learned horizon predictor's log-probabilities [S, max_horizon] of each series (its instruction's
    hidden states and its sampling rate); ``branch.horizon`` must exist."""
    llm, _, instruction = _llm_context(final_hidden, encoded, spans)
    rates = [place.series.sample_rate for row in encoded.placements for place in row]
    return branch.horizon(llm, instruction, rates)


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


def horizon_loss(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries, targets: list
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, accuracy) of the learned horizon predictor against each series' true horizon
    (the length of its known future, the horizon its instruction was rendered from)."""
    spans = [[(t.context_start, t.prompt_end) for t in row] for row in targets]
    logits = horizon_logits(branch, final_hidden, encoded, spans)
    truth = torch.tensor([t.future.shape[1] for row in targets for t in row], device=logits.device)
    return branch.horizon.loss(logits, truth)


def learned_horizons(branch: ForecastBranch, final_hidden: torch.Tensor, encoded: EncodedSeries,
                     spans: Sequence[Sequence[tuple[int, int]]], horizons: Sequence[int | None]) -> list[int]:
    """``horizons`` with every None replaced by the learned predictor's horizon (an int given is an
    override and kept); ValueError when one is None and the checkpoint has no predictor."""
    if all(h is not None for h in horizons):
        return list(horizons)
    if branch.horizon is None:
        raise ValueError("no horizon given and this checkpoint has no learned horizon predictor "
                         "(model.timeseries.horizon_predictor); read it from the instruction (parse_horizon)")
    learned = branch.horizon.decide(horizon_logits(branch, final_hidden, encoded, spans))
    return [h if h is not None else g for h, g in zip(horizons, learned)]


@torch.no_grad()
def forecast(model, tokens: torch.Tensor, series, spans: Sequence[Sequence[tuple[int, int]]],
             horizons: Sequence[int]) -> list[torch.Tensor]:
    """Real-valued forecasts [C_k, horizon_k] of every placed series of ``tokens`` [b, s]
    (``series``: per row, its placements; ``spans``: the LLM context of each, as in
    :func:`forecast_inputs`; ``horizons``: one per series, None for the learned predictor's; the
    horizon answered is each result's length)."""
    ctx = model.make_context({"tokens": tokens})
    _, encoded, final = prompt_hidden(model, tokens, ctx, series)
    branch = model.forecaster
    horizons = learned_horizons(branch, final, encoded, spans, horizons)
    cond, rows = forecast_inputs(branch, final, encoded, spans)
    normalised = branch.generate(cond, rows, max(horizons))
    values = branch.denormalise(normalised, rows)
    out = []
    for k, horizon in enumerate(horizons):
        out.append(values[rows.series == k, :horizon])
    return out
