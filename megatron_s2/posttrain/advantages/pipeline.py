"""From verifier rewards to per-response advantages, composed from the recipe (walkthrough Eq. 28).

The composition (``rl.advantage`` and ``rl.effort``), in order:

1. **Effort length deduction** (report §5.1.4, Eq. 9) added to each reward when effort levels
   are configured; responses are split into (prompt, effort) *subgroups* (Eq. 8).
2. **DAPO dynamic sampling**: a (sub)group whose rewards are all identical is dropped
   (``keep`` False; the orchestrator replaces it with newly sampled prompts).
3. The **group estimator** from :data:`GROUP_ESTIMATORS` (``leave_one_out`` Eq. 27 or
   ``group_mean``), optionally divided by the group's reward std.
4. The **transforms**, in the listed order, from :data:`ADVANTAGE_TRANSFORMS`: ``gepo``
   (Eq. 25-26) and ``length_regularization`` (Eq. 14-17). **Eq. 28** fixes GEPO before
   length: the length weights then act on the final entropy-adjusted advantages and their
   normaliser preserves the post-GEPO positive mass (the config enforces the order).

Each response ends with one scalar shared by all its policy tokens (sessions: see
:mod:`.session_credit` for Eq. 30's per-segment weights on top) — or, with ``credit: turn``, one
per assistant turn (:attr:`GroupAdvantages.turn_advantages`, from the environment's per-turn
rewards; the groups kept by dynamic sampling are the same).
"""

from __future__ import annotations

import abc

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from megatron_s2.posttrain.advantages.effort import length_penalty
from megatron_s2.posttrain.advantages.gepo import batch_thresholds, gepo_rebalance, group_entropy
from megatron_s2.posttrain.advantages.group import GROUP_ESTIMATORS, as_rewards, is_informative, std_normalize
from megatron_s2.posttrain.advantages.length import adaptive_length_regularization
from megatron_s2.posttrain.advantages.session_credit import turn_group_advantages

if TYPE_CHECKING:
    from megatron_s2.config.posttrain.advantage import AdvantageConfig, EffortConfig

__all__ = ["GroupRollouts", "GroupAdvantages", "AdvantagePipeline", "ADVANTAGE_TRANSFORMS"]


@dataclass(frozen=True)
class GroupRollouts:
    """What the advantage needs from one prompt group (one entry per response)."""

    rewards: Sequence[float]
    """Verifier reward of each response."""
    lengths: Sequence[int]
    """Reasoning / response token count of each response (length regularisation, effort penalty)."""
    logprob_sums: Sequence[float] | None = None
    """Sum over the response's tokens of the behaviour log-probability (GEPO's Eq. 25)."""
    efforts: Sequence[int] | None = None
    """Effort level b of each response (report Eq. 8 subgroups), or None without effort conditioning."""
    turn_rewards: Sequence[Sequence[float]] | None = None
    """Per response: the reward of each of its assistant turns (``credit: turn``), or None."""

    @classmethod
    def from_samples(cls, samples: Sequence) -> "GroupRollouts":
        """From rollout samples (anything with ``reward``, ``num_generated``, ``logprob_sum`` and
        ``effort``, e.g. :class:`~megatron_s2.posttrain.orchestrator.RolloutSample`). The length
        is the number of generated tokens (all of them count as reasoning tokens here)."""
        efforts = [s.effort for s in samples]
        if any(e is None for e in efforts):
            if any(e is not None for e in efforts):
                raise ValueError("a group mixes samples with and without effort levels")
            efforts = None
        turns = [list(getattr(s, "turn_rewards", None) or []) for s in samples]
        return cls([float(s.reward) for s in samples], [int(s.num_generated) for s in samples],
                   [float(s.logprob_sum) for s in samples], efforts,
                   turns if any(turns) else None)

    def __post_init__(self) -> None:
        n = len(self.rewards)
        for name in ("lengths", "logprob_sums", "efforts", "turn_rewards"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"GroupRollouts.{name}: {len(value)} entries for {n} rewards")


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor
    """[G] float64 advantage of each response (0 where not kept)."""
    keep: torch.Tensor
    """[G] bool: False for responses of a subgroup dropped by dynamic sampling."""
    shaped_rewards: torch.Tensor
    """[G] rewards after the effort length deduction."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    """Entropy, GEPO regime counts, length-regularisation firing (for metrics)."""
    turn_advantages: list[list[float]] | None = None
    """``credit: turn``: per response, the advantage of each assistant turn (all 0 where not kept)."""

    @property
    def informative(self) -> bool:
        return bool(self.keep.any())


@dataclass
class _Unit:
    """One advantage unit: a group, or an effort subgroup of it."""

    group: int
    index: torch.Tensor  # positions inside the group
    rewards: torch.Tensor
    lengths: torch.Tensor
    logprob_sums: torch.Tensor | None
    entropy: float | None = None


class AdvantageTransform(abc.ABC):
    """A step applied to each unit's advantages after the estimator (registry entries)."""

    def prepare(self, units: list[_Unit], config: "AdvantageConfig") -> None:
        """Batch-level preparation (e.g. GEPO thresholds as quantiles of this step)."""

    @abc.abstractmethod
    def apply(self, adv: torch.Tensor, unit: _Unit, config: "AdvantageConfig", diag: dict[str, float]) -> torch.Tensor:
        """This unit's advantages after the step (``diag``: diagnostics it adds)."""


