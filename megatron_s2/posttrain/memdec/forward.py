"""What the Memory Decoder's phases read of a family model.

:func:`hidden_and_log_probs` — one whole-model forward returning the normalised last hidden state
(datastore keys, router features) and the log-probabilities, whole on every tp rank: the inference
side's function (:func:`megatron_s2.inference.memory_decoder.hidden_and_log_probs`), so the
datastore, the training objectives and the served mix read the same states. The frozen backbone
is read with it (it holds every layer on each rank, :func:`~megatron_s2.posttrain.frozen.load_frozen_model`).

:class:`KeepsLastHidden` — the memory decoder as the schedules call it (``model(tokens, ctx)``
without pipelining, ``embed`` / ``run_layers`` / ``head`` stage by stage with it), keeping each
``run_layers`` output on ``ctx.memdec_hidden``: on the last stage that is the memory's last hidden
state, which the router objective reads beside the logits — no second pass of the memory, which
under pipeline parallelism the last stage could not run.
"""

from __future__ import annotations

from megatron_s2.inference.memory_decoder import hidden_and_log_probs
from megatron_s2.models.family.stage_output import KeepsStageOutput

__all__ = ["hidden_and_log_probs", "KeepsLastHidden"]


class KeepsLastHidden(KeepsStageOutput):
    """A family model whose ``run_layers`` output stays on ``ctx.memdec_hidden`` (module docstring)."""

    attr = "memdec_hidden"
