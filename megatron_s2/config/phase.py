"""Phase section of a recipe (``phase:``): what is being trained and with which loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["PhaseConfig"]


@dataclass(frozen=True)
class PhaseConfig:
    kind: Literal["pretrain", "sft", "rl", "opd"] = "pretrain"
    """pretrain: loss on every token; sft: loss only on answer tokens (prompt masked); rl:
    reinforcement learning from verifiable rewards (the recipe's ``rl:`` section); opd: on-policy
    distillation (the ``opd:`` section). rl and opd roll out with the inference engine on the
    training ranks (megatron_s2/posttrain/trainer.py)."""
    freeze: tuple[str, ...] = ()
    """Parameter-name globs frozen in this phase (e.g. the backbone while training a drafter)."""

    def __post_init__(self) -> None:
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError("phase.freeze: duplicate patterns")
