"""Non-finite losses and gradients: detect them before the update, stop or skip as configured.

A NaN or infinite loss or gradient norm, once applied, makes every parameter non-finite and
every later checkpoint useless. :class:`NonFiniteGuard` looks at the step's loss and global
gradient norm after the backward pass and before the optimiser:

* ``training.non_finite: stop`` (default) — raise :class:`NonFiniteStep`: the update is not
  applied and no checkpoint is written, so the newest checkpoint is the last good state;
* ``training.non_finite: skip`` — drop the step's gradients and MoE load counts, apply no
  update, count the step as taken (its data is consumed), log it; more than
  ``training.non_finite_max_skips`` consecutive skips stop the run as above.

The decision needs no collective: the loss is all-reduced over data, context and pipeline
ranks and the gradient norm over the world before they reach the guard, and a NaN survives
every sum, so every rank sees the same verdict.

:func:`tensors_finite` is the checkpoint's side of the rule (a checkpoint is never committed
with a non-finite tensor; ``checkpoint verify`` reports one).
"""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["NonFiniteGuard", "NonFiniteStep", "TrainingHalted", "first_non_finite", "tensors_finite"]


class TrainingHalted(RuntimeError):
    """The run stopped itself for a reason stated in one line (exit code 1, no traceback)."""

    exit_code = 1


class NonFiniteStep(TrainingHalted):
    """A step's loss or gradient norm was NaN or infinite (see :class:`NonFiniteGuard`)."""


class NonFiniteGuard:
    def __init__(self, policy: str, max_skips: int, log=print) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"non_finite policy must be 'stop' or 'skip', got {policy!r}")
        self.policy, self.max_skips, self.log = policy, max_skips, log
        self.consecutive = 0
        self.skipped = 0

    def admit(self, step: int, loss: float | None, grad_norm: float) -> bool:
        """True when step ``step`` (1-based) may be applied; False to skip it; raises
        :class:`NonFiniteStep` to stop."""
        values = {"loss": loss, "gradient norm": grad_norm}
        bad = {k: v for k, v in values.items() if v is not None and not math.isfinite(v)}
        if not bad:
            self.consecutive = 0
            return True
        what = " and ".join(f"{k} {v}" for k, v in bad.items())
        if self.policy == "skip" and self.consecutive < self.max_skips:
            self.consecutive += 1
            self.skipped += 1
            self.log(f"step {step}: {what}: update skipped ({self.consecutive} in a row, at most "
                     f"{self.max_skips}; training.non_finite=skip)")
            return False
        why = (f"{self.consecutive + 1} steps in a row" if self.policy == "skip" else "training.non_finite=stop")
        raise NonFiniteStep(f"step {step}: {what} ({why}); stopped before applying the update, so the newest "
                            "checkpoint holds the last good state: resume from it with a lower schedule.lr or "
                            "optimizer.clip_grad, or set training.non_finite=skip to skip such steps")


def first_non_finite(named_tensors: Iterable[tuple[str, object]]) -> str | None:
    """Name of the first floating tensor holding a NaN or infinity, or None."""
    import torch

    for name, tensor in named_tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            if not bool(torch.isfinite(tensor).all()):
                return name
    return None


def tensors_finite(tensors: Iterable[object]) -> bool:
    return first_non_finite((str(i), t) for i, t in enumerate(tensors)) is None
