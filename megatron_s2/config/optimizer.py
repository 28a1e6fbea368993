"""Optimiser and learning-rate schedule configuration (DeepSeek-V4.1-Flash report §2.5, §4.2.2).

Three update rules share the model's parameters (§2.5, "Basic Configurations"):

* **Muon** (Nesterov momentum, Newton-Schulz orthogonalisation, decoupled weight decay,
  update RMS rescaled to 0.18) for the matrices of linear transformations; **head-wise Muon**
  for Query (and Key) weights, which are orthogonalised one head at a time.
* **Sinkhorn-balanced momentum** (Eq. 7) for the token embedding, the prediction head and
  the Engram tables, with the learning rate scaled by gamma = 0.18 and the Engram tables
  at 5x the learning rate.
* **AdamW** for normalisation weights (with weight decay) and biases / scalars (without).

Which parameter takes which rule is an ordered table of :class:`ParamGroupRule` (first match
wins); :func:`default_param_group_rules` is the table for this repository's parameter names.
Defaults are the report's values (§4.2.2); the schedule's flagship numbers are in the
``ScheduleConfig`` docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = [
    "OptimizerKind",
    "NdimFilter",
    "ParamGroupRule",
    "default_param_group_rules",
    "OptimizerConfig",
    "ScheduleConfig",
]

OptimizerKind = Literal["muon", "muon_headwise", "sinkhorn", "adamw"]
NdimFilter = Literal["any", "<=1", ">=2"]


@dataclass(frozen=True)
class ParamGroupRule:
    """One row of the parameter-group table: which update rule a parameter name takes."""

    pattern: str
    """fnmatch glob over the full name from ``model.named_parameters()``, e.g. '*.bias'."""
    kind: OptimizerKind
    """Update rule: 'muon', 'muon_headwise' (per-head blocks, needs the parameter attribute
    ``head_split``), 'sinkhorn' or 'adamw'."""
    weight_decay: bool = False
    """Apply decoupled weight decay (muon_weight_decay / adamw_weight_decay). The
    Sinkhorn-balanced update never decays (§2.5)."""
    lr_mult: float = 1.0
    """Multiplier on the scheduled learning rate (Engram tables: 5x, §4.2.2)."""
    ndim: NdimFilter = "any"
    """Also require the parameter's rank: 'any', '<=1' (vectors and scalars) or '>=2'."""

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ConfigError("pattern: must be a non-empty fnmatch glob such as '*.bias'")
        if self.lr_mult <= 0:
            raise ConfigError(f"lr_mult: must be positive, got {self.lr_mult} (freeze parameters instead)")
        if self.kind == "sinkhorn" and self.weight_decay:
            raise ConfigError(f"weight_decay: the Sinkhorn-balanced update applies no weight decay (§2.5); "
                              f"set weight_decay: false for pattern '{self.pattern}'")
        if self.kind in ("muon", "muon_headwise", "sinkhorn") and self.ndim == "<=1":
            raise ConfigError(f"ndim: kind '{self.kind}' updates matrices; pattern '{self.pattern}' "
                              f"cannot be restricted to ndim '<=1' (use kind 'adamw')")

    def matches_ndim(self, ndim: int) -> bool:
        if self.ndim == "<=1":
            return ndim <= 1
        if self.ndim == ">=2":
            return ndim >= 2
        return True


