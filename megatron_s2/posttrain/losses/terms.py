"""Loss terms of the post-training objective (walkthrough Eq. 29, 36; report §5.2.4), as a registry.

Every term maps :class:`LossInputs` to a per-token loss ``[b, s]``; the objective
(:mod:`.objective`) sums the configured terms with their coefficients, applies the masks and
the aggregation weights. Registered terms:

* ``policy_gradient`` — **Eq. 29** (and Eq. 36 for OPD, where only the advantage differs)::

      l_{i,t} = - sg[ clip(rho_{i,t}, 1 - eps_low, 1 + eps_high) ] * A_{i,t} * log pi_theta(y_{i,t})

  with rho against the per-token behaviour policy (Eq. 10-11). Only log pi_theta carries
  gradient, so d l / d log pi = -rho_bar * A.
* ``reference_kl`` — KL of the policy to a frozen reference on the sampled tokens, with the
  k1 (log-ratio), k2 (half squared log-ratio) or k3 (exp(-x) + x - 1, x = log pi - log pi_ref,
  non-negative, low variance) estimator; gradient through log pi_theta.
* ``full_vocab_kl`` — KL over the full vocabulary between the policy and a teacher (report
  §5.2.4, reverse KL(pi_theta || pi_T) by default) on vocabulary-parallel shards.
* ``entropy`` — minus the policy entropy (a bonus when its coefficient is positive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.losses.importance import truncated_importance_weight
from megatron_s2.posttrain.vocab_parallel import vocab_parallel_entropy, vocab_parallel_kl

if TYPE_CHECKING:
    from megatron_s2.config.posttrain.loss import LossConfig, LossTermConfig

__all__ = ["LossInputs", "LOSS_TERMS", "register_loss_term", "policy_gradient_token_loss", "reference_kl_token"]


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, aligned with the labels ``[b, s]``."""

    logprobs: torch.Tensor
    """log pi_theta of each label token (with gradient; :func:`~..vocab_parallel.token_log_probs`)."""
    loss_mask: torch.Tensor
    """bool: policy-generated label tokens (prompt, environment and padding are False)."""
    weights: torch.Tensor
    """Aggregation weights (:func:`~.aggregation.aggregation_weights`), including sample weights."""
    behaviour_logprobs: torch.Tensor | None = None
    """Log-probability at generation time, from the policy version that produced the token."""
    advantages: torch.Tensor | None = None
    """Per-token advantage (RL: the response's scalar broadcast; OPD: Eq. 33)."""
    versions: torch.Tensor | None = None
    """Policy version that produced each token (int64; < 0 for non-policy tokens)."""
    current_version: int | None = None
    """The learner's version (staleness)."""
    proximal_logprobs: torch.Tensor | None = None
    """No-grad log pi of each label token under the learner's weights at the start of this
    rollout batch (the rollout's parameters for current-version tokens; BKL/TV masks)."""
    reference_logprobs: torch.Tensor | None = None
    """log pi_ref of each label token (frozen reference)."""
    logits: torch.Tensor | None = None
    """This rank's vocabulary shard of the policy logits [b, s, V/tp] (full-vocabulary terms)."""
    teacher_logits: torch.Tensor | None = None
    """The teacher's logits on the same shard [b, s, V/tp] (full-vocabulary OPD)."""
    tp: Group = field(default_factory=Group.single)
    """Tensor-parallel group the vocabulary is split over."""

    def need(self, name: str, term: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"loss term '{term}' needs LossInputs.{name}")
        return value


LossTerm = Callable[[LossInputs, "LossTermConfig", "LossConfig"], tuple[torch.Tensor, dict[str, torch.Tensor]]]
LOSS_TERMS: dict[str, LossTerm] = {}
"""Registry: term kind (``loss.terms[*].kind``) -> fn(inputs, term config, loss config) ->
(per-token loss [b, s], detached per-token diagnostics)."""


def register_loss_term(name: str) -> Callable[[LossTerm], LossTerm]:
    def wrap(fn: LossTerm) -> LossTerm:
        if name in LOSS_TERMS:
            raise ValueError(f"loss term '{name}' is already registered")
        LOSS_TERMS[name] = fn
        return fn
    return wrap


def policy_gradient_token_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                               eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 29's summand and the truncated weight rho_bar used."""
    rho = truncated_importance_weight(logprobs, behaviour_logprobs, eps_low, eps_high)
    return -(rho * advantages.detach().to(logprobs.dtype) * logprobs), rho


def reference_kl_token(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Sampled-token estimator of KL(pi_theta || pi_ref)."""
    x = logprobs - reference_logprobs.detach().to(logprobs.dtype)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(-x) + x - 1.0
    raise ValueError(f"unknown KL estimator '{estimator}' (k1 | k2 | k3)")


@register_loss_term("policy_gradient")
def _policy_gradient(inputs: LossInputs, term, config):
    loss, rho = policy_gradient_token_loss(inputs.logprobs, inputs.need("behaviour_logprobs", "policy_gradient"),
                                           inputs.need("advantages", "policy_gradient"),
                                           config.eps_low, config.eps_high)
    return loss, {"importance_weight": rho}


@register_loss_term("reference_kl")
def _reference_kl(inputs: LossInputs, term, config):
    kl = reference_kl_token(inputs.logprobs, inputs.need("reference_logprobs", "reference_kl"), term.kl_estimator)
    return kl, {"reference_kl": kl.detach()}


@register_loss_term("full_vocab_kl")
def _full_vocab_kl(inputs: LossInputs, term, config):
    student = inputs.need("logits", "full_vocab_kl")
    teacher = inputs.need("teacher_logits", "full_vocab_kl").detach()
    if config.temperature != 1.0:
        student, teacher = student / config.temperature, teacher / config.temperature
    if term.direction == "reverse":
        kl = vocab_parallel_kl(student, teacher, inputs.tp)
    else:
        kl = vocab_parallel_kl(teacher, student, inputs.tp)
    return kl, {"teacher_kl": kl.detach()}


@register_loss_term("entropy")
def _entropy(inputs: LossInputs, term, config):
    logits = inputs.need("logits", "entropy")
    if config.temperature != 1.0:
        logits = logits / config.temperature
    h = vocab_parallel_entropy(logits, inputs.tp)
    return -h, {"entropy": h.detach()}
