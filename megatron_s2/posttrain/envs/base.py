"""What a rollout environment is to the trainer: prompts, and episodes that score responses.

Every rollout kind has a :class:`PromptSet`: two fixed prompt sets — ``train`` (what the
orchestrator reads in per-epoch shuffles, :class:`~megatron_s2.posttrain.orchestrator.PromptSource`)
and ``eval`` (held out, never trained on). An :class:`Environment` is a prompt set whose episodes
the engine back ends play in process: it opens an :class:`Episode` per rollout sample. An episode
is token-in/token-out (walkthrough Ch. 6): it hands the engine the token ids of each model call's
context and receives exactly the ids the engine generated; between calls it may append its own
tokens (feedback, tool results), which the session assembly loss-masks. It ends with a reward.
The verifiers and agentic kinds are prompt sets only: their episodes are harness sessions run by
their own back ends (:mod:`~megatron_s2.posttrain.rollout.vf_backend`,
:mod:`~megatron_s2.posttrain.rollout.agentic_backend`), so they have no :meth:`Environment.episode`
to call, rather than one that raises.

Episodes are deterministic functions of (prompt, completions), so every rank of a rollout
replica that runs the same requests takes the same decisions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = ["Split", "Episode", "Environment", "EpisodeStep", "PromptSet"]

Split = Literal["train", "eval"]


@dataclass
class EpisodeStep:
    """The environment's answer to one model call."""

    done: bool
    """The episode is over (``reward`` is set)."""
    delta: list[int]
    """Tokens the environment appends before the next model call (empty when done)."""
    reward: float | None = None
    """Verifier reward once done."""
    correct: bool | None = None
    """Whether the final answer verified (accuracy metric), when the environment knows."""


class Episode(ABC):
    """One rollout of one prompt."""

    @abstractmethod
    def prompt_tokens(self) -> list[int]:
        """Token ids of the first model call's context."""

    @abstractmethod
    def step(self, completion: Sequence[int], finish_reason: str) -> EpisodeStep:
        """The engine generated ``completion`` (exact ids, ending with eos unless the length limit
        stopped it); decide what happens next."""


class PromptSet(ABC):
    """The train and held-out prompts of one data set (see the module docstring)."""

    name: str
    max_turns: int = 1

    @abstractmethod
    def size(self, split: Split) -> int:
        """Number of prompts of ``split``."""

    @abstractmethod
    def prompt_tokens(self, index: int, effort: int | None = None) -> list[int]:
        """Token ids of the first model call's context of training prompt ``index``."""

    @abstractmethod
    def longest_prompt_from(self, limit: int, split: Split = "train", efforts: Sequence[int | None] = (None,)) -> int:
        """Tokens of the longest first-turn prompt of ``split`` (at each of ``efforts``) when it has
        ``limit`` tokens or more, else 0 — the start-up check that every prompt leaves the engine
        room to generate."""

    # ---- PromptSource (orchestrator) ----------------------------------------------------------
    def __len__(self) -> int:
        return self.size("train")


class Environment(PromptSet):
    """A prompt set with a verifier whose episodes are token-level (module docstring)."""

    @abstractmethod
    def episode(self, index: int, split: Split = "train", effort: int | None = None) -> Episode:
        """A fresh episode of prompt ``index`` of ``split``."""

    def prompt_tokens(self, index: int, effort: int | None = None) -> list[int]:
        return self.episode(index, "train", effort).prompt_tokens()

    def longest_prompt_from(self, limit: int, split: Split = "train", efforts: Sequence[int | None] = (None,)) -> int:
        """As :meth:`PromptSet.longest_prompt_from`. This default tokenizes every prompt;
        environments with many prompts override it with a cheaper bound."""
        longest = max((len(self.episode(i, split, e).prompt_tokens()) for i in range(self.size(split))
                       for e in efforts), default=0)
        return longest if longest >= limit else 0
