"""Checkpoint section of a recipe (``checkpoint:``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True)
class CheckpointConfig:
    save_interval: int = 0
    """Save every N optimiser steps (and at the end of the run); 0 saves only at the end."""
    save_at_end: bool = True
    """Save a final checkpoint when the run completes."""
    keep_last: int = 3
    """Committed checkpoints to keep; the newest valid one is never deleted."""
    resume: bool = True
    """Resume from the newest valid checkpoint in the run directory when there is one."""
    load: str = ""
    """Initialise from this checkpoint (a step directory or a checkpoints/ directory) when not resuming."""
    load_optimizer: bool = True
    """Also restore optimiser/schedule/data state from ``load`` (false for a new phase)."""
    load_only: tuple[str, ...] = ()
    """Take only the model tensors under these name prefixes from ``load`` (the rest of the model
    starts from its initialisation, the rest of the checkpoint is left behind), e.g.
    ``[vision.]``: keep the vision encoder of an earlier phase and discard its LLM or text tower
    (report §4.2.2). Empty: everything, except that a contrastive phase's checkpoint always
    hands on only ``vision.*``. Needs ``load_optimizer: false``; no effect without ``load``
    (a pipeline phase gets it from the previous phase)."""
    async_save: bool = False
    """Write checkpoints from a background thread after a synchronous snapshot."""

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError("checkpoint.save_interval: must be >= 0")
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last: must keep at least 1 checkpoint")
        if self.load_only and self.load and self.load_optimizer:  # (a pipeline phase gets load later)
            raise ConfigError("checkpoint.load_only: takes part of the model of checkpoint.load without its optimiser "
                              "state; set checkpoint.load_optimizer: false")
        if any(not prefix for prefix in self.load_only):
            raise ConfigError("checkpoint.load_only: empty prefix; give name prefixes such as 'vision.'")
