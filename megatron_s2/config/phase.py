"""Phase section of a recipe (``phase:``): what is being trained and with which loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.next_patch import VisualNextPatchConfig
from megatron_s2.config.schema import ConfigError

__all__ = ["PhaseConfig"]


@dataclass(frozen=True)
class PhaseConfig:
    kind: Literal["pretrain", "sft", "rl", "opd", "dspark", "contrastive", "visual_next_patch"] = "pretrain"
    """pretrain: loss on every token; sft: loss only on answer tokens (prompt masked); rl:
    reinforcement learning from verifiable rewards (the recipe's ``rl:`` section); opd: on-policy
    distillation (the ``opd:`` section). rl and opd roll out with the inference engine on the
    training ranks (megatron_s2/posttrain/trainer.py). dspark: the stage after pre-training that
    trains only the DSpark drafter on the frozen backbone's own distributions (V4.1 report
    §2.4.3); the backbone is frozen and not stored in the optimiser. contrastive: SigLIP pre-training
    of the vision encoder over image-text pairs with a small text tower (report §4.2.2; the
    optional ``contrastive:`` section, megatron_s2/training/contrastive_trainer.py); the vision
    encoder is stored under the ``vision.*`` names of the model's encoder. visual_next_patch:
    continued pre-training on text and rendered pages together, the pages' contrastive next-patch
    loss added to the text loss (Intern-S2 walkthrough Ch. 3, Eq. 5-9; settings in ``next_patch``)."""
    freeze: tuple[str, ...] = ()
    """Parameter-name globs frozen in this phase (e.g. the backbone while training a drafter)."""
    train_drafter: bool = False
    """Co-train the model's DSpark drafter in a pretrain / sft phase (§2.4.3: "we continue to train
    DSpark alongside the backbone, without propagating gradients from the DSpark objective into
    the backbone"); implied by ``kind: dspark``."""
    drafter_eta: float = 3.0
    """eta of the drafter's hybrid LK loss schedule lambda_k = exp(-eta * acceptance_k)
    (Intern-S2 walkthrough Eq. 23)."""
    drafter_temperature: float = 1.0
    """Temperature at which the drafter's distributions are matched to the policy's."""

    next_patch: VisualNextPatchConfig = field(default_factory=VisualNextPatchConfig)
    """Visual next-patch pre-training (``kind: visual_next_patch``): loss weights, temperature,
    page rendering and chunking (megatron_s2/config/next_patch.py)."""

    def __post_init__(self) -> None:
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError("phase.freeze: duplicate patterns")
        if self.drafter_eta < 0:
            raise ConfigError(f"phase.drafter_eta: must be >= 0, got {self.drafter_eta}")
        if not self.drafter_temperature > 0:
            raise ConfigError(f"phase.drafter_temperature: must be positive, got {self.drafter_temperature}")

    @property
    def trains_drafter(self) -> bool:
        return self.kind == "dspark" or self.train_drafter
