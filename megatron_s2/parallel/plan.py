"""A model's parallel plan, applied: every parameter gets a typed ParamPlacement from a rule table.

A family writes its plan as one table (``{section: {parameter pattern: Rule}}``, e.g.
:data:`megatron_s2.models.v41.parallel_plan.PLAN`): how the layout cuts each parameter
(replicated / column / row over tp, experts over ep x etp, table rows over the engram group),
when its gradient is a partial sum over tp, and the heads stacked along its rows (head-wise
Muon). Each module class names its section (``PLAN_SECTION``) and calls :func:`apply_plan` at
the end of its constructor; applying a rule checks that the shard the module allocated is the
one the rule's style describes, and a parameter without a rule is an error that names it. The
result, a :class:`~megatron_s2.parallel.placement.ParamPlacement` on every parameter, is what
gradient finalisation, clipping, ZeRO-1, the optimiser and checkpoints read.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from torch import nn

from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import ParamPlacement, Replicas, Style, shard_spec

__all__ = ["TP", "Rule", "Plan", "apply_plan", "plan_rule", "describe_plan"]


class TP(Enum):
    """When a replicated parameter's gradient is a partial sum over tp."""

    NEVER = "never"
    UNDER_SP = "under_sp"  # fed the sequence-sharded streams
    ALWAYS = "always"      # fed tp-split tokens or the local heads' share, with or without SP


@dataclass(frozen=True)
class Rule:
    style: Style = Style.REPLICATED
    partial: TP = TP.NEVER
    head_rows: str | None = None
    """Config field giving the rows per head: the parameter stacks rows / that many heads."""
    width_dim: int = 1
    """Experts only: the FFN-width dimension cut over etp (W1/W3 [E, F, d]: 1; W2 [E, d, F]: 2)."""


Plan = Mapping[str, Mapping[str, Rule]]

_REPLICAS = {Style.EXPERTS: Replicas.EXPERT_DATA, Style.ENGRAM_ROWS: Replicas.ENGRAM}


def plan_rule(plan: Plan, section: str, name: str) -> Rule | None:
    """The rule of parameter ``name`` (relative to the section's module), or None."""
    for pattern, rule in plan[section].items():
        if fnmatch.fnmatchcase(name, pattern):
            return rule
    return None


def _expected_cuts(rule: Rule, groups: ParallelGroups) -> list[tuple[int, int]]:
    """(dim, count) of the cuts the rule's style makes (count-1 cuts omitted)."""
    cuts = {Style.REPLICATED: [], Style.COLUMN: [(0, groups.tp.size)], Style.ROW: [(1, groups.tp.size)],
            Style.EXPERTS: [(0, groups.ep.size), (rule.width_dim, groups.etp.size)],
            Style.ENGRAM_ROWS: [(0, groups.engram.size)]}[rule.style]
    return [(d, c) for d, c in cuts if c > 1]


def _place(name: str, param: nn.Parameter, rule: Rule, section: str, groups: ParallelGroups,
           config) -> ParamPlacement:
    spec = shard_spec(param)
    got = [(d, c) for d, _, c in spec.splits if c > 1]
    want = _expected_cuts(rule, groups)
    if got != want:
        raise ValueError(f"parallel plan '{section}': '{name}' is planned {rule.style.value} ({want}) but the module "
                         f"allocated the shard {spec.splits} of {spec.full_shape}")
    partial = groups.tp.active and (rule.partial is TP.ALWAYS or (rule.partial is TP.UNDER_SP and groups.sequence.sp))
    heads = None
    if rule.head_rows is not None:
        per_head = getattr(config, rule.head_rows)
        if param.shape[0] % per_head:
            raise ValueError(f"parallel plan '{section}': '{name}' has {param.shape[0]} rows, not a multiple of "
                             f"{rule.head_rows}={per_head}")
        heads = param.shape[0] // per_head
    return ParamPlacement(spec, rule.style, partial, _REPLICAS.get(rule.style, Replicas.DATA), heads, planned=True)


def apply_plan(plan: Plan, module: nn.Module, groups: ParallelGroups | None = None, config=None, *,
               source: str = "the family's parallel plan") -> None:
    """Place every parameter ``module`` owns by the section ``type(module).PLAN_SECTION`` of ``plan``.

    Submodules with a section of their own placed themselves when they were built and are
    skipped; every other parameter must match a rule of this section (``source``: where the table
    lives, named in the error)."""
    section = type(module).PLAN_SECTION
    groups = groups or ParallelGroups.single()

    def walk(mod: nn.Module, prefix: str):
        for name, param in mod.named_parameters(recurse=False):
            yield prefix + name, param
        for child_name, child in mod.named_children():
            if getattr(type(child), "PLAN_SECTION", None) is None:
                yield from walk(child, f"{prefix}{child_name}.")

    for name, param in walk(module, ""):
        rule = plan_rule(plan, section, name)
        if rule is None:
            raise ValueError(f"parallel plan '{section}' has no rule for '{name}' of {type(module).__name__}; add one "
                             f"to {source}")
        param.placement = _place(name, param, rule, section, groups, config)


def describe_plan(plan: Plan) -> str:
    """The plan as a table (one line per rule), e.g. for ``megatron-s2 plan`` output or docs."""
    lines = [f"{'section':<10} {'parameter':<34} {'style':<12} {'tp-partial':<10} head rows"]
    for section, rules in plan.items():
        for pattern, rule in rules.items():
            lines.append(f"{section:<10} {pattern:<34} {rule.style.value:<12} {rule.partial.value:<10} "
                         f"{rule.head_rows or '-'}")
    return "\n".join(lines)
