"""Nesterov momentum shared by Muon and the Sinkhorn-balanced update (report §2.5).

Both rules keep a single momentum buffer per parameter (the memory argument of §2.5) and feed
the Nesterov "look-ahead" update to their matrix normaliser:

    B_t = mu * B_{t-1} + G_t                 (buffer, B_0 = 0)
    G^_t = G_t + mu * B_t                     (Nesterov)   or   G^_t = B_t   (heavy ball)

This is the SGD-style accumulation used by Moonlight (Liu et al., 2025). The exponential
moving-average form B_t = mu B_{t-1} + (1 - mu) G_t used by the original Muon code gives
the same G^_t up to the constant factor (1 - mu), which both Newton-Schulz (Frobenius
normalisation) and Sinkhorn balancing (row/column normalisation) divide out.
"""

from __future__ import annotations

import torch

__all__ = ["nesterov_momentum_"]


@torch.no_grad()
def nesterov_momentum_(buffer: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance ``buffer`` in place with ``grad`` and return the update G^_t (a new tensor)."""
    grad = grad.to(buffer.dtype)
    buffer.mul_(momentum).add_(grad)
    if nesterov:
        return grad.add(buffer, alpha=momentum)
    return buffer.clone()
