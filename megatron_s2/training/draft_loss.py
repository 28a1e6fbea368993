"""The drafter's objectives: the hybrid LK loss and the DSpark confidence-head loss.

Hybrid LK loss (Intern-S2 walkthrough, Ch. 4, Eq. 22-24, in
``shared/seeds/intern-s2-report-walkthrough.txt``, "The hybrid draft loss"; LK Losses, Samarin
et al., arXiv 2602.23881). At draft position ``k`` let ``p_k`` be the target policy's
distribution and ``q_k`` the drafter's, both at the rollout sampling temperature ``T``
(``softmax(logits / T)``), ``p_k`` detached: no gradient ever reaches the policy ("gradients are
stopped through the policy model")::

    L_k    = lambda_k * KL(p_k || q_k) + (1 - lambda_k) * TV(p_k, q_k)        (Eq. 22)
    lambda_k = exp(-eta * alpha_bar_k)                                       (Eq. 23)
    L      = 1/K sum_k L_k                                                   (Eq. 24)

``alpha_bar_k`` is the current acceptance rate at position ``k`` aggregated over sequence and
batch (a constant: no gradient), ``eta = 3``. Acceptance equals overlap, ``sum min(p, q) = 1 - TV``
(Eq. 21), so the TV term optimises the acceptance rate itself; its constant-size subgradient is
a poor signal far from the target, so while alignment is poor (``alpha_bar`` small,
``lambda -> 1``) the smooth forward KL dominates, and as acceptance rises the objective shifts to
TV. Each ``L_k`` is the mean over the valid (masked) tokens at position ``k``.

Confidence loss (DeepSeek-V4.1-Flash report §2.4.3, in
``shared/seeds/deepseek-v4.1-flash-report.txt``: "a confidence head predicts per-position
conditional acceptance probabilities"): binary cross-entropy of the head's logits against the
realised conditional acceptance probability at each position, the overlap of ``p`` and ``q``
there (a soft target, detached).

Under context parallelism each rank holds the anchors of its own sequence chunks: with ``group``
(the CP group) the token counts and the acceptance are all-reduced over it, so every rank weighs
its tokens by the whole micro-batch's counts and the per-rank losses sum to the loss over all
anchors (the gradients are then summed over the CP ranks like the backbone's).

Everything is computed in float32 (``log_softmax``); a target with zero-probability tokens
(``-inf`` logits) contributes ``0 log 0 = 0`` to the KL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group

__all__ = ["lk_lambda", "position_overlap", "acceptance_rates", "hybrid_lk_loss", "confidence_loss"]

DEFAULT_ETA = 3.0
"""The walkthrough's eta (Eq. 23, "with K = 4 and eta = 3")."""


