"""Rollout environments: the embedded verifiable tasks (single- and multi-turn) and their
``verifiers`` packaging. :data:`ENVIRONMENTS` maps ``environment.kind`` to a factory
``(dataset name, EnvironmentConfig, tokenizer) -> Environment``."""

from __future__ import annotations

from typing import Callable

from megatron_s2.posttrain.envs.base import Environment, Episode, EpisodeStep, Split
from megatron_s2.posttrain.envs.tasks import RetryTaskEnvironment, TaskEnvironment

__all__ = ["Environment", "Episode", "EpisodeStep", "Split", "TaskEnvironment", "RetryTaskEnvironment",
           "ENVIRONMENTS", "build_environment"]


def _verifiers(name, config, tokenizer):
    from megatron_s2.posttrain.envs.verifiers_env import VerifiersTaskEnvironment

    return VerifiersTaskEnvironment(name, config, tokenizer)


ENVIRONMENTS: dict[str, Callable] = {
    "task": TaskEnvironment,
    "task_retry": RetryTaskEnvironment,
    "verifiers": _verifiers,
}


def build_environment(name: str, config, tokenizer) -> Environment:
    return ENVIRONMENTS[config.kind](name, config, tokenizer)
