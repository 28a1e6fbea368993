"""Adaptive length regularisation of advantages (walkthrough Ch. 5 "Step 3", Eq. 14-17).

Instead of a length reward (which competes with the task reward) the positive advantages of
a group are *re-weighted* by length, with the total positive mass preserved:

* **Eq. 14** positive set  P_q = { i : A_i > 0 }.
* **Eq. 15** when |P_q| >= tau * G::

      A~_i = ( sum_{j in P_q} A_j / sum_{j in P_q} w_j A_j ) * w_i * A_i     for i in P_q
      A~_i = A_i                                                             otherwise

  and every advantage passes unchanged when fewer than tau * G responses succeeded
  (difficulty gates concision, per query, with no schedule).
* **Eq. 16-17** length weight over the positive set only::

      r_i = (L_i - L+_min) / (L+_max - L+_min),      w_i = alpha + (1 - alpha) * (1 - r_i) ** gamma

  alpha is the floor given to the longest successful answer, gamma the shape of the decay.
  When every positive response has the same length, r_i = 0 and all weights are 1.

Worked example 16: lengths (900, 1200, 1500, 2400, 3000, 5000) with alpha = 0.2, gamma = 1 give
weights (1, 0.94146, 0.88293, 0.70732, 0.59024, 0.2), sum 4.32195, normaliser 1.388263, and
the six re-weighted advantages sum back to 6 * 2/7 = 1.714286. Worked example 17: at
r = 0.5, w = 0.4 for gamma = 2 and 0.76569 for gamma = 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["length_weights", "adaptive_length_regularization", "LengthRegularization"]


def length_weights(lengths: torch.Tensor, alpha: float, gamma: float) -> torch.Tensor:
    """Eq. 16-17 over the lengths of the positive set."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if lengths.numel() == 0:
        return lengths
    lo, hi = lengths.min(), lengths.max()
    span = hi - lo
    r = (lengths - lo) / span if float(span) > 0 else torch.zeros_like(lengths)
    return alpha + (1.0 - alpha) * (1.0 - r).pow(gamma)


@dataclass(frozen=True)
class LengthRegularization:
    """Diagnostics of one application of Eq. 15."""

    applied: bool
    """Whether |P_q| >= tau * G held (otherwise advantages are unchanged)."""
    normaliser: float
    """sum A_j / sum w_j A_j over P_q (1.0 when not applied)."""
    weights: torch.Tensor
    """w_i per response of the group (1.0 outside P_q or when not applied)."""


def adaptive_length_regularization(advantages: torch.Tensor, lengths: Sequence[int] | torch.Tensor, *,
                                   tau: float, alpha: float, gamma: float) -> tuple[torch.Tensor, LengthRegularization]:
    """Eq. 14-17 on one group; returns (advantages, diagnostics)."""
    a = torch.as_tensor(advantages, dtype=torch.float64)
    lengths = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    if lengths.shape != a.shape:
        raise ValueError(f"length regularisation: {lengths.numel()} lengths for {a.numel()} advantages")
    ones = torch.ones_like(a)
    positive = a > 0  # Eq. 14
    count = int(positive.sum())
    if count == 0 or count < tau * a.numel():
        return a.clone(), LengthRegularization(False, 1.0, ones)
    w = ones.clone()
    w[positive] = length_weights(lengths[positive], alpha, gamma)
    norm = a[positive].sum() / (w[positive] * a[positive]).sum()
    out = torch.where(positive, norm * w * a, a)  # Eq. 15
    return out, LengthRegularization(True, float(norm), w)
