"""A family model as the schedules call it, keeping each stage's last hidden state on the forward
context for a loss that reads it beside the logits (the forecaster of walkthrough §2.2.2, the
Memory Decoder's router of Ch. 2, Eq. 3-4).

Without pipelining the schedules call ``model(tokens, ctx, labels=...)``; under pipelining they call
``embed`` / ``run_layers`` / ``head`` stage by stage. Either way every ``run_layers`` output lands on
``ctx.<attr>``, so on the last stage the objective reads the backbone's last hidden state from the
training forward itself — no second pass, which the last pipeline stage could not run.
"""

from __future__ import annotations

import torch

__all__ = ["KeepsStageOutput"]


class KeepsStageOutput:
    """Wraps a family model; ``attr`` names the forward-context field the hidden state goes to.
    Keyword arguments of a call (e.g. ``series=``) go to ``embed``."""

    attr: str

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # embed, head, make_context, prepare_step, loss, ...
        return getattr(self.model, name)

    def run_layers(self, hidden, ctx, layer_ids=None):
        hidden = self.model.run_layers(hidden, ctx, layer_ids=layer_ids)
        setattr(ctx, self.attr, hidden)
        return hidden

    def __call__(self, tokens: torch.Tensor, ctx, labels=None, **embed_inputs):
        logits = self.model.head(*self.run_layers(self.model.embed(tokens, **embed_inputs), ctx))
        return logits if labels is None else self.model.loss(logits, labels)
