"""Which update rule each parameter takes: an ordered rule table, first match wins (report §2.5).

§2.5 assigns Muon to the matrices of linear transformations, head-wise Muon to Query (and Key)
weights, the Sinkhorn-balanced update to the embedding, the prediction head and the Engram
tables, and AdamW to normalisation weights (with weight decay) and to biases and scaling
factors (without). Rather than infer this from module types, the assignment is an explicit
table of :class:`~megatron_s2.config.optimizer.ParamGroupRule` over full parameter names
(``model.named_parameters()``), so a new parameter that nobody thought about is an error that
names it, never a silent default.

Frozen parameters (``requires_grad=False``) are skipped. Head-wise rules read the number of
heads from the parameter's placement (``ParamPlacement.head_split``, from the model's parallel
plan).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from megatron_s2.config.optimizer import OptimizerConfig, ParamGroupRule
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.placement import placement_of

__all__ = ["ParamAssignment", "match_rule", "assign_param_groups", "describe_param_groups"]

MATRIX_KINDS = ("muon", "muon_headwise", "sinkhorn")


@dataclass(frozen=True)
class ParamAssignment:
    """One trainable parameter and the rule it matched."""

    name: str
    param: torch.nn.Parameter
    rule_index: int
    rule: ParamGroupRule
    head_split: int = 1
    """Per-head row blocks for head-wise Muon; 1 for every other rule."""


def match_rule(name: str, ndim: int, rules: tuple[ParamGroupRule, ...]) -> int | None:
    """Index of the first rule whose pattern and ndim filter accept the parameter, else None."""
    for index, rule in enumerate(rules):
        if rule.matches_ndim(ndim) and fnmatch.fnmatchcase(name, rule.pattern):
            return index
    return None


def _matrix_rows(param: torch.Tensor) -> int:
    """Rows that head-wise Muon splits: dim -2 of 2-D / 3-D tensors, dim 0 of flattened ones."""
    return param.shape[-2] if param.ndim <= 3 else param.shape[0]


def _head_split(name: str, param: torch.Tensor, rule: ParamGroupRule) -> int:
    heads = placement_of(param).head_split
    if heads is None:
        raise ConfigError(f"param_group_rules: '{name}' matched head-wise Muon rule '{rule.pattern}' but its "
                          f"placement has no head_split; give its parallel-plan rule head_rows (the rows per "
                          f"head), or route the parameter to kind 'muon'")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ConfigError(f"param_group_rules: '{name}'.head_split must be a positive int, got {heads!r}")
    rows = _matrix_rows(param)
    if rows % heads:
        raise ConfigError(f"param_group_rules: '{name}' has {rows} rows, not divisible by head_split={heads}")
    return heads


def assign_param_groups(model: torch.nn.Module, rules: tuple[ParamGroupRule, ...]) -> list[ParamAssignment]:
    """Assign every trainable parameter of ``model`` to its first matching rule."""
    assignments = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        index = match_rule(name, param.ndim, rules)
        if index is None:
            raise ConfigError(f"param_group_rules: trainable parameter '{name}' (shape {tuple(param.shape)}) "
                              f"matches no rule; add a rule for it (patterns are fnmatch globs over "
                              f"model.named_parameters() names)")
        rule = rules[index]
        if rule.kind in MATRIX_KINDS and param.ndim < 2:
            raise ConfigError(f"param_group_rules: rule {index} '{rule.pattern}' ({rule.kind}) updates matrices, "
                              f"but '{name}' has shape {tuple(param.shape)}; give the rule ndim '>=2' or "
                              f"route the parameter to an earlier adamw rule")
        heads = _head_split(name, param, rule) if rule.kind == "muon_headwise" else 1
        assignments.append(ParamAssignment(name, param, index, rule, heads))
    return assignments


def describe_param_groups(model: torch.nn.Module, cfg: OptimizerConfig | None = None) -> str:
    """Compact start-up table: one line per rule with matched parameter count and numel."""
    rules = (cfg or OptimizerConfig()).rules_for(getattr(model, "config", None))
    counts = [0] * len(rules)
    numels = [0] * len(rules)
    for assignment in assign_param_groups(model, rules):
        counts[assignment.rule_index] += 1
        numels[assignment.rule_index] += assignment.param.numel()
    header = ("#", "pattern", "ndim", "kind", "wd", "lr_mult", "params", "numel")
    rows = [
        (str(i), r.pattern, r.ndim, r.kind, "yes" if r.weight_decay else "no", f"{r.lr_mult:g}",
         str(counts[i]), f"{numels[i]:,}")
        for i, r in enumerate(rules)
    ]
    rows.append(("", "total", "", "", "", "", str(sum(counts)), f"{sum(numels):,}"))
    widths = [max(len(row[col]) for row in (header, *rows)) for col in range(len(header))]
    right_aligned = {0, 5, 6, 7}

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in right_aligned else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    title = "optimizer parameter groups (first matching rule wins; frozen parameters skipped)"
    return "\n".join([title, line(header), *(line(row) for row in rows)])
