"""One whole-model forward that returns what the Memory Decoder reads of a family model: the
normalised last hidden state (datastore keys, router features) and the log-probabilities."""

from __future__ import annotations

import torch

__all__ = ["hidden_and_log_probs"]


def hidden_and_log_probs(model, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [b, s, d] float32, log p [b, s, V] float32) of ``model`` on ``micro_batch`` (``tokens`` and
    optionally ``position_ids`` / ``doc_ids``), in a fresh forward context. One rank holds the
    whole vocabulary (the Memory Decoder's phases run with tp = 1)."""
    ctx = model.make_context(micro_batch)
    hidden = model.run_layers(model.embed(micro_batch["tokens"]), ctx)
    return model.final_hidden(*hidden).float(), torch.log_softmax(model.head(*hidden).float(), dim=-1)
