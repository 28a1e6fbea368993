"""``rl.advantage`` and ``rl.effort``: which advantage, composed from registered pieces.

``estimator`` names an entry of :data:`~megatron_s2.posttrain.advantages.GROUP_ESTIMATORS`;
``transforms`` lists entries of :data:`~megatron_s2.posttrain.advantages.ADVANTAGE_TRANSFORMS`
in application order (walkthrough Eq. 28: ``gepo`` before ``length_regularization``). The names
are checked against those registries by :func:`megatron_s2.posttrain.checks.check_registered_names`
(the registries hold torch code; loading a recipe never imports torch).
Coefficients the papers do not publish default to the walkthrough's illustrative values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.posttrain.checks import at_least, finite, in_range, positive

__all__ = ["GepoConfig", "LengthRegularizationConfig", "EffortConfig", "AdvantageConfig"]


@dataclass(frozen=True)
class GepoConfig:
    """GEPO (walkthrough Eq. 25-26); used when ``gepo`` is in ``transforms``."""

    thresholds: Literal["fixed", "batch_quantile"] = "fixed"
    """'fixed': use h_low / h_high; 'batch_quantile': quantiles of this step's group entropies."""
    h_low: float = 1.0
    """Entropy (nats per response, Eq. 25) below which positive advantages are damped."""
    h_high: float = 4.0
    """Entropy above which negative advantages are damped."""
    low_quantile: float = 0.25
    """With 'batch_quantile': H_low is this quantile of the batch's group entropies."""
    high_quantile: float = 0.75
    """With 'batch_quantile': H_high is this quantile."""
    low_positive_scale: float = 0.5
    """Factor on positive advantages of low-entropy groups (walkthrough's illustrative 0.5)."""
    high_negative_scale: float = 0.8
    """Factor on negative advantages of high-entropy groups (illustrative 0.8)."""

    def __post_init__(self) -> None:
        finite("h_low", self.h_low)
        finite("h_high", self.h_high)
        if self.h_low > self.h_high:
            raise ConfigError(f"h_low: {self.h_low} exceeds h_high={self.h_high}; set h_low <= h_high")
        in_range("low_quantile", self.low_quantile, 0.0, 1.0)
        in_range("high_quantile", self.high_quantile, 0.0, 1.0)
        if self.low_quantile > self.high_quantile:
            raise ConfigError(f"low_quantile: {self.low_quantile} exceeds high_quantile={self.high_quantile}")
        in_range("low_positive_scale", self.low_positive_scale, 0.0, 1.0, hint="GEPO damps, it never amplifies")
        in_range("high_negative_scale", self.high_negative_scale, 0.0, 1.0, hint="GEPO damps, it never amplifies")


@dataclass(frozen=True)
class LengthRegularizationConfig:
    """Adaptive length regularisation (walkthrough Eq. 14-17)."""

    tau: float = 0.5
    """Fires only when at least tau * G responses of the group have a positive advantage."""
    alpha: float = 0.2
    """Weight floor of the longest successful response (Eq. 17)."""
    gamma: float = 1.0
    """Shape of the length decay: < 1 punishes only the tail, > 1 falls away at once (Eq. 17)."""

    def __post_init__(self) -> None:
        in_range("tau", self.tau, 0.0, 1.0)
        in_range("alpha", self.alpha, 0.0, 1.0)
        positive("gamma", self.gamma)


@dataclass(frozen=True)
class EffortConfig:
    """Effort-conditioned subgroups (report §5.1.4, Eq. 8-10, Table 2); off when ``levels`` is empty."""

    levels: tuple[int, ...] = ()
    """Training effort levels B, each in 1..100 (e.g. [25, 50, 75, 100]); empty = no effort conditioning."""
    samples_per_level: int = 4
    """M_b: responses sampled per prompt at each level (Eq. 8); the group size is len(levels) * M_b."""
    k0: float = 0.1
    """Penalty coefficient at the lowest level b_min (Eq. 10)."""
    decay_lambda: float = 1.0
    """lambda in tau = lambda * delta_b: raising b by tau divides the penalty by e (Eq. 10)."""
    l_norm: float = 1024.0
    """Reference length L_norm of Eq. 9 (tokens)."""
    c_max: float = 0.5
    """Cap on the length deduction of one response (Eq. 9)."""

    def __post_init__(self) -> None:
        if len(set(self.levels)) != len(self.levels):
            raise ConfigError(f"levels: duplicate effort levels in {list(self.levels)}")
        for b in self.levels:
            if not 1 <= b <= 100:
                raise ConfigError(f"levels: effort level {b} is outside 1..100 (report §5.1.4)")
        if self.samples_per_level < 1:
            raise ConfigError(f"samples_per_level: must be >= 1, got {self.samples_per_level}")
        at_least("k0", self.k0, 0.0)
        positive("decay_lambda", self.decay_lambda)
        positive("l_norm", self.l_norm)
        at_least("c_max", self.c_max, 0.0)

    @property
    def enabled(self) -> bool:
        return bool(self.levels)

    @property
    def group_size(self) -> int:
        return len(self.levels) * self.samples_per_level


@dataclass(frozen=True)
class AdvantageConfig:
    """What the advantage is: a registered group estimator plus ordered transforms."""

    estimator: str = "leave_one_out"
    """Group estimator: 'leave_one_out' (walkthrough Eq. 27), 'group_mean' (GRPO), or the control
    'leave_one_out_shuffled' (Eq. 27 on rewards shuffled within the group: learns nothing from the verifier)."""
    std_normalize: bool = False
    """Divide each group's advantages by its reward std (population) + std_eps."""
    std_eps: float = 1e-6
    """Added to the std when std_normalize is on."""
    dynamic_sampling: bool = True
    """DAPO: drop (and replace) groups whose rewards are all identical."""
    dynamic_sampling_atol: float = 0.0
    """Rewards within this distance of the first count as identical."""
    transforms: tuple[str, ...] = ()
    """Ordered transforms after the estimator: 'gepo', 'length_regularization' (Eq. 28 order)."""
    gepo: GepoConfig = field(default_factory=GepoConfig)
    """GEPO coefficients (used when 'gepo' is listed)."""
    length_regularization: LengthRegularizationConfig = field(default_factory=LengthRegularizationConfig)
    """Length weights (used when 'length_regularization' is listed)."""
    credit: str = "session"
    """How a multi-turn session's tokens are credited: 'session' = one advantage (of the session's
    reward) on every assistant turn; 'turn' = each assistant turn k its own group-relative advantage
    of the environment's per-turn reward, over the group's sessions that reached turn k
    (:mod:`~megatron_s2.posttrain.advantages.session_credit`; Eq. 30's process weights on top of either)."""

    def __post_init__(self) -> None:
        positive("std_eps", self.std_eps)
        at_least("dynamic_sampling_atol", self.dynamic_sampling_atol, 0.0)
        if self.credit not in ("session", "turn"):
            raise ConfigError(f"credit: must be 'session' or 'turn', got {self.credit!r}")
        if self.credit == "turn" and self.transforms:
            raise ConfigError(f"credit: 'turn' takes no transforms (they act on one advantage a response), "
                              f"got transforms {list(self.transforms)}")
        if len(set(self.transforms)) != len(self.transforms):
            raise ConfigError(f"transforms: {list(self.transforms)} lists a transform twice")
        if "gepo" in self.transforms and "length_regularization" in self.transforms:
            if self.transforms.index("gepo") > self.transforms.index("length_regularization"):
                raise ConfigError("transforms: list 'gepo' before 'length_regularization' (walkthrough Eq. 28: "
                                  "the length weights act on the entropy-adjusted advantages)")
