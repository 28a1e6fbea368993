"""Rollout environments: the embedded verifiable tasks (single- and multi-turn), token-in /
token-out for the co-located engine, and ``verifiers`` environments (:mod:`.vf_env`).
:data:`ENVIRONMENTS` maps ``environment.kind`` to a factory ``(dataset name, EnvironmentConfig,
tokenizer) -> PromptSet`` (an :class:`Environment` for the token-level kinds); ``agentic`` environments (:mod:`.agentic_env`) are the embedded
agentic tasks' seeded instances played by real harnesses. The same tasks packaged as a
``verifiers`` v1 environment (reached over ``megatron-s2 serve``) are in :mod:`.vf_tasks`."""

from __future__ import annotations

from typing import Callable

from megatron_s2.posttrain.envs.base import Environment, Episode, EpisodeStep, PromptSet, Split
from megatron_s2.posttrain.envs.tasks import RetryTaskEnvironment, TaskEnvironment

__all__ = ["Environment", "Episode", "EpisodeStep", "PromptSet", "Split", "TaskEnvironment", "RetryTaskEnvironment",
           "ENVIRONMENTS", "build_environment"]


def _verifiers(name: str, config, tokenizer, what: str = "rollout.environment") -> PromptSet:
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment  # imports verifiers only when used

    return VerifiersEnvironment(name, config, tokenizer, what=what)


def _agentic(name: str, config, tokenizer, what: str = "rollout.environment") -> PromptSet:
    from megatron_s2.posttrain.envs.agentic_env import AgenticEnvironment  # the sandbox runtime only when used

    return AgenticEnvironment(name, config, tokenizer, what=what)


ENVIRONMENTS: dict[str, Callable] = {
    "task": TaskEnvironment,
    "task_retry": RetryTaskEnvironment,
    "verifiers": _verifiers,
    "agentic": _agentic,
}


def build_environment(name: str, config, tokenizer, what: str = "rollout.environment") -> PromptSet:
    """``what``: the recipe path of ``config`` (named in configuration errors)."""
    if config.kind in ("verifiers", "agentic"):
        return ENVIRONMENTS[config.kind](name, config, tokenizer, what)
    return ENVIRONMENTS[config.kind](name, config, tokenizer)
