"""Learning-rate schedule of report §4.2.2: linear warm-up, constant, cosine decay, constant tail.

With ``s`` the 0-based optimiser step about to be taken and ``eta`` = ``ScheduleConfig.lr``:

    s <  warmup_steps                      : eta * (s + 1) / warmup_steps
    warmup_steps <= s < decay_start_step   : eta
    decay_start_step <= s < decay_end_step : min_lr + (eta - min_lr) * (1 + cos(pi * t)) / 2,
                                             t = (s - decay_start_step) / (decay_end_step - decay_start_step)
    s >= decay_end_step                    : min_lr

The first step already moves (lr eta / warmup_steps) and the last warm-up step reaches eta. The
report states the phase boundaries in tokens (constant until 28T, decay until 40T at 100.6M
tokens per step): with ``decay_start_tokens`` / ``decay_end_tokens`` the boundaries are the
first steps by which that many tokens are trained (:func:`steps_for_tokens`, at
``tokens_per_step`` = global batch x sequence length). ``start_tokens`` shifts the whole
schedule for a phase that continues another one (the 1M-context extension starts at 34T):
its step 0 is schedule position ``steps_for_tokens(start_tokens)``.
"""

from __future__ import annotations

import math

from megatron_s2.config.optimizer import ScheduleConfig
from megatron_s2.config.schema import ConfigError

__all__ = ["LRSchedule", "steps_for_tokens"]


def steps_for_tokens(tokens: float, tokens_per_step: float) -> int:
    """First 0-based step before which at least ``tokens`` tokens have been trained on."""
    if tokens < 0 or tokens_per_step <= 0:
        raise ValueError(f"need tokens >= 0 and tokens_per_step > 0, got {tokens} and {tokens_per_step}")
    return math.ceil(tokens / tokens_per_step)


class LRSchedule:
    """``lr_at(step)`` of a :class:`ScheduleConfig`; ``apply`` writes it into an optimiser.

    ``tokens_per_step`` is needed when the config has token-based boundaries or start_tokens."""

    def __init__(self, cfg: ScheduleConfig, tokens_per_step: float | None = None) -> None:
        self.cfg = cfg
        uses_tokens = cfg.decay_start_tokens is not None or cfg.start_tokens > 0
        if uses_tokens and not tokens_per_step:
            raise ConfigError("schedule: token-based boundaries need the tokens per step "
                              "(training.global_batch_size x training.seq_length)")
        self.decay_start, self.decay_end = cfg.decay_start_step, cfg.decay_end_step
        if cfg.decay_start_tokens is not None:
            self.decay_start = steps_for_tokens(cfg.decay_start_tokens, tokens_per_step)
            self.decay_end = steps_for_tokens(cfg.decay_end_tokens, tokens_per_step)
            if self.decay_start < cfg.warmup_steps:
                raise ConfigError(f"schedule.decay_start_tokens: {cfg.decay_start_tokens:g} tokens are reached at step "
                                  f"{self.decay_start}, before the end of warm-up ({cfg.warmup_steps} steps)")
        self.offset = steps_for_tokens(cfg.start_tokens, tokens_per_step) if cfg.start_tokens > 0 else 0

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        step += self.offset
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if step < self.decay_start:
            return cfg.lr
        if step < self.decay_end:
            progress = (step - self.decay_start) / (self.decay_end - self.decay_start)
            return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr

    __call__ = lr_at

    def decay_started(self, step: int) -> bool:
        """Whether optimiser step ``step`` (0-based) is at or past the onset of the decay (the
        vision encoder unfreezes there, report §2.5)."""
        return step + self.offset >= self.decay_start

    def apply(self, optimizer, step: int) -> float:
        """Set ``optimizer``'s base learning rate (``set_lr``) for ``step``; return it."""
        lr = self.lr_at(step)
        optimizer.set_lr(lr)
        return lr
