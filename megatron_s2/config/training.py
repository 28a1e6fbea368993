"""Training-loop section of a recipe (``training:``): steps, batch geometry, seeds, run directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["TrainingConfig", "SEED_LIMIT"]

SEED_LIMIT = 2 ** 63
"""Seeds are non-negative 63-bit integers (what torch, numpy and the shuffles all accept)."""


@dataclass(frozen=True)
class TrainingConfig:
    run_dir: str = "runs/default"
    """Run directory (config.yaml, metrics.jsonl, checkpoints/); --run-dir overrides it."""
    train_steps: int = 100
    """Optimiser steps to run in total (a resumed run continues up to this step)."""
    global_batch_size: int = 8
    """Sequences per optimiser step, over all data-parallel replicas."""
    micro_batch_size: int = 2
    """Sequences per forward/backward pass on one replica."""
    seq_length: int = 64
    """Tokens per sequence."""
    seed: int = 1234
    """Seed for initialisation, data order and dropout-free sampling."""
    deterministic: bool = True
    """Deterministic algorithms on CPU (bit-identical resume)."""
    non_finite: Literal["stop", "skip"] = "stop"
    """A NaN/infinite loss or gradient norm: 'stop' the run before applying the update (the
    newest checkpoint stays the last good state), or 'skip' the update and go on."""
    non_finite_max_skips: int = 10
    """With non_finite=skip: consecutive skipped steps after which the run stops anyway."""
    freeze_vision_until_decay: bool = False
    """Report §2.5: keep the vision encoder (the family's ``vision_encoder_patterns``; V4.1: the
    tower's patch embedding and blocks) frozen — no gradient, no optimiser update, no weight
    decay — until the learning-rate decay starts (schedule.decay_start_step / decay_start_tokens),
    then train it from that exact step on. Its final norm, the aligner (projector) and the
    image-span embeddings train throughout."""
    memory_check: bool = True
    """Refuse to start when the per-rank memory plan (`megatron-s2 plan memory`) exceeds the
    memory this host offers each rank; false skips the check (e.g. where the plan is wrong)."""

    def __post_init__(self) -> None:
        for name in ("train_steps", "global_batch_size", "micro_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}: must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"training.global_batch_size: {self.global_batch_size} is not a multiple of "
                              f"micro_batch_size={self.micro_batch_size}")
        if self.non_finite_max_skips < 1:
            raise ConfigError(f"training.non_finite_max_skips: must be >= 1, got {self.non_finite_max_skips}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"training.seed: must be >= 0 and < 2**63, got {self.seed}; pick e.g. 1234")
        if not self.run_dir:
            raise ConfigError("training.run_dir: must not be empty")
