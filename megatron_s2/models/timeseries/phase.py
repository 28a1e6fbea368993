"""The series phases of a disaggregated encoder step (Intern-S2 report §2.2.1-2.2.2, run the way
V4.1 runs its vision encoder, report §3.1.1 "End-to-End Parallelism"; :mod:`megatron_s2.pipeline.encoder_phase`).

A training step of ``phase.kind: timeseries_forecast`` runs series forward -> LLM forward/backward
-> series backward::

    phase = SeriesPhase.forward(encoder, micro_batches, embeds=first_stage, forecasts=last_stage)
    result = schedule(model, inputs)   # the LLM phase, any tp / sp / pp layout, unchanged
    phase.backward()                   # the tokens' gradients through the encoder

Phase 1 encodes every micro-batch's series once and cuts the result from the encoder's graph
twice: ``mb["series"]`` becomes the :class:`EncodedSeries` the first stage's ``embed`` merges at
the placeholder spans, ``mb["series_forecast"]`` the one the last stage's forecaster is
conditioned on (its Q-Former reads the encoder's tokens and the retained mu / sigma). Each is a
leaf; phase 3 adds their gradients and runs the encoder's backward once. Under pipeline
parallelism the first stage holds only the embedding leaf and the last only the forecaster's
(its encoder is the stage replica of :mod:`.replica`); under sequence parallelism the embedding
leaf's gradient is already summed over tp (:func:`~megatron_s2.models.timeseries.attach.merge_series`),
so every tp rank back-propagates the same gradient into identical encoder replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megatron_s2.models.timeseries.attach import EncodedSeries, encode_series

__all__ = ["SeriesPhase"]


@dataclass
class _Encoded:
    graph: torch.Tensor
    """The encoder's tokens [S, N, d], in its graph."""
    leaves: list[torch.Tensor]
    """The detached copies the LLM phase consumed (embedding and / or forecaster)."""


@dataclass
class SeriesPhase:
    encoded: list[_Encoded] = field(default_factory=list)

    @classmethod
    def forward(cls, encoder, micro_batches: list[dict], *, embeds: bool, forecasts: bool) -> "SeriesPhase":
        """Phase 1 (in place): ``mb["series"]`` for the embedding (``embeds``: this rank holds the
        first stage) and ``mb["series_forecast"]`` for the forecaster (``forecasts``: the last)."""
        phase = cls()
        for mb in micro_batches:
            if not (embeds or forecasts) or mb.get("series") is None:
                continue
            encoded = encode_series(encoder, mb["series"])
            if encoded.encoding is None:  # no series in this micro-batch
                mb["series_forecast"] = encoded
                continue
            graph, leaves = encoded.encoding.tokens, []

            def cut() -> EncodedSeries:
                leaf = graph.detach().requires_grad_(graph.requires_grad)
                leaves.append(leaf)
                return EncodedSeries(encoded.placements, replace(encoded.encoding, tokens=leaf))

            if embeds:
                mb["series"] = cut()
            if forecasts:
                mb["series_forecast"] = cut()
            phase.encoded.append(_Encoded(graph, leaves))
        return phase

    def backward(self) -> None:
        """Phase 3: after the LLM backward, the leaves' summed gradient through the encoder."""
        for item in self.encoded:
            if not item.graph.requires_grad:  # a frozen encoder
                continue
            grads = [leaf.grad for leaf in item.leaves if leaf.grad is not None]
            grad = sum(grads[1:], grads[0]) if grads else torch.zeros_like(item.graph)
            torch.autograd.backward(item.graph, grad)
        self.encoded.clear()
