"""Truncated, detached importance weight against the per-token behaviour policy (walkthrough Eq. 10-11).

With partial rollouts different tokens of one trajectory come from different policy versions,
so the behaviour policy is indexed by trajectory *and* position, **Eq. 10**::

    rho_{i,t} = pi_theta(y_{i,t} | ...) / pi_beh(i,t)(y_{i,t} | ...)

using the log-probability recorded at generation time by the version that produced the token.
The ratio is truncated, **Eq. 11**::

    rho_bar_{i,t} = clip(rho_{i,t}, 1 - eps_low, 1 + eps_high)

and **detached** (stop-gradient): it multiplies the gradient of log pi_theta as a constant
weight. That is not PPO's clipped surrogate: with rho = 8 and a bound of 1.2, PPO drops the
token for a positive advantage, here it still contributes with weight 1.2 — the off-policy
tokens pause-and-resume preserves are kept, with bounded variance.
"""

from __future__ import annotations

import torch

__all__ = ["log_importance_ratio", "truncated_importance_weight"]


def log_importance_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> torch.Tensor:
    """log rho (Eq. 10), detached."""
    if logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"importance ratio: log-probs {tuple(logprobs.shape)} vs behaviour "
                         f"{tuple(behaviour_logprobs.shape)}")
    return logprobs.detach() - behaviour_logprobs.to(logprobs.dtype)


def truncated_importance_weight(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                                eps_low: float, eps_high: float) -> torch.Tensor:
    """Eq. 10-11: sg[clip(exp(log pi_theta - log pi_beh), 1 - eps_low, 1 + eps_high)]."""
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"clip bounds need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    return log_importance_ratio(logprobs, behaviour_logprobs).exp().clamp(1.0 - eps_low, 1.0 + eps_high)
