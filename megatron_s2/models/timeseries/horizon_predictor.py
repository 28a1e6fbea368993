"""The learned horizon predictor (Intern-S2 report §2.2.2; walkthrough Ch. 1 "The forecaster,
written out": ``horizon = horizon_predictor(instruction_hidden)  # int, reported 99% accurate``).

A numerical branch has no end-of-sequence token, so a small module reads the instruction and
turns it into an integer before the forecaster runs. Ours reads the backbone's final hidden
states over the instruction's tokens (the prompt after the series span: "forecast the next two
seconds", "predict 96 steps ahead") and the series' sampling rate — "two seconds" is 2 x rate
steps — and classifies the horizon over ``1..max_horizon``::

    slots  = qformer(instruction_hidden + nothing else, queries + rate)   # (S, Q, D) attention pooling
    logits = mlp(flatten(slots) ++ rate_features)                          # (S, max_horizon)
    horizon = argmax(logits) + 1

The rate enters the pooling queries and sits beside the pooled slots as ``[log2(rate), 1]``
(``[0, 0]`` without a rate: time units then mean nothing), and the product with the rate is exact
by construction (a character-level tiny backbone learns to read "twenty-four" and "seconds"; it
need not learn a separate table per rate). Trained in ``phase.kind: timeseries_forecast`` by
negative log-likelihood of the true horizon (the data renders each instruction from it with
:func:`~megatron_s2.models.timeseries.horizon.render_instruction`), weighted by
``phase.horizon_lambda``. The closed-grammar :func:`~megatron_s2.models.timeseries.horizon.parse_horizon`
stays: the data renders with it, checkpoints without this module answer with it, and serving
reports it beside the learned horizon as a cross-check (the learned one decides, as in the report).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.timeseries.encoder import Block

__all__ = ["HorizonPredictor", "rate_features", "unit_map", "UNIT_SECONDS"]


def rate_features(rates: Sequence[float | None], device, dtype=torch.float32) -> torch.Tensor:
    """[S, 2] ``[log2(rate), 1]`` per series, ``[0, 0]`` for a series without a sampling rate."""
    rows = [[math.log2(r), 1.0] if r else [0.0, 0.0] for r in rates]
    return torch.tensor(rows, device=device, dtype=dtype)


UNIT_SECONDS = (None, 1.0, 60.0, 3600.0)
"""The units the predictor tells apart: steps (counted as is), seconds, minutes, hours (x the rate)."""


def unit_map(rates: Sequence[float | None], quantities: int, max_horizon: int, device) -> torch.Tensor:
    """[S, U * quantities, max_horizon] 0/1: (unit u, quantity q) -> the horizon it means at each
    series' rate (q x seconds(u) x rate steps; none when that is not a whole 1..max_horizon, or
    the series has no rate and u is a time unit)."""
    out = torch.zeros(len(rates), len(UNIT_SECONDS) * quantities, max_horizon, device=device)
    for s, rate in enumerate(rates):
        for u, seconds in enumerate(UNIT_SECONDS):
            if seconds is not None and not rate:
                continue
            for q in range(1, quantities + 1):
                steps = q if seconds is None else q * seconds * rate
                if 1 <= steps <= max_horizon and abs(steps - round(steps)) < 1e-6:
                    out[s, u * quantities + q - 1, int(round(steps)) - 1] = 1.0
    return out


class HorizonPredictor(nn.Module):
    """Instruction hidden states [S, P, d_in] (``mask`` [S, P]) and rates -> horizon log-probabilities
    [S, max_horizon] (class ``k`` is ``k + 1`` steps).

    Factorised as the instruction says it: a quantity (1..max_horizon) and a unit (steps, seconds,
    minutes, hours), ``P(h) = sum over (u, q) meaning h at this rate of P(u) P(q)`` — the rate's
    product is exact by construction, so the module learns to read the number and the unit, not a
    table per rate. A self-attention block over the instruction's hidden states, then attention
    pooling with learned rate-aware queries, feeds both heads."""

    def __init__(self, d_in: int, hidden: int, heads: int, max_horizon: int, queries: int = 4):
        super().__init__()
        self.max_horizon = max_horizon
        self.proj = nn.Linear(d_in, hidden)
        self.read = Block(hidden, heads)                  # the instruction's positions read each other
        self.queries = nn.Parameter(torch.randn(queries, hidden) * hidden ** -0.5)
        self.rate_in = nn.Linear(2, hidden)
        self.pool = Block(hidden, heads, cross=True)   # attention pooling with learned, rate-aware queries
        self.norm = nn.LayerNorm(queries * hidden)
        width = queries * hidden + 2
        self.quantity = nn.Sequential(nn.Linear(width, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, max_horizon))
        self.unit = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, len(UNIT_SECONDS)))

    def forward(self, instruction_hidden: torch.Tensor, mask: torch.Tensor, rates: Sequence[float | None]
                ) -> torch.Tensor:
        context = self.proj(instruction_hidden.to(self.proj.weight.dtype))
        features = rate_features(rates, context.device, context.dtype)
        context = self.read(context, None, mask)
        queries = self.queries[None] + self.rate_in(features)[:, None]          # [S, Q, D]
        slots = self.pool(queries, context, mask).flatten(1)                     # [S, Q * D]
        pooled = torch.cat([self.norm(slots), features], dim=-1)
        joint = (self.unit(pooled).float().log_softmax(-1)[:, :, None]
                 + self.quantity(pooled).float().log_softmax(-1)[:, None, :]).flatten(1)   # [S, U * Q]
        means = unit_map(rates, self.max_horizon, self.max_horizon, joint.device)
        # log P(h) = logsumexp over the (unit, quantity) pairs that mean h; -inf where none does
        return (joint[:, :, None] + means.log()).logsumexp(1).clamp(min=-1e4)

    def loss(self, log_probs: torch.Tensor, horizons: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(negative log-likelihood, accuracy) of ``log_probs`` [S, max_horizon] against true
        ``horizons`` [S] (steps)."""
        target = horizons.clamp(1, self.max_horizon) - 1
        loss = F.nll_loss(log_probs, target)
        accuracy = (log_probs.argmax(-1) == target).float().mean()
        return loss, accuracy.detach()

    @staticmethod
    def decide(log_probs: torch.Tensor) -> list[int]:
        """The predicted horizon (steps) of each series."""
        return [int(k) + 1 for k in log_probs.argmax(-1).tolist()]