class _Gepo(AdvantageTransform):
    def prepare(self, units, config):
        for u in units:
            if u.logprob_sums is None:
                raise ValueError("GEPO needs the behaviour log-probability sums of every response "
                                 "(GroupRollouts.logprob_sums)")
            u.entropy = group_entropy(u.logprob_sums)
        g = config.gepo
        if g.thresholds == "batch_quantile":
            self.h_low, self.h_high = batch_thresholds([u.entropy for u in units], g.low_quantile, g.high_quantile)
        else:
            self.h_low, self.h_high = g.h_low, g.h_high

    def apply(self, adv, unit, config, diag):
        g = config.gepo
        regime = "low" if unit.entropy < self.h_low else "high" if unit.entropy > self.h_high else "mid"
        diag[f"gepo_{regime}_entropy_units"] = diag.get(f"gepo_{regime}_entropy_units", 0.0) + 1.0
        return gepo_rebalance(adv, unit.entropy, h_low=self.h_low, h_high=self.h_high,
                              low_positive_scale=g.low_positive_scale, high_negative_scale=g.high_negative_scale)


class _LengthRegularization(AdvantageTransform):
    def apply(self, adv, unit, config, diag):
        c = config.length_regularization
        out, info = adaptive_length_regularization(adv, unit.lengths, tau=c.tau, alpha=c.alpha, gamma=c.gamma)
        diag["length_reg_applied_units"] = diag.get("length_reg_applied_units", 0.0) + float(info.applied)
        return out


ADVANTAGE_TRANSFORMS: dict[str, Callable[[], AdvantageTransform]] = {
    "gepo": _Gepo,
    "length_regularization": _LengthRegularization,
}
"""Registry: transform name (an entry of ``rl.advantage.transforms``) -> factory."""


