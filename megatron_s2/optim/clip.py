"""Global gradient-norm clipping in float32 (the ``clip_grad`` of :class:`OptimizerConfig`).

The norm is accumulated in float32 whatever the gradient dtype, in the fixed order of
``params``, so it is bit-reproducible on CPU. With ``process_group`` the squared norm is
summed over that group (e.g. the model-parallel ranks); the caller passes each parameter's
gradient on exactly one rank of the group, so replicated parameters are not counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients so their global l2 norm is at most ``max_norm``; return the norm before.

    Returns a float32 scalar tensor. ``max_norm = 0`` only measures. A non-finite norm leaves
    the gradients untouched, so the caller can detect it and skip the step.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be non-negative (0 disables clipping), got {max_norm}")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device="cpu")  # nothing to measure
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads])
    total_sq = norms.square().sum()
    if process_group is not None:
        dist.all_reduce(total_sq, group=process_group)
    total = total_sq.sqrt()
    if max_norm > 0 and torch.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return total