def default_param_group_rules(engram_lr_mult: float = 5.0) -> tuple[ParamGroupRule, ...]:
    """The §2.5 / §4.2.2 assignment for this repository's parameter names, first match wins."""
    no_decay = [
        "*attn_sink", "*.bias", "*hc.base", "*hc.scale", "*engram.q_weight", "*engram.k_weight",
    ]
    return (
        ParamGroupRule("embedding.word_embeddings.weight", "sinkhorn"),
        ParamGroupRule("output_layer.weight", "sinkhorn"),
        ParamGroupRule("*engram.table.weight", "sinkhorn", lr_mult=engram_lr_mult),
        ParamGroupRule("*norm*.weight", "adamw", weight_decay=True, ndim="<=1"),
        *(ParamGroupRule(p, "adamw") for p in no_decay),
        ParamGroupRule("*", "adamw", ndim="<=1"),
        ParamGroupRule("*.linear_q_up.weight", "muon_headwise", weight_decay=True),
        ParamGroupRule("*.indexer.linear_q.weight", "muon_headwise", weight_decay=True),
        # The grouped output projection is o_groups independent matrices (one per group).
        ParamGroupRule("*.attention.linear_out_a", "muon_headwise", weight_decay=True),
        ParamGroupRule("*", "muon", weight_decay=True, ndim=">=2"),
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of the hybrid Muon / Sinkhorn / AdamW optimiser (§2.5, §4.2.2)."""

    momentum: float = 0.95
    """Momentum coefficient of Muon and of the Sinkhorn-balanced update (§4.2.2)."""
    nesterov: bool = True
    """Nesterov momentum for Muon and Sinkhorn (§2.5); false = heavy-ball momentum."""
    muon_weight_decay: float = 0.1
    """Decoupled weight decay of Muon: p <- p * (1 - lr * wd) (§4.2.2)."""
    muon_update_rms: float = 0.18
    """RMS of every (per-head) Muon update matrix, so the AdamW learning rate carries over:
    the orthogonalised update is scaled by muon_update_rms * sqrt(max(rows, cols))."""
    ns_steps: int = 8
    """Fast quintic Newton-Schulz iterations per Muon update (DeepSeek-V4's hybrid schedule:
    8 fast steps, then ns_polish_steps stabilising ones)."""
    ns_polish_steps: int = 2
    """Extra (2, -1.5, 0.5) Newton-Schulz steps after ns_steps that pin singular values at one,
    making the update RMS exactly muon_update_rms (2 suffice); 0 = plain Muon, whose update
    RMS is ~0.85 x muon_update_rms."""
    ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the Newton-Schulz iteration; 'bfloat16' is meant for GPUs."""
    sinkhorn_iters: int = 11
    """K: alternating row / column normalisation steps, starting and (for odd K) ending
    with a row step (§4.2.2: K = 11)."""
    sinkhorn_tau: float = 1.0e-3
    """Rows with norm <= tau * mean row norm are masked: no update, no column statistics."""
    sinkhorn_eps: float = 1.0e-20
    """Epsilon added to the row and column norms in the Sinkhorn denominators."""
    sinkhorn_lr_scale: float = 0.18
    """gamma: effective Sinkhorn learning rate gamma * eta, matching Adam's update size (§2.5)."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2) (§4.2.2)."""
    adamw_eps: float = 1.0e-20
    """AdamW epsilon (§4.2.2)."""
    adamw_weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to normalisation weights only (§2.5)."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    engram_lr_mult: float = 5.0
    """Learning-rate multiplier of the Engram tables in the default rule table (§4.2.2)."""
    param_group_rules: tuple[ParamGroupRule, ...] = ()
    """Ordered (pattern, kind, weight_decay, lr_mult, ndim) table, first match wins; empty
    = default_param_group_rules(engram_lr_mult). A trainable parameter matching no rule is
    an error."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum: must be in [0, 1), got {self.momentum}")
        for name in ("muon_weight_decay", "adamw_weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be non-negative, got {getattr(self, name)}")
        for name in ("muon_update_rms", "sinkhorn_lr_scale", "engram_lr_mult", "adamw_eps", "sinkhorn_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.ns_steps < 1:
            raise ConfigError(f"ns_steps: Muon needs at least one Newton-Schulz step, got {self.ns_steps}")
        if self.ns_polish_steps < 0:
            raise ConfigError(f"ns_polish_steps: must be non-negative, got {self.ns_polish_steps}")
        if self.sinkhorn_iters < 1:
            raise ConfigError(f"sinkhorn_iters: needs at least one normalisation step, got {self.sinkhorn_iters}")
        if not 0.0 <= self.sinkhorn_tau < 1.0:
            raise ConfigError(f"sinkhorn_tau: must be in [0, 1), got {self.sinkhorn_tau}")
        beta1, beta2 = self.adamw_betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ConfigError(f"adamw_betas: both betas must be in [0, 1), got {list(self.adamw_betas)}")
        if self.param_group_rules and self.engram_lr_mult != 5.0:
            raise ConfigError("engram_lr_mult: only shapes the default rule table; with param_group_rules "
                              "given, set lr_mult on the Engram rule instead")

    @property
    def rules(self) -> tuple[ParamGroupRule, ...]:
        """The effective rule table of a model without family rules (see :meth:`rules_for`)."""
        return self.param_group_rules or default_param_group_rules(self.engram_lr_mult)

    def rules_for(self, model_cfg=None) -> tuple[ParamGroupRule, ...]:
        """The effective rule table for a model: the recipe's table when given, else the model
        family's own rules (``ModelSchema.optimizer_rules``, e.g. AdamW for softmax routers,
        whose rank-deficient gradients Muon would orthogonalise into noise) before the defaults."""
        if self.param_group_rules:
            return self.param_group_rules
        family = tuple(model_cfg.optimizer_rules()) if model_cfg is not None else ()
        return (*family, *default_param_group_rules(self.engram_lr_mult))


@dataclass(frozen=True)
class ScheduleConfig:
    """Warm-up, constant, cosine decay, constant tail (§4.2.2).

    The report's run: linear warm-up over 2000 steps to 2.6e-4, constant until 28T tokens,
    cosine decay to 2.6e-5 by 40T tokens, constant to 45T; at 100.6M tokens per step that is
    decay_start_step = ceil(28e12 / 100.6e6) = 278,331 and decay_end_step = 397,615
    (:func:`megatron_s2.optim.lr_schedule.steps_for_tokens`).
    """

    lr: float = 2.6e-4
    """Peak learning rate eta, reached at the end of warm-up."""
    min_lr: float = 2.6e-5
    """Learning rate at and after decay_end_step."""
    warmup_steps: int = 2000
    """Linear warm-up steps; step s < warmup_steps uses lr * (s + 1) / warmup_steps."""
    decay_start_step: int = 278331
    """First step of the cosine decay (the constant phase covers [warmup_steps, here))."""
    decay_end_step: int = 397615
    """Step at which the cosine reaches min_lr; later steps stay at min_lr."""
    decay_start_tokens: float | None = None
    """Token-based boundary (report: 28e12): the decay starts at the first step by which this
    many tokens (global_batch_size x seq_length per step) are trained; replaces
    decay_start_step. Give decay_end_tokens with it."""
    decay_end_tokens: float | None = None
    """Token-based end of the cosine (report: 40e12); replaces decay_end_step."""
    start_tokens: float = 0.0
    """Tokens trained before this phase on the same schedule: the schedule starts at that
    position (e.g. 34e12 for the 1M-context extension, report §4.2.2); 0 for a fresh run."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr: must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps: must be non-negative, got {self.warmup_steps}")
        if self.decay_start_step < self.warmup_steps:
            raise ConfigError(f"decay_start_step: {self.decay_start_step} is before the end of warm-up "
                              f"(warmup_steps={self.warmup_steps}); set decay_start_step >= warmup_steps")
        if self.decay_end_step < self.decay_start_step:
            raise ConfigError(f"decay_end_step: {self.decay_end_step} is before decay_start_step="
                              f"{self.decay_start_step}; the decay must end after it starts")
        if (self.decay_start_tokens is None) != (self.decay_end_tokens is None):
            raise ConfigError("decay_start_tokens: give both decay_start_tokens and decay_end_tokens, or neither")
        if self.decay_start_tokens is not None and not 0 <= self.decay_start_tokens <= self.decay_end_tokens:
            raise ConfigError(f"decay_end_tokens: {self.decay_end_tokens} must be >= decay_start_tokens="
                              f"{self.decay_start_tokens} >= 0")
        if self.start_tokens < 0:
            raise ConfigError(f"start_tokens: must be >= 0, got {self.start_tokens}")
        if self.decay_end_step == self.decay_start_step and self.min_lr != self.lr:
            raise ConfigError(f"decay_end_step: equals decay_start_step={self.decay_start_step}, which would drop "
                              f"lr to min_lr in one step; make decay_end_step larger or set min_lr = lr")
