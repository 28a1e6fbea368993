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

The rate enters twice (added to the pooling queries and beside the pooled slots) as
``[log2(rate), 1]`` (``[0, 0]`` without a rate). Trained in ``phase.kind: timeseries_forecast`` by
cross-entropy against the true horizon (the data renders each instruction from it with
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

__all__ = ["HorizonPredictor", "rate_features"]


def rate_features(rates: Sequence[float | None], device, dtype=torch.float32) -> torch.Tensor:
    """[S, 2] ``[log2(rate), 1]`` per series, ``[0, 0]`` for a series without a sampling rate."""
    rows = [[math.log2(r), 1.0] if r else [0.0, 0.0] for r in rates]
    return torch.tensor(rows, device=device, dtype=dtype)


class HorizonPredictor(nn.Module):
    """Instruction hidden states [S, P, d_in] (``mask`` [S, P]) and rates -> horizon logits [S, max_horizon]
    (class ``k`` is ``k + 1`` steps)."""

    def __init__(self, d_in: int, hidden: int, heads: int, max_horizon: int, queries: int = 4):
        super().__init__()
        self.max_horizon = max_horizon
        self.proj = nn.Linear(d_in, hidden)
        self.queries = nn.Parameter(torch.randn(queries, hidden) * hidden ** -0.5)
        self.rate_in = nn.Linear(2, hidden)
        self.pool = Block(hidden, heads, cross=True)   # attention pooling with learned, rate-aware queries
        self.norm = nn.LayerNorm(queries * hidden)
        self.head = nn.Sequential(nn.Linear(queries * hidden + 2, 4 * hidden), nn.GELU(),
                                  nn.Linear(4 * hidden, max_horizon))

    def forward(self, instruction_hidden: torch.Tensor, mask: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        context = self.proj(instruction_hidden.to(self.proj.weight.dtype))
        rates = rates.to(context.dtype)
        queries = self.queries[None] + self.rate_in(rates)[:, None]            # [S, Q, D]
        slots = self.pool(queries, context, mask).flatten(1)                     # [S, Q * D]
        return self.head(torch.cat([self.norm(slots), rates], dim=-1))

    def loss(self, logits: torch.Tensor, horizons: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, accuracy) of ``logits`` [S, max_horizon] against true ``horizons`` [S] (steps)."""
        target = horizons.clamp(1, self.max_horizon) - 1
        loss = F.cross_entropy(logits.float(), target)
        accuracy = (logits.argmax(-1) == target).float().mean()
        return loss, accuracy.detach()

    @staticmethod
    def decide(logits: torch.Tensor) -> list[int]:
        """The predicted horizon (steps) of each series."""
        return [int(k) + 1 for k in logits.argmax(-1).tolist()]
