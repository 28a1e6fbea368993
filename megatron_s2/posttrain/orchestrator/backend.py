"""What the orchestrator needs from a rollout engine, and from prompt datasets.

:class:`RolloutBackend` is the seam the inference engine (``megatron_s2/inference``: continuous
batching, per-token log-probs and policy versions, token-level pause/resume, per-token MoE
routing records) implements for co-located asynchronous RL (report §5.2.1-5.2.3). It is a
protocol so that the orchestrator's logic is tested against a deterministic simulated engine
before the real one exists; the engine is expected to:

* ``submit`` sample requests (a prompt group, or single replacements); a request with
  ``resume_from`` continues that partial sample from its prefix (tokens, log-probs, versions
  and routing kept; the engine re-prefills or reuses its persisted KV);
* ``poll`` return the samples completed since the last poll — token ids exactly as generated,
  behaviour log-probs, per-token versions, the concatenated routing record of the positions
  fed, finish reason, and the verifier reward when the environment scores it;
* ``pause`` stop every in-flight sample at a token boundary (their KV and routing persist);
  ``update_weights(version)`` switch to the learner's new weights (tokens generated afterwards
  carry ``version``); ``resume`` continue every paused sample exactly where it stopped;
* ``snapshot`` return the partial state of the paused in-flight samples (for staleness checks
  and crash-safe checkpoints), ``abort`` drop in-flight samples and free their state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from megatron_s2.posttrain.orchestrator.sample import RolloutSample

__all__ = ["SampleRequest", "RolloutBackend", "PromptSource"]


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate."""

    sample_id: int
    """Unique id; the completed sample carries it."""
    group_id: int
    """The prompt group it belongs to."""
    prompt_uid: str
    """dataset:epoch:index of the prompt."""
    dataset: str
    """Dataset (environment) the prompt comes from; the environment scores with it."""
    index: int
    """Index of the prompt in its dataset."""
    prompt_tokens: tuple[int, ...]
    """Rendered prompt token ids (with the effort instruction when effort levels are on)."""
    seed: int
    """Sampling seed of this attempt."""
    max_new_tokens: int
    """Generation budget."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus threshold."""
    effort: int | None = None
    """Effort level b (report §5.1.4), or None."""
    resume_from: RolloutSample | None = None
    """Continue this partial sample (restored after a restart) instead of starting afresh."""


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout engine co-located with training (see the module docstring for the contract)."""

    @property
    def policy_version(self) -> int: ...

    def submit(self, requests: Sequence[SampleRequest]) -> None: ...

    def poll(self) -> list[RolloutSample]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, version: int) -> None: ...

    def snapshot(self) -> list[RolloutSample]: ...

    def abort(self, sample_ids: Sequence[int]) -> None: ...


@runtime_checkable
class PromptSource(Protocol):
    """A prompt dataset: a fixed-length sequence of prompts, rendered to token ids on demand."""

    def __len__(self) -> int: ...

    def prompt_tokens(self, index: int, effort: int | None) -> list[int]:
        """Token ids of prompt ``index``, rendered with the effort instruction for ``effort``."""
        ...
