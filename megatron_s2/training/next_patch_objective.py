"""Visual next-patch pre-training: the contrastive objective (Intern-S2 walkthrough Ch. 3, Eq. 7–9).

The predictions ``u_hat_{t+1}`` of :mod:`megatron_s2.models.next_patch` (Eq. 5–6) are scored
contrastively, not by regression:

* **Eq. (7)** ``s_tj = cos(u_hat_{t+1}, u_{j+1}) / tau`` — the cosine similarity between the
  prediction at position ``t`` and the true latent at position ``j + 1``, over every prediction
  / target pair of the batch ``B``;
* **Eq. (8)** ``L_VP = -1/M sum_t log softmax_j(s_tj)[t]`` — the cross-entropy whose label is the
  diagonal (``arange(M)``): each prediction must pick its own continuation out of the batch, and
  every other position's latent is a negative. No OCR, no layout parsing, no labels.
* **Eq. (9)** ``L = lambda_text L_text + lambda_vis L_VP`` — interleaved with the text loss in
  the same step (``phase.kind: visual_next_patch``).

The pairs are those of the kept (foreground) patches only: position ``t`` of a page contributes
when it and ``t + 1`` are both kept, so no prediction is scored against the padding, and the
contrast runs over the micro-batch's pairs (the walkthrough's in-batch negatives; data-parallel
ranks contrast within their own micro-batches).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_s2.pipeline.losses import micro_batch_objective

__all__ = ["next_patch_pairs", "next_patch_contrastive_loss", "VisualNextPatchObjective"]


def next_patch_pairs(pred: torch.Tensor, u: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions [M, Dv], targets [M, Dv]): row t of page b predicts u[b, t + 1], for every t
    where both positions hold kept patches (the pseudo-code's ``pred[:, :-1]`` and ``u[:, 1:]``)."""
    pair = valid[:, :-1] & valid[:, 1:]
    return pred[:, :-1][pair], u[:, 1:][pair]


def next_patch_contrastive_loss(pred: torch.Tensor, target: torch.Tensor, temperature: float
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (7)–(8) over M pairs: (L_VP, top-1 accuracy of picking the own continuation).

    ``pred`` / ``target`` [M, Dv]; computed in float32. M = 0 gives a zero loss that still
    belongs to the graph (a page of blank paper teaches nothing)."""
    if pred.size(0) == 0:
        zero = pred.sum() * 0.0
        return zero, zero.detach()
    a = F.normalize(pred.float(), dim=-1)
    b = F.normalize(target.float(), dim=-1)
    scores = a @ b.T / temperature                                     # s_tj, Eq. (7)
    labels = torch.arange(scores.size(0), device=scores.device)       # the diagonal is the label
    loss = F.cross_entropy(scores, labels)                            # Eq. (8)
    accuracy = (scores.detach().argmax(dim=-1) == labels).float().mean()
    return loss, accuracy


class VisualNextPatchObjective:
    """A step's ``loss_fn`` (:class:`~megatron_s2.pipeline.step.StepInputs`) for ``phase.kind:
    visual_next_patch``: Eq. (9) on each micro-batch — the token cross-entropy of its text
    (``tokens`` / ``labels``, from the schedule's forward) times ``lambda_text``, plus
    ``lambda_vis`` times L_VP of its visual rows — ``patches`` [r, L, 3 p p] / ``patch_valid`` [r, L]
    scanned and chunked by the data path (:mod:`megatron_s2.data.pages`), or whole ``pages``
    [b, 3, H, W] in [0, 1] scanned here; the encoder frozen, the backbone run a second time over
    the visual sequence.

    The text term is a share of the global token mean as without pages; L_VP is a per-micro-batch
    mean and counts as ``1 / num_micro_global`` of the step, as auxiliary losses do. The logged
    loss is the Eq. (9) total; ``loss_text`` and ``loss_vp`` (and ``vp_accuracy``) are logged
    beside it (metrics ``*_raw``)."""

    def __init__(self, global_tokens: torch.Tensor, num_micro_global: int, *, lambda_text: float,
                 lambda_vis: float, temperature: float, paper: float, threshold: float):
        self.global_tokens, self.num_micro_global = global_tokens, num_micro_global
        self.lambda_text, self.lambda_vis, self.temperature = lambda_text, lambda_vis, temperature
        self.paper, self.threshold = paper, threshold

    def __call__(self, model, logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx):
        text_objective, text_summed = micro_batch_objective(model.loss(logits, mb["labels"]), mb["loss_mask"],
                                                            self.global_tokens, None, self.num_micro_global)
        predictor = model.next_patch
        if "pages" in mb:  # whole pages: scan them here
            u, valid = predictor.scan(mb["pages"], paper=self.paper, threshold=self.threshold)
        else:  # rows the data path already scanned and chunked (megatron_s2/data/pages.py)
            valid = mb["patch_valid"]
            u = predictor.encode(mb["patches"], valid)
        pred, target = next_patch_pairs(predictor.predict(model, u), u, valid)
        loss_vp, accuracy = next_patch_contrastive_loss(pred, target, self.temperature)
        objective = self.lambda_text * text_objective + self.lambda_vis * loss_vp / self.num_micro_global
        # logged: sum over micro-batches / global tokens = Eq. (9) with the text term's token mean
        share = self.global_tokens.squeeze() / self.num_micro_global
        summed = self.lambda_text * text_summed + self.lambda_vis * loss_vp.detach() * share
        # metrics are averaged over the micro-batches: this share sums to the global token mean
        ctx.aux_metrics["loss_text"] = text_summed / share
        ctx.aux_metrics["loss_vp"] = loss_vp.detach()
        ctx.aux_metrics["vp_accuracy"] = accuracy
        return objective, summed
