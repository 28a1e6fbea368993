"""The ``rl:`` section: an RL algorithm as rollout source x advantage x loss.

Example (walkthrough Eq. 29 with LOO, GEPO and length regularisation, report §5.2 orchestration)::

    rl:
      rollout:   {group_size: 8, max_in_flight: 256, batch_groups: 32, max_staleness: 3,
                  staleness_action: discard}
      advantage: {estimator: leave_one_out, dynamic_sampling: true,
                  transforms: [gepo, length_regularization]}
      loss:      {terms: [{kind: policy_gradient}], eps_low: 0.2, eps_high: 0.28,
                  masks: [bkl], aggregation: token_mean}
      effort:    {levels: [], samples_per_level: 4}

Cross-section rules live here (each message names the field and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.posttrain.advantage import AdvantageConfig, EffortConfig
from megatron_s2.config.posttrain.disaggregated import DisaggregatedConfig
from megatron_s2.config.posttrain.loss import LossConfig
from megatron_s2.config.posttrain.environment import EvaluationConfig
from megatron_s2.config.posttrain.rollout import RolloutConfig

__all__ = ["RLConfig", "check_staleness_pairing"]


def check_staleness_pairing(section: str, rollout: RolloutConfig, loss: LossConfig) -> None:
    """staleness_action 'mask' and the 'staleness' token mask go together."""
    if rollout.staleness_action == "mask" and "staleness" not in loss.masks:
        raise ConfigError(f"{section}.loss.masks: rollout.staleness_action is 'mask', so add 'staleness' to "
                          "loss.masks (report §5.2.2) or set staleness_action: discard")
    if "staleness" in loss.masks and rollout.staleness_action != "mask":
        raise ConfigError(f"{section}.rollout.staleness_action: loss.masks has 'staleness'; set "
                          "staleness_action: mask (with 'discard' stale samples never reach the loss)")
    if "staleness" in loss.masks and rollout.max_staleness < 0:
        raise ConfigError(f"{section}.rollout.max_staleness: the staleness mask needs a bound >= 0")


@dataclass(frozen=True)
class RLConfig:
    """Reinforcement learning from verifiable rewards (walkthrough Ch. 4-7, report §5.1.4, §5.2)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Where rollouts come from and how they are paced."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """What the advantage is."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The shared loss."""
    effort: EffortConfig = field(default_factory=EffortConfig)
    """Effort-conditioned subgroups and length penalty (report §5.1.4); off when levels is empty."""
    reference_checkpoint: str = ""
    """Frozen reference for a 'reference_kl' term: a checkpoint directory; '' = the initial weights."""
    eval: EvaluationConfig = field(default_factory=EvaluationConfig)
    """Held-out verifiable accuracy with the rollout engine (before, during, after)."""
    mode: Literal["colocated", "disaggregated"] = "colocated"
    """'colocated': the rollout engine runs on the training ranks, time-shared (report §5.2.1);
    'disaggregated': inference servers, orchestrator and trainer are separate processes that only
    consume from each other (seed 004; ``megatron_s2.posttrain.disaggregated``)."""
    disaggregated: DisaggregatedConfig = field(default_factory=DisaggregatedConfig)
    """Servers and the off-policyness bound of ``mode: disaggregated``."""

    def __post_init__(self) -> None:
        if self.rollout.source != "policy":
            raise ConfigError("rl.rollout.source: RL samples from the policy; use 'policy' "
                              "(teacher-generated data belongs to opd.sft_warmup or SFT)")
        if not self.loss.has_term("policy_gradient"):
            raise ConfigError("rl.loss.terms: RL needs a 'policy_gradient' term (walkthrough Eq. 29)")
        if self.loss.has_term("full_vocab_kl"):
            raise ConfigError("rl.loss.terms: 'full_vocab_kl' needs a teacher; use the opd: section")
        check_staleness_pairing("rl", self.rollout, self.loss)
        if self.mode == "disaggregated":
            self._check_disaggregated()
        if self.effort.enabled and self.advantage.credit == "turn":
            raise ConfigError("rl.advantage.credit: 'turn' does not combine with effort levels (rl.effort.levels); "
                              "use credit: session")
        if self.effort.enabled:
            want = self.effort.group_size
            sizes = {self.rollout.group_size} | {self.rollout.group_of(d.name) for d in self.rollout.datasets}
            if sizes != {want}:
                raise ConfigError(f"rl.rollout.group_size: with effort levels {list(self.effort.levels)} x "
                                  f"{self.effort.samples_per_level} samples each, every group has {want} responses; "
                                  f"set group_size: {want} (got {sorted(sizes)})")
            if self.advantage.estimator == "leave_one_out" and self.effort.samples_per_level < 2:
                raise ConfigError("rl.effort.samples_per_level: leave-one-out advantages within an effort subgroup "
                                  "need at least 2 samples per level")
        elif self.advantage.estimator == "leave_one_out" and self.rollout.group_size < 2:
            raise ConfigError("rl.rollout.group_size: leave-one-out advantages need groups of at least 2")

    def _check_disaggregated(self) -> None:
        """What the disaggregated roles support today (each message names the field and the fix)."""
        k = self.disaggregated.max_async_level
        if self.rollout.max_staleness != k:
            raise ConfigError(f"rl.rollout.max_staleness: in disaggregated mode the staleness bound is "
                              f"rl.disaggregated.max_async_level ({k}); set max_staleness: {k} too")
        if self.reference_checkpoint or self.loss.has_term("reference_kl"):
            raise ConfigError("rl.loss.terms: a reference_kl term is not supported in disaggregated mode yet; "
                              "drop it or use mode: colocated")
        if self.rollout.engine.train_aware_replay:
            raise ConfigError("rl.rollout.engine.train_aware_replay: the servers run no decoder bounded replay; "
                              "turn it off in disaggregated mode")
