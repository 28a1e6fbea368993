"""Warm-up / constant / cosine / constant-tail schedule of report §4.2.2."""

from __future__ import annotations

import math

import pytest

from megatron_s2.config.optimizer import ScheduleConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.optim import LRSchedule, steps_for_tokens


def test_phase_boundaries():
    schedule = LRSchedule(ScheduleConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_start_step=10, decay_end_step=20))
    assert [schedule.lr_at(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert schedule.lr_at(9) == 1.0          # last constant step
    assert schedule.lr_at(10) == 1.0         # cosine starts at the peak
    assert schedule.lr_at(15) == pytest.approx(0.55)  # half-way: (lr + min_lr) / 2
    assert schedule.lr_at(19) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(0.9 * math.pi)))
    assert schedule.lr_at(20) == 0.1 and schedule.lr_at(10**9) == 0.1
    decay = [schedule(s) for s in range(4, 25)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_no_warmup_and_no_decay():
    schedule = LRSchedule(ScheduleConfig(lr=3e-4, min_lr=3e-4, warmup_steps=0, decay_start_step=5, decay_end_step=5))
    assert [schedule.lr_at(s) for s in (0, 4, 5, 100)] == [3e-4] * 4


def test_report_schedule():
    # §4.2.2: 2000 warm-up steps to 2.6e-4, constant until 28T tokens, cosine to 2.6e-5 at 40T,
    # 100.6M tokens per step.
    cfg = ScheduleConfig()
    tokens_per_step = 100.6e6
    assert cfg.decay_start_step == steps_for_tokens(28e12, tokens_per_step) == 278331
    assert cfg.decay_end_step == steps_for_tokens(40e12, tokens_per_step) == 397615
    schedule = LRSchedule(cfg)
    assert schedule.lr_at(0) == pytest.approx(2.6e-4 / 2000)
    assert schedule.lr_at(1999) == pytest.approx(2.6e-4)
    assert schedule.lr_at(cfg.decay_start_step - 1) == 2.6e-4
    assert schedule.lr_at(cfg.decay_end_step) == 2.6e-5
    assert schedule.lr_at(steps_for_tokens(45e12, tokens_per_step)) == 2.6e-5


def test_steps_for_tokens_is_the_first_step_past_the_budget():
    assert steps_for_tokens(100, 10) == 10
    assert steps_for_tokens(101, 10) == 11
    with pytest.raises(ValueError):
        steps_for_tokens(1, 0)


class _RecordingOptimizer:
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def set_lr(self, base_lr: float) -> None:
        self.lrs.append(base_lr)


def test_apply_sets_the_optimizer_base_lr():
    schedule = LRSchedule(ScheduleConfig(lr=1.0, min_lr=0.0, warmup_steps=2, decay_start_step=2, decay_end_step=4))
    opt = _RecordingOptimizer()
    assert schedule.apply(opt, 0) == 0.5
    schedule.apply(opt, 3)
    assert opt.lrs == [0.5, 0.5]  # 0.5 (warm-up), then the cosine midpoint 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), "lr: must be positive"),
    (dict(min_lr=1.0, lr=0.5), "min_lr: must be in"),
    (dict(warmup_steps=-1), "warmup_steps: must be non-negative"),
    (dict(warmup_steps=10, decay_start_step=5, decay_end_step=20), "decay_start_step: 5 is before the end of warm-up"),
    (dict(warmup_steps=0, decay_start_step=20, decay_end_step=10), "decay_end_step: 10 is before decay_start_step=20"),
    (dict(warmup_steps=0, decay_start_step=10, decay_end_step=10), "decay_end_step: equals decay_start_step"),
])
def test_validation_names_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ScheduleConfig(**kwargs)


def test_negative_step_is_an_error():
    with pytest.raises(ValueError, match="step"):
        LRSchedule(ScheduleConfig()).lr_at(-1)


def test_token_based_boundaries_follow_the_report():
    """§4.2.2: 100.6M tokens per step (1536 x 64K), warm-up 2000 steps, constant 2.6e-4 until
    28T tokens, cosine to 2.6e-5 by 40T; the 1M extension continues the schedule from 34T."""
    from megatron_s2.config.schema import ConfigError

    tokens_per_step = 1536 * 65536
    cfg = ScheduleConfig(decay_start_tokens=28e12, decay_end_tokens=40e12)
    schedule = LRSchedule(cfg, tokens_per_step=tokens_per_step)
    start, end = schedule.decay_start, schedule.decay_end
    assert (start - 1) * tokens_per_step < 28e12 <= start * tokens_per_step
    assert (end - 1) * tokens_per_step < 40e12 <= end * tokens_per_step
    assert schedule.lr_at(1999) == 2.6e-4 and schedule.lr_at(start - 1) == 2.6e-4
    assert schedule.lr_at(end) == pytest.approx(2.6e-5) and schedule.lr_at(end + 10 ** 5) == pytest.approx(2.6e-5)
    assert schedule.lr_at((start + end) // 2) == pytest.approx((2.6e-4 + 2.6e-5) / 2, rel=1e-4)
    extension = LRSchedule(ScheduleConfig(decay_start_tokens=28e12, decay_end_tokens=40e12, start_tokens=34e12),
                           tokens_per_step=96 * (1 << 20))  # 1M context, same 100.6M-token batch
    at_34t = -(-int(34e12) // tokens_per_step)
    assert extension.lr_at(0) == schedule.lr_at(at_34t)
    with pytest.raises(ConfigError, match="token-based boundaries need the tokens per step"):
        LRSchedule(cfg)
    with pytest.raises(ConfigError, match="give both decay_start_tokens and decay_end_tokens"):
        ScheduleConfig(decay_start_tokens=1e9)
