"""The step objectives (``StepInputs.loss_fn``) of the Memory Decoder's two phases.

:class:`MemoryDecoderObjective` (``phase.kind: memdec``, walkthrough Eq. 1-2): the frozen
backbone encodes the micro-batch, the datastore returns each position's kNN distribution, and
the memory decoder's logits (the step's forward) are fitted with beta KL + (1 - beta) CE.

:class:`RouterObjective` (``phase.kind: memdec_router``, Eq. 3-4): the frozen backbone and the
frozen memory (the step's forward gives its logits; its hidden state is read in a second,
gradient-free pass) feed the router; the fused distribution's cross-entropy plus the signed
prior on lambda (``mb["is_domain"]``) trains the router alone.

Both return ``(objective, summed)`` like the token cross-entropy: per-token losses normalised
by the global batch's loss-bearing token count (:func:`~megatron_s2.pipeline.losses.micro_batch_objective`).

Layouts: both run on the last pipeline stage, where the step's logits are. The memory decoder's
logits (this rank's vocabulary shard under tp) and its last hidden state (this rank's slice under
sequence parallelism) are gathered over tp (:mod:`megatron_s2.models.memory_decoder.whole`), and
the frozen backbone — every layer on each rank, tensor-parallel like the memory — is read whole
the same way, so every tp rank computes the one-rank objective and keeps its shard's gradient.
"""

from __future__ import annotations

import torch

from megatron_s2.models.memory_decoder import (Datastore, interpolated_log_probs, memory_decoder_token_loss,
                                               router_token_loss, whole_sequence, whole_vocabulary)
from megatron_s2.pipeline.losses import micro_batch_objective
from megatron_s2.posttrain.memdec.forward import hidden_and_log_probs, last_hidden

__all__ = ["MemoryDecoderObjective", "RouterObjective"]


def _masked_mean(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(value.dtype)
    return (value * mask).sum() / mask.sum().clamp_min(1.0)


def _add_metric(ctx, name: str, value: torch.Tensor) -> None:
    # per micro-batch means; the schedule averages them over the global batch's micro-batches
    ctx.aux_metrics[name] = value.detach()


class MemoryDecoderObjective:
    def __init__(self, backbone, datastore: Datastore, *, k: int, temperature: float, beta: float,
                 global_tokens: torch.Tensor, num_micro_global: int):
        self.backbone, self.datastore = backbone, datastore
        self.k, self.temperature, self.beta = k, temperature, beta
        self.global_tokens, self.num_micro_global = global_tokens, num_micro_global

    def __call__(self, model, logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx):
        logits = whole_vocabulary(logits, model.groups)  # every tp rank: the same loss, its shard's gradient
        with torch.no_grad():
            keys = last_hidden(self.backbone, mb)
            knn = self.datastore.distribution(keys, self.k, logits.size(-1), self.temperature)
        per_token, kl, ce = memory_decoder_token_loss(logits, knn, mb["labels"], beta=self.beta)
        objective, summed = micro_batch_objective(per_token, mb["loss_mask"], self.global_tokens, None,
                                                  self.num_micro_global)
        _add_metric(ctx, "memdec_kl", _masked_mean(kl, mb["loss_mask"]))
        _add_metric(ctx, "memdec_ce", _masked_mean(ce, mb["loss_mask"]))
        return objective, summed


class RouterObjective:
    def __init__(self, backbone, *, alpha: float, global_tokens: torch.Tensor, num_micro_global: int):
        self.backbone, self.alpha = backbone, alpha
        self.global_tokens, self.num_micro_global = global_tokens, num_micro_global

    def __call__(self, model, logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx):
        with torch.no_grad():
            h_base, logp_base = hidden_and_log_probs(self.backbone, mb)
            # the frozen memory's last hidden state from this forward (``model``: forward.KeepsLastHidden)
            h_mem = whole_sequence(model.final_hidden(*ctx.memdec_hidden), model.groups)
            logp_mem = torch.log_softmax(whole_vocabulary(logits, model.groups).float(), dim=-1)
        lam = model.memdec_router(h_base, h_mem, logp_base, logp_mem)
        fused = interpolated_log_probs(logp_base, logp_mem, lam)
        per_token, ce = router_token_loss(fused, mb["labels"], lam, mb["is_domain"], self.alpha)
        mask = mb["loss_mask"]
        objective, summed = micro_batch_objective(ce, mask, self.global_tokens, None, self.num_micro_global)
        # the prior's share rides on the objective only: the logged loss is the fused cross-entropy
        objective = objective + ((per_token - ce) * mask).sum() / self.global_tokens.squeeze()
        # each micro-batch is one corpus and they come 1:1 (trainer.MixedCorpusIterator), so twice a
        # micro-batch's mean is its share of the corpus's average over the global batch
        name = "memdec_lambda_domain" if bool(mb["is_domain"].any()) else "memdec_lambda_general"
        _add_metric(ctx, name, 2.0 * _masked_mean(lam, mask))
        return objective, summed
