"""Configuration of the post-training phases: the ``rl:`` and ``opd:`` recipe sections.

Dataclasses in the style of :mod:`megatron_s2.config` (every field documented, ConfigError
naming the field and the fix, non-finite numbers rejected). Not yet wired into
:class:`~megatron_s2.config.recipe.RecipeConfig`; load a section with
``from_mapping(RLConfig, tree["rl"], "rl")``.
"""

from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig, SandboxConfig
from megatron_s2.config.posttrain.advantage import AdvantageConfig, EffortConfig, GepoConfig, LengthRegularizationConfig
from megatron_s2.config.posttrain.loss import LossConfig, LossTermConfig
from megatron_s2.config.posttrain.opd import OPDConfig, SftWarmupConfig, TeacherConfig
from megatron_s2.config.posttrain.rl import RLConfig
from megatron_s2.config.posttrain.rollout import DatasetSlotConfig, RolloutConfig, ShortSampleDiscardConfig

__all__ = [
    "AdvantageConfig", "EffortConfig", "GepoConfig", "LengthRegularizationConfig", "LossConfig", "LossTermConfig",
    "OPDConfig", "SftWarmupConfig", "TeacherConfig", "RLConfig", "DatasetSlotConfig", "RolloutConfig",
    "ShortSampleDiscardConfig", "SandboxConfig", "ProcessAnnotatorConfig",
]
