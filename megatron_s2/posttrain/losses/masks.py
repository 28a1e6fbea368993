"""Token masks of the post-training loss (walkthrough Eq. 12-13, report §5.2.2, Stable-RL).

* **Binary-KL mask** (walkthrough Eq. 12-13, from KPop): after routing replay (R3) and
  operator alignment a few tokens still differ badly between the training and rollout
  engines. Collapse the vocabulary to "this token or anything else" and compare the two
  engines' Bernoulli distributions, **Eq. 12**::

      D_BKL(p || q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q))

  with p, q the probabilities of the sampled token under matched parameters and replayed
  routing. KL is not symmetric, so a token survives only if **both directions** are at most
  the threshold phi, **Eq. 13**. Worked example 11: (p_train, p_rollout) = (0.90, 0.80) gives
  0.0367 and 0.0444 (kept); (0.05, 0.60) gives 0.6975 and 1.1449 (masked).
* **Binary total-variation mask** (sail-sg/Stable-RL's binary TV): |p - q| <= delta.
* **Staleness mask** (report §5.2.2): tokens produced by a policy more than ``max_staleness``
  versions behind the learner are removed from the loss.
* **Ratio mask** (prime-rl style masked importance sampling): tokens whose importance ratio
  lies outside [low, high] are removed.

Probabilities are formed from log-probabilities (float64 recommended for the test of tiny
differences); 1 - p uses expm1 so that p close to 1 keeps its precision.
"""

from __future__ import annotations

import math

import torch

__all__ = ["binary_kl", "bkl_mask", "binary_tv", "tv_mask", "staleness", "staleness_mask", "ratio_mask"]


def _log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, accurate near 0 and near -inf."""
    logp = logp.clamp(max=0.0)
    return torch.where(logp > -math.log(2.0), torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


def binary_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Eq. 12: KL between Bernoulli(p) and Bernoulli(q), from log p and log q (no gradient)."""
    logp, logq = logp.detach(), logq.detach().to(logp.dtype)
    p = logp.exp()
    first = p * (logp - logq)
    one_minus_p = -torch.expm1(logp.clamp(max=0.0))
    second = one_minus_p * (_log1mexp(logp) - _log1mexp(logq))
    second = torch.where(one_minus_p > 0, second, torch.zeros_like(second))  # 0 * log(0/x) = 0
    return first + second


def bkl_mask(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Eq. 13: keep a token iff D_BKL(train || rollout) <= phi and D_BKL(rollout || train) <= phi."""
    forward = binary_kl(train_logprobs, rollout_logprobs)
    backward = binary_kl(rollout_logprobs, train_logprobs)
    return (forward <= threshold) & (backward <= threshold)


def binary_tv(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Binary total variation |p - q| of the sampled token's probability (no gradient)."""
    return (logp.detach().exp() - logq.detach().to(logp.dtype).exp()).abs()


def tv_mask(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    return binary_tv(train_logprobs, rollout_logprobs) <= threshold


def staleness(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """Policy versions behind the learner, per token (negative versions mark non-policy tokens)."""
    return current_version - versions


def staleness_mask(versions: torch.Tensor, current_version: int, max_staleness: int) -> torch.Tensor:
    """Report §5.2.2: keep tokens at most ``max_staleness`` versions old (< 0: keep all)."""
    if max_staleness < 0:
        return torch.ones_like(versions, dtype=torch.bool)
    if bool((versions > current_version).any()):
        raise ValueError(f"a token carries policy version {int(versions.max())}, newer than the learner's "
                         f"{current_version}; the version counters of rollout and trainer disagree")
    return staleness(versions, current_version) <= max_staleness


def ratio_mask(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Keep tokens whose importance ratio lies in [low, high]."""
    ratio = (logprobs.detach() - behaviour_logprobs.to(logprobs.dtype)).exp()
    return (ratio >= low) & (ratio <= high)
