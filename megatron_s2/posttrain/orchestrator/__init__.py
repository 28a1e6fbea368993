"""Rollout orchestration for co-located asynchronous RL / OPD (report §5.2.1-5.2.3)."""

from megatron_s2.posttrain.orchestrator.backend import PromptSource, RolloutBackend, SampleRequest
from megatron_s2.posttrain.orchestrator.dispatch import PromptCursor, choose_dataset, sample_seed
from megatron_s2.posttrain.orchestrator.orchestrator import Orchestrator, PromptGroup, RolloutOutcomes
from megatron_s2.posttrain.orchestrator.sample import RolloutSample

__all__ = ["PromptSource", "RolloutBackend", "SampleRequest", "PromptCursor", "choose_dataset", "sample_seed",
           "Orchestrator", "PromptGroup", "RolloutOutcomes", "RolloutSample"]
