"""How per-token losses become one number: explicit, layout-independent aggregation weights.

The recipe chooses (``loss.aggregation``):

* ``token_mean``: sum over every loss token of the global batch / number of loss tokens
  (long responses weigh in proportion to their length; walkthrough Eq. 29's 1/sum|y_i|).
* ``sequence_mean``: mean over sequences of each sequence's token mean (every response counts
  once, whatever its length — GRPO's original normalisation).
* ``fixed``: sum / a constant (Dr. GRPO-style, e.g. batch size x max tokens), unbiased in length.

The weights are computed once per global batch from the loss mask — *before* numerical masks
(BKL, staleness, ratio) — so the objective is a plain ``sum(weight * mask * loss)`` over
micro-batches and data-parallel ranks whose gradient does not depend on the split, like
:mod:`megatron_s2.pipeline.losses` does for cross-entropy. A token removed by a numerical
mask contributes zero without re-normalising the others.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Aggregation", "aggregation_weights"]

Aggregation = Literal["token_mean", "sequence_mean", "fixed"]


def aggregation_weights(loss_mask: torch.Tensor, mode: Aggregation, *, global_tokens: float | None = None,
                        sequence_ids: torch.Tensor | None = None, global_sequences: float | None = None,
                        sequence_tokens: torch.Tensor | None = None, constant: float | None = None,
                        sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights [b, s] so that the objective is ``sum(weights * token_loss)``.

    ``loss_mask`` [b, s]: policy tokens that bear loss. ``token_mean`` needs ``global_tokens``
    (loss tokens of the whole global batch); ``sequence_mean`` needs ``sequence_ids`` [b, s]
    (a non-negative id per sequence, -1 for padding), ``global_sequences`` and optionally
    ``sequence_tokens`` [num_ids] (loss tokens of each sequence when a sequence is split across
    ranks, e.g. under context parallelism; counted locally otherwise); ``fixed`` needs
    ``constant``. ``sample_weights`` [b, s] multiplies the result (OPD's lambda_d, Eq. 36).
    """
    mask = loss_mask.to(torch.float64)
    if mode == "token_mean":
        if not global_tokens or global_tokens <= 0:
            raise ValueError("token_mean aggregation needs the global number of loss tokens (> 0)")
        w = mask / float(global_tokens)
    elif mode == "sequence_mean":
        if sequence_ids is None or not global_sequences or global_sequences <= 0:
            raise ValueError("sequence_mean aggregation needs sequence_ids and the global number of sequences")
        ids = sequence_ids.long()
        valid = (ids >= 0) & loss_mask.bool()
        if sequence_tokens is None:
            size = max(int(ids.max()) + 1, 1) if ids.numel() else 1
            sequence_tokens = torch.bincount(ids[valid], minlength=size).to(torch.float64)
        counts = sequence_tokens.to(torch.float64)[ids.clamp_min(0)]
        w = torch.where(valid, 1.0 / (counts.clamp_min(1.0) * float(global_sequences)), torch.zeros_like(mask))
    elif mode == "fixed":
        if not constant or constant <= 0:
            raise ValueError("fixed aggregation needs a positive constant")
        w = mask / float(constant)
    else:
        raise ValueError(f"unknown aggregation '{mode}' (token_mean | sequence_mean | fixed)")
    if sample_weights is not None:
        w = w * sample_weights.to(torch.float64)
    return w
