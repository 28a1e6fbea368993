"""Advantage estimators and transforms (walkthrough Ch. 5 and 7, report §5.1.4); composition in
:mod:`.pipeline` (Eq. 28)."""

from megatron_s2.posttrain.advantages.effort import (
    EFFORT_PROMPT,
    EFFORT_TIERS,
    effort_instruction,
    length_penalty,
    penalty_coefficient,
    tier_effort,
    with_effort,
)
from megatron_s2.posttrain.advantages.gepo import batch_thresholds, gepo_rebalance, group_entropy
from megatron_s2.posttrain.advantages.group import (
    GROUP_ESTIMATORS,
    group_mean_advantages,
    is_informative,
    leave_one_out_advantages,
    register_group_estimator,
    std_normalize,
)
from megatron_s2.posttrain.advantages.length import adaptive_length_regularization, length_weights
from megatron_s2.posttrain.advantages.pipeline import (
    ADVANTAGE_TRANSFORMS,
    AdvantagePipeline,
    GroupAdvantages,
    GroupRollouts,
)
from megatron_s2.posttrain.advantages.session_credit import (
    labelled_segment_advantages,
    segment_advantages,
    token_advantages,
    turn_group_advantages,
    turn_segment_advantages,
)

__all__ = [
    "EFFORT_PROMPT", "EFFORT_TIERS", "effort_instruction", "length_penalty", "penalty_coefficient", "tier_effort",
    "with_effort", "batch_thresholds", "gepo_rebalance", "group_entropy", "GROUP_ESTIMATORS",
    "group_mean_advantages", "is_informative", "leave_one_out_advantages", "register_group_estimator",
    "std_normalize", "adaptive_length_regularization", "length_weights", "ADVANTAGE_TRANSFORMS",
    "AdvantagePipeline", "GroupAdvantages", "GroupRollouts", "segment_advantages", "labelled_segment_advantages",
    "token_advantages", "turn_group_advantages", "turn_segment_advantages",
]
