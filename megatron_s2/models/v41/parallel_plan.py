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
of its constructor with :func:`apply_plan` (the generic applier,
:mod:`megatron_s2.parallel.plan`): the result is a typed
:class:`~megatron_s2.parallel.placement.ParamPlacement` on every parameter.

Why the tp-partial ones are partial — ``TP.ALWAYS``: the attention latents (q_down, window KV,
compressor, index keys) are computed once per rank and feed only the local heads; the router
sees the disjoint 1/tp of the tokens the MoE layer routes on each rank; the indexer's head
weights are computed for all heads and sliced to the local ones. ``TP.UNDER_SP``: norms, mHC
coefficient predictors and Engram run on the sequence-sharded streams under SP.
"""

from __future__ import annotations

from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.parallel import plan as _plan
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.plan import TP, Rule
from megatron_s2.parallel.placement import Style

__all__ = ["TP", "Rule", "PLAN", "SELECTIVE_RECOMPUTE", "apply_plan", "plan_rule", "describe_plan"]


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
    "dspark": {                                                              # the drafter's own pieces (§2.4.3)
        "main_proj.weight":  Rule(R),                                        # on the replicated main input
        "main_norm.weight":  Rule(R),
        "final_norm.weight": Rule(R),
        "head_hc_*":         Rule(R),
        "markov_w*":         Rule(R),                                        # full-vocabulary bias
        "confidence":        Rule(R),
    },
    "vision": {                                                              # the encoder (§2.1.1), replicated:
        "tower.*":           Rule(R, SP),                                    # whole images on every tp rank;
        "aligner.*":         Rule(R, SP),                                    # under SP each writes only its
        "image_*":           Rule(R, SP),                                    # sequence slice's span rows
    },
}

SELECTIVE_RECOMPUTE = {
    "attention": "the attention core in query chunks (query heads, gathered keys, softmax over window + top-k, "
                 "grouped output projection) and the indexer's alignment scores",
    "mlp":       "the routed experts' SwiGLU (every routed slot's intermediates)",
}
"""Block submodules that checkpoint a region under ``parallel.recompute: selective`` (regions
without shared state or collectives inside, so the recomputation repeats nothing else)."""


def plan_rule(section: str, name: str) -> Rule | None:
    """The rule of parameter ``name`` (relative to the section's module), or None."""
    return _plan.plan_rule(PLAN, section, name)


def apply_plan(module: nn.Module, groups: ParallelGroups | None = None, config: V41Config | None = None) -> None:
    """Place every parameter ``module`` owns by its section of :data:`PLAN` (:func:`megatron_s2.parallel.plan.apply_plan`)."""
    _plan.apply_plan(PLAN, module, groups, config, source="megatron_s2/models/v41/parallel_plan.py")


def describe_plan() -> str:
    return _plan.describe_plan(PLAN)
