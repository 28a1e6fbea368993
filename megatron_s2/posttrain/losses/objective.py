"""The post-training objective composed from the recipe's ``loss`` section.

``objective = sum_{b,s} weights * keep * sum_k coef_k * term_k``, where ``keep`` is the loss
mask AND every configured token mask (registry :data:`TOKEN_MASKS`), the terms come from
:data:`~.terms.LOSS_TERMS` and ``weights`` from :func:`~.aggregation.aggregation_weights`.
Masks and weights never carry gradient. The same objective serves RL (advantage from the
group pipeline) and sampled-token OPD (advantage Eq. 33): "the only distinction is the
advantage" (walkthrough Ch. 8); full-vocabulary OPD swaps the policy-gradient term for
``full_vocab_kl``.

Masks:

* ``bkl`` — walkthrough Eq. 12-13, between the learner's log-probability under the rollout's
  parameters (``proximal_logprobs``: the no-grad recompute at the start of the rollout batch,
  falling back to ``logprobs``) and the rollout engine's. With ``mismatch_scope:
  current_version`` only tokens produced by the current version are tested (for older tokens
  the parameters do not match and the truncated weight handles the drift); ``all`` tests every
  token (a trust-region mask in the style of Stable-RL).
* ``binary_tv`` — |p_train - p_rollout| <= tv_threshold, same scope.
* ``staleness`` — report §5.2.2, tokens more than ``max_staleness`` versions old.
* ``ratio`` — importance ratio outside [mask_ratio_low, mask_ratio_high].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from megatron_s2.posttrain.losses.masks import bkl_mask, ratio_mask, staleness_mask, tv_mask
from megatron_s2.posttrain.losses.terms import LOSS_TERMS, LossInputs

if TYPE_CHECKING:
    from megatron_s2.config.posttrain.loss import LossConfig

__all__ = ["TOKEN_MASKS", "register_token_mask", "ObjectiveResult", "PosttrainObjective"]

TokenMask = Callable[[LossInputs, "LossConfig", int], torch.Tensor]
TOKEN_MASKS: dict[str, TokenMask] = {}
"""Registry: mask name (``loss.masks`` entry) -> fn(inputs, loss config, max_staleness) -> keep [b, s] bool."""


def register_token_mask(name: str) -> Callable[[TokenMask], TokenMask]:
    def wrap(fn: TokenMask) -> TokenMask:
        if name in TOKEN_MASKS:
            raise ValueError(f"token mask '{name}' is already registered")
        TOKEN_MASKS[name] = fn
        return fn
    return wrap


def _in_scope(inputs: LossInputs, config) -> torch.Tensor | None:
    """Tokens whose rollout parameters match the learner's (None = all)."""
    if config.mismatch_scope == "all" or inputs.versions is None or inputs.current_version is None:
        return None
    return inputs.versions == inputs.current_version


def _mismatch(test, threshold_name: str):
    def mask(inputs: LossInputs, config, max_staleness: int) -> torch.Tensor:
        train = inputs.logprobs if inputs.proximal_logprobs is None else inputs.proximal_logprobs
        keep = test(train, inputs.need("behaviour_logprobs", threshold_name), getattr(config, threshold_name))
        scope = _in_scope(inputs, config)
        return keep if scope is None else keep | ~scope
    return mask


register_token_mask("bkl")(_mismatch(bkl_mask, "bkl_threshold"))
register_token_mask("binary_tv")(_mismatch(tv_mask, "tv_threshold"))


@register_token_mask("staleness")
def _staleness(inputs: LossInputs, config, max_staleness: int) -> torch.Tensor:
    if inputs.current_version is None:
        raise ValueError("the staleness mask needs LossInputs.current_version")
    versions = inputs.need("versions", "staleness")
    policy = versions >= 0
    return staleness_mask(torch.where(policy, versions, torch.full_like(versions, inputs.current_version)),
                          inputs.current_version, max_staleness)


@register_token_mask("ratio")
def _ratio(inputs: LossInputs, config, max_staleness: int) -> torch.Tensor:
    return ratio_mask(inputs.logprobs, inputs.need("behaviour_logprobs", "ratio"),
                      config.mask_ratio_low, config.mask_ratio_high)


@dataclass
class ObjectiveResult:
    objective: torch.Tensor
    """Scalar to backpropagate (this micro-batch's share of the global objective)."""
    keep: torch.Tensor
    """[b, s] bool: loss tokens that survived every mask."""
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Detached (sum, count) pairs over loss tokens, for all-reduce then division (metrics)."""


class PosttrainObjective:
    """Masks x terms x aggregation, from a :class:`~megatron_s2.config.posttrain.loss.LossConfig`."""

    def __init__(self, config: "LossConfig", max_staleness: int = -1):
        self.config, self.max_staleness = config, max_staleness
        for term in config.terms:
            if term.kind not in LOSS_TERMS:
                raise ValueError(f"unknown loss term '{term.kind}' (registered: {', '.join(sorted(LOSS_TERMS))})")
        for name in config.masks:
            if name not in TOKEN_MASKS:
                raise ValueError(f"unknown token mask '{name}' (registered: {', '.join(sorted(TOKEN_MASKS))})")

    def __call__(self, inputs: LossInputs) -> ObjectiveResult:
        loss_mask = inputs.loss_mask.bool()
        keep = loss_mask.clone()
        stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        count = loss_mask.sum().to(torch.float64)
        with torch.no_grad():
            for name in self.config.masks:
                m = TOKEN_MASKS[name](inputs, self.config, self.max_staleness)
                stats[f"masked_{name}"] = ((loss_mask & ~m).sum().to(torch.float64), count)
                keep &= m
            stats["masked_any"] = ((loss_mask & ~keep).sum().to(torch.float64), count)
        total = torch.zeros_like(inputs.logprobs)
        for term in self.config.terms:
            token_loss, diag = LOSS_TERMS[term.kind](inputs, term, self.config)
            total = total + term.coef * token_loss
            for key, value in diag.items():
                v = value.detach().to(torch.float64)
                stats[key] = ((v * keep).sum(), keep.sum().to(torch.float64))
                if key == "importance_weight":
                    inside = keep.any()
                    stats["importance_weight_max"] = (v[keep].max() if inside else v.new_zeros(()), v.new_ones(()))
            stats[f"loss_{term.kind}"] = (((token_loss.detach() * keep).to(torch.float64) * inputs.weights).sum(),
                                          torch.ones((), dtype=torch.float64))
        weights = (inputs.weights.to(total.dtype) * keep.to(total.dtype)).detach()
        objective = (total * weights).sum()
        return ObjectiveResult(objective, keep, stats)