class AdvantagePipeline:
    """Applies the recipe's advantage composition to a batch of prompt groups."""

    def __init__(self, config: "AdvantageConfig", effort: "EffortConfig | None" = None):
        self.config, self.effort = config, effort
        if config.estimator not in GROUP_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator '{config.estimator}' "
                             f"(registered: {', '.join(sorted(GROUP_ESTIMATORS))})")
        self.estimator = GROUP_ESTIMATORS[config.estimator]

    # ---- reward shaping and subgroups -------------------------------------------------------
    def shaped_rewards(self, group: GroupRollouts) -> torch.Tensor:
        """Rewards plus the effort length deduction of Eq. 9 (when effort levels are configured)."""
        r = as_rewards(group.rewards)
        if self.effort is None or not self.effort.levels:
            return r
        if group.efforts is None:
            raise ValueError("effort conditioning is configured but the group carries no effort levels")
        e = self.effort
        penalty = [length_penalty(int(n), int(b), e.levels, k0=e.k0, decay_lambda=e.decay_lambda,
                                  l_norm=e.l_norm, c_max=e.c_max) for n, b in zip(group.lengths, group.efforts)]
        return r + torch.tensor(penalty, dtype=torch.float64)

    def _units(self, gi: int, group: GroupRollouts, rewards: torch.Tensor) -> list[_Unit]:
        n = rewards.numel()
        lengths = torch.as_tensor(list(group.lengths), dtype=torch.float64)
        sums = None if group.logprob_sums is None else torch.as_tensor(list(group.logprob_sums), dtype=torch.float64)
        if self.effort is not None and self.effort.levels and group.efforts is not None:
            efforts = torch.as_tensor(list(group.efforts))
            keys = sorted(set(efforts.tolist()))
            parts = [torch.nonzero(efforts == b).flatten() for b in keys]
        else:
            parts = [torch.arange(n)]
        return [_Unit(gi, idx, rewards[idx], lengths[idx], None if sums is None else sums[idx]) for idx in parts]

    def informative(self, group: GroupRollouts) -> bool:
        """Dynamic sampling verdict for a whole group: some (sub)group has distinct rewards."""
        if not self.config.dynamic_sampling:
            return True
        rewards = self.shaped_rewards(group)
        return any(is_informative(u.rewards, self.config.dynamic_sampling_atol)
                   for u in self._units(0, group, rewards))

    # ---- the composition ------------------------------------------------------------------------
    def compute(self, groups: Sequence[GroupRollouts]) -> list[GroupAdvantages]:
        cfg = self.config
        shaped = [self.shaped_rewards(g) for g in groups]
        units: list[_Unit] = []
        for gi, (group, rewards) in enumerate(zip(groups, shaped)):
            for u in self._units(gi, group, rewards):
                if not cfg.dynamic_sampling or is_informative(u.rewards, cfg.dynamic_sampling_atol):
                    units.append(u)
        transforms = [ADVANTAGE_TRANSFORMS[name]() for name in cfg.transforms]
        for t in transforms:
            if units:
                t.prepare(units, cfg)
        out = [GroupAdvantages(torch.zeros_like(r), torch.zeros(r.numel(), dtype=torch.bool), r) for r in shaped]
        for u in units:
            res = out[u.group]
            adv = self.estimator(u.rewards)
            if cfg.std_normalize:
                adv = std_normalize(adv, u.rewards, cfg.std_eps)
            for t in transforms:
                adv = t.apply(adv, u, cfg, res.diagnostics)
            res.advantages[u.index] = adv
            res.keep[u.index] = True
            if u.entropy is not None:
                res.diagnostics["group_entropy"] = u.entropy
        if getattr(cfg, "credit", "session") == "turn":
            for group, res in zip(groups, out):
                res.turn_advantages = self._turn_advantages(group, res.keep)
        return out

    def _turn_advantages(self, group: GroupRollouts, keep: torch.Tensor) -> list[list[float]]:
        """Each turn's own group-relative advantage (:func:`.session_credit.turn_group_advantages`)
        over the group's kept responses; a response without per-turn rewards is one turn rewarded
        with its session reward (a single-turn episode: the same as ``credit: session``)."""
        turns = group.turn_rewards or [[] for _ in group.rewards]
        turns = [list(t) if len(t) else [float(r)] for t, r in zip(turns, group.rewards)]
        kept = [i for i in range(len(turns)) if bool(keep[i])]
        cfg = self.config
        adv = turn_group_advantages([turns[i] for i in kept], self.estimator, atol=cfg.dynamic_sampling_atol,
                                    std_eps=cfg.std_eps if cfg.std_normalize else None)
        out = [[0.0] * len(t) for t in turns]
        for i, a in zip(kept, adv):
            out[i] = a
        return out
