"""Group-relative advantages and DAPO dynamic sampling (walkthrough Ch. 5, Eq. 27).

All responses of a group answer the same prompt; the advantage of response ``i`` is its
reward relative to the others:

* ``group_mean`` (GRPO, walkthrough Ch. 5 "Step 1" context):  A_i = R_i - mean(R), optionally
  divided by the group's standard deviation (population std, ddof = 0) plus ``eps``.
* ``leave_one_out`` (walkthrough **Eq. 27**, Intern-S1-Pro):  A_i = R_i - 1/(G-1) sum_{j!=i} R_j.
  The baseline excludes the sample it corrects, so it is independent of it; the advantages sum
  to exactly zero and equal G/(G-1) times the mean-centred ones.

**DAPO dynamic sampling** (walkthrough Ch. 5, reference [96]): a group whose rewards are all
identical has all-zero advantages and contributes no gradient; it is filtered out online and
replaced by newly sampled groups (:func:`is_informative`; the orchestrator does the replacing).

A control, ``leave_one_out_shuffled``: Eq. 27 on the group's rewards shuffled among its responses
(torch's global generator: the run's seed), so each step's advantages have the sizes
of the real ones but no longer say which response was right. A held-out rise that a run with it
matches is not the reward's doing (sharpening, the format, continued training); one it does not
match is learnt from the verifier.

Worked example 14 (G = 8, R = (1,1,1,0,1,0,1,1)): correct +0.285714, wrong -0.857143.
Worked example 22 (G = 6, R = (1,0,0,1,0,0)): success +0.800, failure -0.400.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = [
    "GROUP_ESTIMATORS",
    "as_rewards",
    "group_mean_advantages",
    "leave_one_out_advantages",
    "shuffled_leave_one_out_advantages",
    "is_informative",
    "std_normalize",
    "register_group_estimator",
]

GroupEstimator = Callable[[torch.Tensor], torch.Tensor]
GROUP_ESTIMATORS: dict[str, GroupEstimator] = {}
"""Registry: estimator name (the ``rl.advantage.estimator`` value) -> rewards [G] -> advantages [G]."""


def register_group_estimator(name: str) -> Callable[[GroupEstimator], GroupEstimator]:
    def wrap(fn: GroupEstimator) -> GroupEstimator:
        if name in GROUP_ESTIMATORS:
            raise ValueError(f"group estimator '{name}' is already registered")
        GROUP_ESTIMATORS[name] = fn
        return fn
    return wrap


def as_rewards(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Rewards of one group as a float64 vector; non-finite rewards are an error."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if r.numel() and not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


@register_group_estimator("group_mean")
def group_mean_advantages(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """A_i = R_i - mean(R) (GRPO's mean-centred group baseline)."""
    r = as_rewards(rewards)
    if r.numel() < 1:
        raise ValueError("group_mean advantages need at least one reward")
    return r - r.mean()


@register_group_estimator("leave_one_out")
def leave_one_out_advantages(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Eq. 27: A_i = R_i - (sum_j R_j - R_i) / (G - 1)."""
    r = as_rewards(rewards)
    g = r.numel()
    if g < 2:
        raise ValueError(f"leave-one-out advantages need a group of at least 2 responses, got {g}")
    return r - (r.sum() - r) / (g - 1)


@register_group_estimator("leave_one_out_shuffled")
def shuffled_leave_one_out_advantages(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The control: Eq. 27 on the rewards permuted at random among the group's responses."""
    r = as_rewards(rewards)
    return leave_one_out_advantages(r[torch.randperm(r.numel())])


def std_normalize(advantages: torch.Tensor, rewards: Sequence[float] | torch.Tensor, eps: float) -> torch.Tensor:
    """Divide by the group's reward standard deviation (population, ddof = 0) plus ``eps``."""
    r = as_rewards(rewards)
    return advantages / (r.std(unbiased=False) + eps)


def is_informative(rewards: Sequence[float] | torch.Tensor, atol: float = 0.0) -> bool:
    """DAPO dynamic sampling: False when every reward equals the first within ``atol``
    (all advantages would be zero, so the group is filtered out and replaced)."""
    r = as_rewards(rewards)
    if r.numel() < 2:
        return False
    return bool(((r - r[0]).abs() > atol).any())
