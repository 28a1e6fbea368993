"""``rl.rollout`` / ``opd.rollout``: where rollouts come from and how the orchestrator paces them.

Report §5.2.1-5.2.2 and walkthrough Ch. 4: sample-level dispatch under an upper bound on
in-flight samples, per-dataset concurrency limits, optional discard of early-returned short
samples while the length distribution warms up, and a bound on staleness (policy versions
behind the learner) enforced by discarding or by masking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.posttrain.checks import positive
from megatron_s2.config.posttrain.environment import EnvironmentConfig, RolloutEngineConfig

__all__ = ["DatasetSlotConfig", "ShortSampleDiscardConfig", "RolloutConfig"]

_BACKEND = {"verifiers": "verifiers", "agentic": "agentic"}
"""Environment kind -> the rollout back end that plays it (the others: the engine's token-level one)."""


@dataclass(frozen=True)
class DatasetSlotConfig:
    """One prompt dataset of the rollout mixture."""

    name: str
    """Dataset name (an environment / task set the rollout backend knows)."""
    weight: float = 1.0
    """Relative probability of drawing the next prompt from this dataset (among those with room)."""
    max_in_flight: int = 0
    """Per-dataset concurrency limit in samples (report §5.2.2); 0 = only the global bound."""
    group_size: int = 0
    """Responses per prompt for this dataset; 0 = rollout.group_size."""
    domain: str = ""
    """OPD domain of its prompts (selects the teacher and lambda_d); '' = the dataset name."""
    environment: EnvironmentConfig | None = None
    """The environment of this dataset; None = rollout.environment."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name: every rollout dataset needs a name")
        positive("weight", self.weight)
        if self.max_in_flight < 0:
            raise ConfigError(f"max_in_flight: must be >= 0 (0 = no per-dataset limit), got {self.max_in_flight}")
        if self.group_size < 0:
            raise ConfigError(f"group_size: must be >= 0 (0 = rollout.group_size), got {self.group_size}")


@dataclass(frozen=True)
class ShortSampleDiscardConfig:
    """Warm-up discard of early-returned short samples (report §5.2.2)."""

    warmup_samples: int = 0
    """Completed samples (counted from the start of the run) during which short ones are discarded; 0 = off."""
    min_tokens: int = 0
    """A sample with fewer generated tokens than this is discarded during the warm-up and resampled."""

    def __post_init__(self) -> None:
        if self.warmup_samples < 0 or self.min_tokens < 0:
            raise ConfigError("warmup_samples / min_tokens: must be >= 0")
        if self.warmup_samples > 0 and self.min_tokens == 0:
            raise ConfigError("min_tokens: the warm-up discard is on (warmup_samples > 0) but min_tokens is 0; "
                              "set the length below which early samples are dropped")


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout source and orchestration."""

    source: Literal["policy", "teacher"] = "policy"
    """Who generates: 'policy' (on-policy / asynchronous RL and OPD) or 'teacher' (off-policy data
    such as OPD's SFT warm-up trajectories)."""
    group_size: int = 8
    """Responses per prompt (the GRPO group, G in Eq. 27); with effort levels it must equal
    len(effort.levels) * effort.samples_per_level."""
    max_in_flight: int = 64
    """Upper bound on samples submitted and not yet completed, held throughout (report §5.2.1)."""
    batch_groups: int = 8
    """Informative groups per training step (filtered groups are replaced, not counted)."""
    max_new_tokens: int = 256
    """Generation budget per response (per model call in multi-turn sessions)."""
    temperature: float = 1.0
    """Sampling temperature (the loss's temperature must match it)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    max_staleness: int = 3
    """Maximum policy versions a token may lag the learner (walkthrough: 3); -1 = unbounded."""
    staleness_action: Literal["discard", "mask"] = "discard"
    """'discard': a sample whose oldest token exceeds the bound is dropped and resampled;
    'mask': it is kept and its stale tokens are loss-masked (needs 'staleness' in loss.masks)."""
    resume_in_flight: Literal["restore", "discard"] = "restore"
    """On resume from a checkpoint, in-flight samples continue from their saved prefix (subject
    to the staleness rule) or are resampled from scratch."""
    datasets: tuple[DatasetSlotConfig, ...] = ()
    """Prompt datasets of the mixture; empty = one dataset taken from data: (named 'default')."""
    discard_short: ShortSampleDiscardConfig = field(default_factory=ShortSampleDiscardConfig)
    """Warm-up discard of early-returned short samples."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Environment of the default dataset (and of every dataset that names none)."""
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    """The co-located inference engine and the R3 / bounded-replay switches."""

    def __post_init__(self) -> None:
        for name in ("group_size", "max_in_flight", "batch_groups", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        positive("temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p: must lie in (0, 1], got {self.top_p}")
        if self.max_staleness < -1:
            raise ConfigError(f"max_staleness: must be >= 0, or -1 for unbounded; got {self.max_staleness}")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"datasets: duplicate dataset names in {names}")
        for d in self.datasets:
            size = self.group_of(d.name)
            if size > self.max_in_flight:
                raise ConfigError(f"max_in_flight: {self.max_in_flight} is below the group size {size} of dataset "
                                  f"'{d.name}'; a group could never be dispatched")
            if d.max_in_flight and d.max_in_flight < size:
                raise ConfigError(f"datasets.{d.name}.max_in_flight: {d.max_in_flight} is below its group size {size}")
        if self.group_size > self.max_in_flight:
            raise ConfigError(f"max_in_flight: {self.max_in_flight} is below group_size={self.group_size}")
        backends = {_BACKEND.get(self.environment_of(n).kind, "engine") for n in self.dataset_names()}
        if len(backends) > 1:
            raise ConfigError(f"datasets: the environments need different rollout back ends ({', '.join(sorted(backends))}: "
                              "verifiers, agentic and the token-level kinds each have their own); one back end per "
                              "run, so give every dataset an environment of the same family")
        renderers = {self.environment_of(n).renderer for n in self.dataset_names()}
        if self.uses_verifiers and len(renderers) > 1:
            raise ConfigError(f"datasets: the verifiers environments use different renderers {sorted(renderers)}; one "
                              "training client serves them all, so set the same environment.renderer everywhere")
        if self.engine.train_aware_replay:
            if self.served:
                raise ConfigError("engine.train_aware_replay: not supported with verifiers or agentic environments "
                                  "yet (their turns are not known in advance); turn train_aware_replay off")
            if self.resume_in_flight != "discard":
                raise ConfigError("resume_in_flight: with engine.train_aware_replay a sample resumed after a restart "
                                  "would be re-prefilled with a second replay boundary; set resume_in_flight: discard")
            multi = [n for n in self.dataset_names() if self.environment_of(n).multi_turn]
            if multi:
                raise ConfigError(f"engine.train_aware_replay: datasets {multi} are multi-turn (one replay boundary per "
                                  "turn); use single-turn environments or turn train_aware_replay off")

    @property
    def uses_verifiers(self) -> bool:
        """Rollouts come from verifiers environments (over the in-process server)."""
        return any(self.environment_of(n).kind == "verifiers" for n in self.dataset_names())

    @property
    def uses_agentic(self) -> bool:
        """Rollouts are harness episodes on the agentic tasks (over the in-process agent gateway)."""
        return any(self.environment_of(n).kind == "agentic" for n in self.dataset_names())

    @property
    def served(self) -> bool:
        """Episodes reach the engine over the in-process server (verifiers or agentic): no token-level
        episodes, no second evaluation engine."""
        return self.uses_verifiers or self.uses_agentic

    def environment_of(self, dataset: str) -> EnvironmentConfig:
        for d in self.datasets:
            if d.name == dataset and d.environment is not None:
                return d.environment
        return self.environment

    def dataset_names(self) -> list[str]:
        """The rollout datasets by name ('default' when ``datasets`` is empty)."""
        return [d.name for d in self.datasets] or ["default"]

    def group_of(self, dataset: str) -> int:
        for d in self.datasets:
            if d.name == dataset and d.group_size:
                return d.group_size
        return self.group_size
