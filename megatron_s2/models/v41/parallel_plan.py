"""Where parallelism is applied in the V4.1 backbone — the whole answer on one screen.

``PLAN`` maps every parameter of the model, by its name inside the module that owns it, to a
:class:`Rule`: how the layout cuts it (replicated / column / row over tp, experts over ep x
etp, table rows over the engram group), when its gradient is a partial sum over tp, and the
heads stacked along its rows (head-wise Muon). ``SELECTIVE_RECOMPUTE`` names the regions that
``parallel.recompute: selective`` checkpoints. Tensor parallelism of CSA2 attention is the
``"attention"``, ``"index_key"`` and ``"indexer"`` sections below; the forward collectives of
the sequence dimension (SP / CP entry, gather, halo) belong to
:class:`~megatron_s2.parallel.sequence.SequenceSharding`.

Each section belongs to one module class (its ``PLAN_SECTION``), which applies it at the end
of its constructor with :func:`apply_plan`: the result is a typed
:class:`~megatron_s2.parallel.placement.ParamPlacement` on every parameter, which gradient
finalisation, clipping, ZeRO-1, the optimiser and checkpoints read. Applying a rule checks
that the shard the module allocated is the one the rule's style describes, and a parameter
without a rule is an error that names it.

Why the tp-partial ones are partial — ``TP.ALWAYS``: the attention latents (q_down, window KV,
compressor, index keys) are computed once per rank and feed only the local heads; the router
sees the disjoint 1/tp of the tokens the MoE layer routes on each rank; the indexer's head
weights are computed for all heads and sliced to the local ones. ``TP.UNDER_SP``: norms, mHC
coefficient predictors and Engram run on the sequence-sharded streams under SP.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum

from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import ParamPlacement, Replicas, Style, shard_spec

__all__ = ["TP", "Rule", "PLAN", "SELECTIVE_RECOMPUTE", "apply_plan", "plan_rule", "describe_plan"]


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


R, COL, ROW = Style.REPLICATED, Style.COLUMN, Style.ROW
SP, ALL = TP.UNDER_SP, TP.ALWAYS

PLAN: dict[str, dict[str, Rule]] = {
    "model": {
        "embedding.word_embeddings.weight": Rule(COL),                      # vocabulary rows over tp
        "final_norm.weight":                Rule(R, SP),
        "output_layer.weight":              Rule(COL),                      # vocabulary-parallel head
    },
    "block": {
        "attn_norm.weight": Rule(R, SP),
        "mlp_norm.weight":  Rule(R, SP),
    },
    "mhc": {"fn": Rule(R, SP), "base": Rule(R, SP), "scale": Rule(R, SP)},
    "attention": {
        "linear_q_down.weight": Rule(R, ALL),
        "q_norm.weight":        Rule(R, ALL),
        "linear_q_up.weight":   Rule(COL, head_rows="head_dim"),             # query heads over tp
        "linear_kv.weight":     Rule(R, ALL),                                # window KV latent
        "kv_norm.weight":       Rule(R, ALL),
        "attn_sink":            Rule(COL),
        "linear_out_a":         Rule(COL, head_rows="o_lora_rank"),          # output groups over tp
        "linear_out_b.weight":  Rule(ROW),
        "compressor.*":         Rule(R, ALL),                                # main-KV latent
    },
    "index_key": {"linear.weight": Rule(R, ALL), "norm.weight": Rule(R, ALL)},
    "indexer": {
        "linear_q.weight":       Rule(COL, head_rows="index_head_dim"),      # indexer heads over tp
        "linear_weights.weight": Rule(R, ALL),
    },
    "moe": {
        "router.weight":     Rule(R, ALL),
        "experts.w1":        Rule(Style.EXPERTS),                            # experts over ep, width over etp
        "experts.w3":        Rule(Style.EXPERTS),
        "experts.w2":        Rule(Style.EXPERTS, width_dim=2),
        "shared_expert.w1":  Rule(COL),
        "shared_expert.w3":  Rule(COL),
        "shared_expert.w2":  Rule(ROW),
    },
    "engram": {
        "table.weight":     Rule(Style.ENGRAM_ROWS, SP),                     # rows over the engram group
        "linear_kv.weight": Rule(R, SP),
        "q_weight":         Rule(R, SP),
        "k_weight":         Rule(R, SP),
    },
}

SELECTIVE_RECOMPUTE = {
    "attention": "the attention core in query chunks (query heads, gathered keys, softmax over window + top-k, "
                 "grouped output projection) and the indexer's alignment scores",
    "mlp":       "the routed experts' SwiGLU (every routed slot's intermediates)",
}
"""Block submodules that checkpoint a region under ``parallel.recompute: selective`` (regions
without shared state or collectives inside, so the recomputation repeats nothing else)."""

_REPLICAS = {Style.EXPERTS: Replicas.EXPERT_DATA, Style.ENGRAM_ROWS: Replicas.ENGRAM}


def plan_rule(section: str, name: str) -> Rule | None:
    """The rule of parameter ``name`` (relative to the section's module), or None."""
    for pattern, rule in PLAN[section].items():
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
           config: V41Config | None) -> ParamPlacement:
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


def apply_plan(module: nn.Module, groups: ParallelGroups | None = None, config: V41Config | None = None) -> None:
    """Place every parameter ``module`` owns by the section ``type(module).PLAN_SECTION``.

    Submodules with a section of their own placed themselves when they were built and are
    skipped; every other parameter must match a rule of this section."""
    section = type(module).PLAN_SECTION
    groups = groups or ParallelGroups.single()

    def walk(mod: nn.Module, prefix: str):
        for name, param in mod.named_parameters(recurse=False):
            yield prefix + name, param
        for child_name, child in mod.named_children():
            if getattr(type(child), "PLAN_SECTION", None) is None:
                yield from walk(child, f"{prefix}{child_name}.")

    for name, param in walk(module, ""):
        rule = plan_rule(section, name)
        if rule is None:
            raise ValueError(f"parallel plan '{section}' has no rule for '{name}' of {type(module).__name__}; add one "
                             "to megatron_s2/models/v41/parallel_plan.py")
        param.placement = _place(name, param, rule, section, groups, config)


def describe_plan() -> str:
    """The plan as a table (one line per rule), e.g. for ``megatron-s2 plan`` output or docs."""
    lines = [f"{'section':<10} {'parameter':<34} {'style':<12} {'tp-partial':<10} head rows"]
    for section, rules in PLAN.items():
        for pattern, rule in rules.items():
            lines.append(f"{section:<10} {pattern:<34} {rule.style.value:<12} {rule.partial.value:<10} "
                         f"{rule.head_rows or '-'}")
    return "\n".join(lines)

