"""The DSpark drafter's training objective in a training step (V4.1 report §2.4.3).

Used as the step's ``loss_fn`` (:class:`~megatron_s2.pipeline.step.StepInputs`) when a phase
trains the drafter:

* ``phase.kind: dspark`` — the stage after pre-training: only the drafter trains (the backbone
  is frozen, holds no optimiser state), on the backbone's own hidden states and distributions;
* ``phase.train_drafter`` (pretrain / sft) — co-training: the language-model loss trains the
  backbone and the drafter's loss trains the drafter, and no gradient of the drafter's loss
  reaches the backbone (the drafter reads detached hidden states, embedding and head weights,
  and the policy's detached logits);
* ``phase.train_drafter`` (rl / opd) — the online draft update of the Intern-S2 walkthrough (Ch.
  4, Eq. 21–24): every training step also fits the drafter to the current policy's
  distributions at the rollout states just collected, at the rollout temperature, with the
  gradient stopped through the policy — so the drafter chases the policy and keeps rollouts
  fast while the policy never feels it.

The drafter objective is the hybrid LK loss (:mod:`.draft_loss`, Intern-S2 walkthrough Eq.
22–24): per draft position k, lambda_k KL(p || q) + (1 - lambda_k) TV(p, q) with
lambda_k = exp(-eta * acceptance_k) measured on the micro-batch, where p is the frozen/current
policy's distribution at the position and q the drafter's (both at ``drafter_temperature``),
plus the confidence head's cross-entropy against the realised acceptance probability
sum_x min(p, q) of each position (§2.4.3: "a confidence head predicts per-position conditional
acceptance probabilities"). Both are means over the micro-batch's valid (anchor, position)
pairs and count as one micro-batch's share of the global mean, as the auxiliary losses do.

Under context parallelism each CP rank drafts from the anchors of its own chunks
(:meth:`~megatron_s2.models.v41.model.V41Model.dspark_teacher_forced`) and adds its share of
the micro-batch's means (the counts all-reduced over CP, :mod:`.draft_loss`), so the shares sum
to the one-rank loss, and the gradients summed over dp x cp are the one-rank gradients; the
drafter MoEs' balance loss (a mean over draft blocks) is weighed by the rank's share of the
blocks, and each rank logs its share of the acceptance rates, so the logged metrics are the
one-rank ones.
"""

from __future__ import annotations

import torch

from megatron_s2.parallel import mappings
from megatron_s2.pipeline.losses import micro_batch_objective
from megatron_s2.training.draft_loss import confidence_loss, hybrid_lk_loss, position_overlap

__all__ = ["DraftObjective"]


class DraftObjective:
    def __init__(self, global_tokens: torch.Tensor, num_micro_global: int, *, language_model: bool,
                 eta: float, temperature: float, primary=None):
        """``primary``: the phase's own ``loss_fn`` (RL / OPD: the online draft update rides on the
        policy's training forward over the rollouts just collected, walkthrough Ch. 4), else the
        token cross-entropy when ``language_model``, else none (the DSpark stage)."""
        self.global_tokens, self.num_micro_global = global_tokens, num_micro_global
        self.language_model, self.eta, self.temperature = language_model, eta, temperature
        self.primary = primary

    def __call__(self, model, logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx):
        objective = logits.new_zeros(())
        summed = logits.new_zeros(())
        if self.primary is not None:
            objective, summed = self.primary(model, logits, mb, ctx)
        elif self.language_model:  # the backbone's own loss, as without a drafter
            objective, summed = micro_batch_objective(model.loss(logits, mb["labels"]), mb["loss_mask"],
                                                      self.global_tokens, None, self.num_micro_global)
        tf, policy = model.dspark_teacher_forced(logits, mb, ctx)
        cp = model.groups.cp
        group = cp if cp.active else None
        k = tf.logits.size(-2)
        valid = tf.valid
        if self.primary is not None:  # rollouts: the states where the policy sampled (its loss-bearing rows)
            loss_mask = mb.get("full_loss_mask", mb["loss_mask"])  # target rows may lie in another rank's chunk
            valid = valid & (loss_mask[:, tf.target_rows] > 0)
        draft, target, mask = tf.logits.flatten(0, 1), policy.flatten(0, 1), valid.flatten(0, 1)
        lk, metrics = hybrid_lk_loss(target, draft, mask, temperature=self.temperature, eta=self.eta, group=group)
        overlap = position_overlap(target, draft, temperature=self.temperature)
        conf = confidence_loss(tf.confidence.flatten(0, 1), overlap, mask, group=group)
        balance = 0.0 if tf.aux_loss is None else self._balance_share(tf.aux_loss, mask.size(0), group)
        drafter = lk + conf + balance
        objective = objective + drafter / self.num_micro_global
        if not self.language_model and self.primary is None:  # the logged loss of the stage is the drafter's
            summed = (lk + conf).detach() * self.global_tokens.squeeze() / self.num_micro_global
        ctx.add_metric("draft_lk", lk)
        ctx.add_metric("draft_confidence", conf)
        for i in range(k):  # the same whole-micro-batch rate on every CP rank: each logs its share
            ctx.add_metric(f"draft_accept_{i + 1}", metrics["acceptance"][i] / cp.size)
        return objective, summed

    @staticmethod
    def _balance_share(aux: torch.Tensor, blocks: int, group) -> torch.Tensor:
        """The drafter MoEs' balance loss, a mean over this rank's draft blocks -> its share of the
        mean over the micro-batch's blocks (itself without context parallelism)."""
        if group is None:
            return aux
        here = torch.tensor([float(blocks)], device=aux.device)
        return aux * (here / mappings.all_reduce_sum(here, group)).squeeze()
