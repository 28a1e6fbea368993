"""Mixture-of-experts block of the V4.1-Flash backbone (report §2.1.1, §4.2.1, §4.2.2, §5.2.1).

Router (:mod:`.router`), token dispatcher (:mod:`.token_dispatcher`), experts
(:mod:`.experts`), load balancing (:mod:`.load_balancing`), routing record/replay
(:mod:`.routing_replay`), assembled by :class:`MoELayer` (:mod:`.moe_layer`).
"""

from megatron_s2.models.v41.moe.experts import GroupedExperts, SharedExpert, swiglu
from megatron_s2.models.v41.moe.load_balancing import (
    expert_bias_update,
    sequence_balance_loss,
    update_expert_biases,
)
from megatron_s2.models.v41.moe.moe_layer import MoELayer
from megatron_s2.models.v41.moe.router import SCORE_FUNCTIONS, RoutingDecision, TopKRouter
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay
from megatron_s2.parallel.token_dispatch import AllToAllTokenDispatcher, DispatchedTokens, DispatchState

__all__ = [
    "AllToAllTokenDispatcher",
    "DispatchState",
    "DispatchedTokens",
    "GroupedExperts",
    "MoELayer",
    "RoutingDecision",
    "RoutingMode",
    "RoutingReplay",
    "SCORE_FUNCTIONS",
    "SharedExpert",
    "TopKRouter",
    "expert_bias_update",
    "sequence_balance_loss",
    "swiglu",
    "update_expert_biases",
]
