"""What the Memory Decoder's phases read of a family model.

:func:`hidden_and_log_probs` — one whole-model forward returning the normalised last hidden state
(datastore keys, router features) and the log-probabilities, whole on every tp rank: the inference
side's function (:func:`megatron_s2.inference.memory_decoder.hidden_and_log_probs`), so the
datastore, the training objectives and the served mix read the same states. The frozen backbone
is read with it (it holds every layer on each rank, :func:`~megatron_s2.posttrain.frozen.load_frozen_model`).
:func:`last_hidden` — the same forward without the head, for what reads only the hidden state (the
datastore's keys, the kNN queries of ``phase.kind: memdec``): no [b, s, V] log-probabilities, which
at a 248K vocabulary are 1 GiB per 1K tokens.

:class:`KeepsLastHidden` — the memory decoder as the schedules call it (``model(tokens, ctx)``
without pipelining, ``embed`` / ``run_layers`` / ``head`` stage by stage with it), keeping each
``run_layers`` output on ``ctx.memdec_hidden``: on the last stage that is the memory's last hidden
state, which the router objective reads beside the logits — no second pass of the memory, which
under pipeline parallelism the last stage could not run.
"""

from __future__ import annotations

import torch

from megatron_s2.inference.memory_decoder import hidden_and_log_probs
from megatron_s2.models.family.stage_output import KeepsStageOutput
from megatron_s2.models.memory_decoder import whole_sequence

__all__ = ["hidden_and_log_probs", "last_hidden", "KeepsLastHidden"]


def last_hidden(model, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """h [b, s, d] float32 of :func:`hidden_and_log_probs` (the same states), without the head."""
    ctx = model.make_context(micro_batch)
    hidden = model.run_layers(model.embed(micro_batch["tokens"]), ctx)
    return whole_sequence(model.final_hidden(*hidden), model.groups).float()


class KeepsLastHidden(KeepsStageOutput):
    """A family model whose ``run_layers`` output stays on ``ctx.memdec_hidden`` (module docstring)."""

    attr = "memdec_hidden"
