"""GEPO: group-entropy-controlled advantage rebalancing (walkthrough Ch. 5 "Step 2", Eq. 25-26).

Heterogeneous task families make group advantages statistically non-comparable: a
near-deterministic maths group and an open-ended write-up group produce advantages of the
same size that mean very different updates. GEPO diagnoses each group by its entropy,
estimated from the samples already drawn (no extra rollouts), **Eq. 25**::

    H_g = -(1/K) * sum_{i=1..K} sum_t log pi(y_{i,t} | x, y_{i,<t})

(total sequence surprisal averaged over the K responses — longer responses count more), and
reshapes the advantages by regime, **Eq. 26**::

    H_g < H_low :  A_i <- c_low  * A_i  for A_i > 0   (damp exploitation, slow entropy collapse)
    H_g > H_high:  A_i <- c_high * A_i  for A_i < 0   (protect exploration)
    otherwise   :  A_i unchanged

The report does not publish the coefficients or thresholds (the walkthrough's numbers are
illustrative), so they are configuration: fixed thresholds, or thresholds taken as quantiles
of the current batch's group entropies ("at this training step", :func:`batch_thresholds`).

Worked example 15: K = 4 responses of 5 tokens; maths at log pi = -0.05 per token gives
H = 0.25, science at -1.20 gives H = 6.00 (a factor of 24); with H_low = 1, H_high = 4,
c_low = 0.5, c_high = 0.8 and the advantages of worked example 14, maths positives become
+0.142857 and science negatives -0.685714.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["group_entropy", "gepo_rebalance", "batch_thresholds"]


def group_entropy(logprob_sums: Sequence[float] | torch.Tensor) -> float:
    """Eq. 25 from per-response sums of sampled-token log-probabilities (behaviour policy)."""
    s = torch.as_tensor(logprob_sums, dtype=torch.float64).reshape(-1)
    if s.numel() == 0:
        raise ValueError("group entropy needs at least one response")
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"group entropy: log-probability sums must be finite, got {s.tolist()}")
    return float(-s.mean())


def gepo_rebalance(advantages: torch.Tensor, entropy: float, *, h_low: float, h_high: float,
                   low_positive_scale: float, high_negative_scale: float) -> torch.Tensor:
    """Eq. 26: scale positive advantages of low-entropy groups, negative ones of high-entropy groups."""
    if h_low > h_high:
        raise ValueError(f"GEPO thresholds: h_low={h_low} must not exceed h_high={h_high}")
    a = advantages.clone()
    if entropy < h_low:
        a = torch.where(a > 0, a * low_positive_scale, a)
    elif entropy > h_high:
        a = torch.where(a < 0, a * high_negative_scale, a)
    return a


def batch_thresholds(entropies: Sequence[float], low_quantile: float, high_quantile: float) -> tuple[float, float]:
    """(H_low, H_high) as quantiles of this step's group entropies (linear interpolation)."""
    if not 0.0 <= low_quantile <= high_quantile <= 1.0:
        raise ValueError(f"GEPO quantiles must satisfy 0 <= low ({low_quantile}) <= high ({high_quantile}) <= 1")
    h = torch.as_tensor(list(entropies), dtype=torch.float64)
    if h.numel() == 0:
        raise ValueError("GEPO batch thresholds need at least one group entropy")
    return float(torch.quantile(h, low_quantile)), float(torch.quantile(h, high_quantile))
