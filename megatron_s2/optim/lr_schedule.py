"""Learning-rate schedule of report §4.2.2: linear warm-up, constant, cosine decay, constant tail.

With ``s`` the 0-based optimiser step about to be taken and ``eta`` = ``ScheduleConfig.lr``:

    s <  warmup_steps                      : eta * (s + 1) / warmup_steps
    warmup_steps <= s < decay_start_step   : eta
    decay_start_step <= s < decay_end_step : min_lr + (eta - min_lr) * (1 + cos(pi * t)) / 2,
                                             t = (s - decay_start_step) / (decay_end_step - decay_start_step)
    s >= decay_end_step                    : min_lr

The first step already moves (lr eta / warmup_steps) and the last warm-up step reaches eta. The
report states the phase boundaries in tokens (constant until 28T, decay until 40T at 100.6M
tokens per step); :func:`steps_for_tokens` converts them.
"""

from __future__ import annotations

import math

from megatron_s2.config.optimizer import ScheduleConfig

__all__ = ["LRSchedule", "steps_for_tokens"]


def steps_for_tokens(tokens: float, tokens_per_step: float) -> int:
    """First 0-based step before which at least ``tokens`` tokens have been trained on."""
    if tokens < 0 or tokens_per_step <= 0:
        raise ValueError(f"need tokens >= 0 and tokens_per_step > 0, got {tokens} and {tokens_per_step}")
    return math.ceil(tokens / tokens_per_step)


class LRSchedule:
    """``lr_at(step)`` of a :class:`ScheduleConfig`; ``apply`` writes it into an optimiser."""

    def __init__(self, cfg: ScheduleConfig) -> None:
        self.cfg = cfg

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if step < cfg.decay_start_step:
            return cfg.lr
        if step < cfg.decay_end_step:
            progress = (step - cfg.decay_start_step) / (cfg.decay_end_step - cfg.decay_start_step)
            return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr

    __call__ = lr_at

    def apply(self, optimizer, step: int) -> float:
        """Set ``optimizer``'s base learning rate (``set_lr``) for ``step``; return it."""
        lr = self.lr_at(step)
        optimizer.set_lr(lr)
        return lr
