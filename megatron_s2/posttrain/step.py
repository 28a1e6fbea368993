"""The post-training objective of one micro-batch, from model logits — the seam the trainer calls.

The trainer's forward produces this rank's vocabulary shard of the logits ``[b, s, V/tp]``
(with the batch's R3 replay in the family model's forward context);
:func:`micro_batch_objective` turns them and a :class:`~megatron_s2.posttrain.batch.PosttrainBatch`
into the scalar to backpropagate. :func:`global_normalisers` computes, once per global batch
and over the data-parallel group, the counts the aggregation divides by, so the sum of the
micro-batch objectives over micro-batches and ranks is the global objective whatever the
split (the same contract as :mod:`megatron_s2.pipeline.losses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.batch import PosttrainBatch
from megatron_s2.posttrain.losses.aggregation import aggregation_weights
from megatron_s2.posttrain.losses.objective import ObjectiveResult, PosttrainObjective
from megatron_s2.posttrain.losses.terms import LossInputs
from megatron_s2.posttrain.vocab_parallel import token_log_probs

__all__ = ["Normalisers", "global_normalisers", "micro_batch_objective"]


@dataclass(frozen=True)
class Normalisers:
    tokens: float
    """Loss tokens of the global batch."""
    sequences: float
    """Samples of the global batch."""


def global_normalisers(micro_batches: Sequence[PosttrainBatch], dp: Group) -> Normalisers:
    """Loss tokens and samples over every micro-batch of every data-parallel rank."""
    if not micro_batches:
        raise ValueError("global_normalisers: no micro-batches")
    local = torch.zeros(2, dtype=torch.float64, device=micro_batches[0].loss_mask.device)
    for mb in micro_batches:
        local[0] += mb.loss_mask.sum()
        local[1] += (mb.sequence_ids[:, 0] >= 0).sum()
    total = mappings.all_reduce_sum(local, dp)
    return Normalisers(float(total[0]), float(total[1]))


def micro_batch_objective(objective: PosttrainObjective, logits: torch.Tensor, batch: PosttrainBatch,
                          normalisers: Normalisers, *, tp: Group, current_version: int,
                          proximal_logprobs: torch.Tensor | None = None,
                          reference_logprobs: torch.Tensor | None = None,
                          teacher_logits: torch.Tensor | None = None,
                          advantages: torch.Tensor | None = None) -> ObjectiveResult:
    """This micro-batch's share of the global post-training objective.

    ``advantages`` overrides ``batch.advantages`` (OPD: Eq. 33 from teacher and proximal
    log-probabilities). Log-probabilities use ``objective.config.temperature``."""
    cfg = objective.config
    logprobs = token_log_probs(logits, batch.labels, tp, cfg.temperature)
    weights = aggregation_weights(batch.loss_mask, cfg.aggregation, global_tokens=normalisers.tokens,
                                  sequence_ids=batch.sequence_ids, global_sequences=normalisers.sequences,
                                  constant=cfg.aggregation_constant or None, sample_weights=batch.sample_weights)
    inputs = LossInputs(logprobs=logprobs, loss_mask=batch.loss_mask, weights=weights,
                        behaviour_logprobs=batch.behaviour_logprobs.to(logprobs.dtype),
                        advantages=(batch.advantages if advantages is None else advantages).to(logprobs.dtype),
                        versions=batch.versions, current_version=current_version,
                        proximal_logprobs=proximal_logprobs, reference_logprobs=reference_logprobs,
                        logits=logits, teacher_logits=teacher_logits, tp=tp)
    return objective(inputs)
