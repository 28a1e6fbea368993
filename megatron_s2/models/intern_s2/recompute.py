"""Recompute in backward, keeping only the inputs: the Gated DeltaNet layer's cheap elementwise
stages (the causal convolution + SiLU, the gated RMSNorm) would otherwise keep several
intermediates of their width per token for backward (the convolution's padded input and
pre-activation, the norm's float32 copies, its normalised value, the gate's SiLU).

Unlike ``torch.utils.checkpoint`` (non-reentrant), the inputs are kept with ``save_for_backward``,
so ``saved_tensors_hooks`` (activation offloading, ``bench/hybrid_vs_full.py``'s accounting) see
them; the recomputation replays the same operations, so results and gradients are those of
plain autograd through ``fn``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["recomputed"]


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # autograd records nothing inside a Function's forward

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(needs) for t, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.enable_grad():
            outs = ctx.fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return (None, *(next(found) if t.requires_grad else None for t in inputs))


def recomputed(fn: Callable, *inputs: torch.Tensor):
    """``fn(*inputs)`` (tensors only; bind the rest with ``functools.partial``) whose backward
    re-runs ``fn`` instead of keeping its intermediates."""
    return _Recomputed.apply(fn, *inputs)