def lk_lambda(alpha_bar, eta: float = DEFAULT_ETA):
    """Eq. 23: the KL weight ``exp(-eta * alpha_bar)`` per draft position (a float or a tensor;
    1 at zero acceptance, ``exp(-eta)`` at full acceptance). No gradient flows through it."""
    if isinstance(alpha_bar, torch.Tensor):
        return torch.exp(-eta * alpha_bar.detach().float())
    return float(torch.exp(torch.tensor(-eta * float(alpha_bar), dtype=torch.float64)))


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _check(policy_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> None:
    if policy_logits.dim() != 3 or policy_logits.shape != draft_logits.shape:
        raise ValueError(f"hybrid LK loss: policy_logits and draft_logits must both be [N, K, V], got "
                         f"{tuple(policy_logits.shape)} and {tuple(draft_logits.shape)}")
    if mask.shape != policy_logits.shape[:2]:
        raise ValueError(f"hybrid LK loss: mask must be [N, K] = {list(policy_logits.shape[:2])}, got {list(mask.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 (the rollout sampling temperature), got {temperature}")


def position_overlap(policy_logits: torch.Tensor, draft_logits: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """``[N, K]`` overlap ``sum_x min(p, q)`` at every draft position: the conditional acceptance
    probability of a draft there (Eq. 21), detached. The confidence head's target."""
    with torch.no_grad():
        p = _log_probs(policy_logits, temperature).exp()
        q = _log_probs(draft_logits, temperature).exp()
        return torch.minimum(p, q).sum(-1)


def _masked_position_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over N of ``values [N, K]`` where ``mask``; and the valid counts [K]."""
    weights = mask.to(values.dtype)
    return (values * weights).sum(0), weights.sum(0)


def _masked_position_mean(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over N of ``values [N, K]`` where ``mask``; and the valid counts [K]."""
    sums, counts = _masked_position_sum(values, mask)
    return sums / counts.clamp(min=1), counts


def _all_ranks(t: torch.Tensor, group: Group | None) -> torch.Tensor:
    """``t`` summed over the ranks sharing the micro-batch's anchors (detached; itself without a group)."""
    return t.detach() if group is None else mappings.all_reduce_sum(t.detach(), group)


def acceptance_rates(policy_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """``[K]`` mean acceptance (overlap) per draft position over the valid tokens: ``alpha_bar``
    of Eq. 23, detached; 0 at a position with no valid token."""
    _check(policy_logits, draft_logits, mask, temperature)
    rates, _ = _masked_position_mean(position_overlap(policy_logits, draft_logits, temperature), mask)
    return rates


def hybrid_lk_loss(policy_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor, *,
                   temperature: float = 1.0, eta: float = DEFAULT_ETA, alpha_bar: torch.Tensor | None = None,
                   group: Group | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The hybrid LK loss (Eq. 22-24; module docstring).

    ``policy_logits``, ``draft_logits``: ``[N, K, V]`` at N anchor positions and K draft
    positions; ``mask [N, K]``: which (anchor, position) pairs count. ``alpha_bar [K]``: the
    acceptance rates that set lambda (e.g. a running average kept by the caller); None = this
    batch's (:func:`acceptance_rates`). ``group``: the ranks the micro-batch's anchors are split
    over (context parallelism): this rank's share of the loss, the metrics of the whole micro-batch.

    Returns ``(loss, metrics)``: the scalar loss (gradient into ``draft_logits`` only) and
    detached ``[K]`` tensors ``acceptance`` (this batch's), ``lambda``, ``kl``, ``tv``,
    ``tokens``. Positions without a valid token are left out of the 1/K average.
    """
    _check(policy_logits, draft_logits, mask, temperature)
    mask = mask.bool()
    target_logp = _log_probs(policy_logits.detach(), temperature)
    target = target_logp.exp()
    draft_logp = _log_probs(draft_logits, temperature)
    # KL(p || q) = sum p (log p - log q), with 0 log 0 = 0 where the target gives a token nothing
    kl = torch.where(target > 0, target * (target_logp - draft_logp), 0.0).sum(-1)            # [N, K]
    tv = 0.5 * (target - draft_logp.exp()).abs().sum(-1)                                      # [N, K]

    kl_sum, tokens = _masked_position_sum(kl, mask)
    tv_sum, _ = _masked_position_sum(tv, mask)
    tokens = _all_ranks(tokens, group)
    kl_k, tv_k = kl_sum / tokens.clamp(min=1), tv_sum / tokens.clamp(min=1)   # this rank's share of the means
    tv_all = _all_ranks(tv_k, group)
    # overlap = 1 - TV per token (Eq. 21); 0 where nothing was measured, as acceptance_rates
    acceptance = torch.where(tokens > 0, 1.0 - tv_all, 0.0)
    if alpha_bar is None:
        alpha_bar = acceptance
    alpha_bar = torch.as_tensor(alpha_bar, dtype=torch.float32, device=kl.device).detach()
    if alpha_bar.shape != kl_k.shape:
        raise ValueError(f"alpha_bar: must hold one acceptance rate per draft position, shape {list(kl_k.shape)}, "
                         f"got {list(alpha_bar.shape)}")
    weight = lk_lambda(alpha_bar, eta)
    per_position = weight * kl_k + (1 - weight) * tv_k                                        # Eq. 22
    present = (tokens > 0).float()
    # Eq. 24 over the positions this batch has tokens at; an all-masked batch gives a zero that
    # still belongs to the graph (every rank runs the same backward)
    loss = (per_position * present).sum() / present.sum().clamp(min=1)
    metrics = {"acceptance": acceptance, "lambda": weight, "kl": _all_ranks(kl_k, group),
               "tv": tv_all, "tokens": tokens}
    return loss, metrics


def confidence_loss(confidence_logits: torch.Tensor, accept_prob_targets: torch.Tensor,
                    mask: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Binary cross-entropy of the confidence head's logits ``[N, K]`` against soft targets
    ``[N, K]`` (the realised conditional acceptance probabilities, :func:`position_overlap`;
    detached here), averaged over the valid tokens of ``mask [N, K]`` (0 if there are none);
    ``group``: as :func:`hybrid_lk_loss` (this rank's share of the mean)."""
    if confidence_logits.shape != accept_prob_targets.shape or confidence_logits.shape != mask.shape:
        raise ValueError(f"confidence_loss: confidence_logits, accept_prob_targets and mask must share one shape "
                         f"[N, K], got {list(confidence_logits.shape)}, {list(accept_prob_targets.shape)}, "
                         f"{list(mask.shape)}")
    weights = mask.float()
    per_token = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept_prob_targets.detach().float(),
                                                   reduction="none")
    return (per_token * weights).sum() / _all_ranks(weights.sum(), group).clamp(min=1)
