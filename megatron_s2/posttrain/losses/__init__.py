"""Post-training losses: importance weights (Eq. 10-11), token masks (Eq. 12-13, §5.2.2), terms
(Eq. 29), aggregation, and their composition (:mod:`.objective`)."""

from megatron_s2.posttrain.losses.aggregation import aggregation_weights
from megatron_s2.posttrain.losses.importance import log_importance_ratio, truncated_importance_weight
from megatron_s2.posttrain.losses.masks import binary_kl, binary_tv, bkl_mask, ratio_mask, staleness_mask, tv_mask
from megatron_s2.posttrain.losses.objective import TOKEN_MASKS, ObjectiveResult, PosttrainObjective, register_token_mask
from megatron_s2.posttrain.losses.terms import (
    LOSS_TERMS,
    LossInputs,
    policy_gradient_token_loss,
    reference_kl_token,
    register_loss_term,
)

__all__ = [
    "aggregation_weights", "log_importance_ratio", "truncated_importance_weight", "binary_kl", "binary_tv",
    "bkl_mask", "ratio_mask", "staleness_mask", "tv_mask", "TOKEN_MASKS", "ObjectiveResult", "PosttrainObjective",
    "register_token_mask", "LOSS_TERMS", "LossInputs", "policy_gradient_token_loss", "reference_kl_token",
    "register_loss_term",
]
