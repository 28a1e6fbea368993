"""Which process group each sharded parameter's optimiser update must see.

Muon needs whole matrices (§2.5) and Sinkhorn balancing needs whole columns (Eq. 7). A
parameter sharded by the layout therefore declares, for the optimiser:

* row-partitioned Sinkhorn tables (vocabulary-parallel embedding / head over tp, Engram
  tables over the engram group): the group whose column statistics are summed;
* Muon matrices cut along a matrix dimension (tensor-parallel linears over tp, expert FFN
  width over etp): the group over which the momentum update is all-gathered before
  Newton-Schulz (each rank keeps its slice; cost: one all-gather of the matrix per step and a
  redundant orthogonalisation per rank of the group);
* head-wise Muon weights (query up-projections, indexer queries, grouped output projection)
  hold whole heads / groups per rank and need nothing; nor do experts split over ep.
"""

from __future__ import annotations

from torch import nn

from megatron_s2.config.optimizer import OptimizerConfig
from megatron_s2.optim.param_groups import assign_param_groups
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import Style, placement_of

__all__ = ["optimizer_shard_groups"]


def optimizer_shard_groups(model: nn.Module, groups: ParallelGroups, cfg: OptimizerConfig):
    """(row_groups {name: pg}, matrix_shards {name: (Group, dim)}) for build_optimizer, from
    each parameter's placement."""
    row_groups, matrix_shards = {}, {}
    for a in assign_param_groups(model, cfg.rules_for(getattr(model, "config", None))):
        placement = placement_of(a.param)
        cuts = placement.shard.cut_dims
        if not cuts:
            continue
        if a.rule.kind == "sinkhorn":
            row_groups[a.name] = (groups.engram if placement.style is Style.ENGRAM_ROWS else groups.tp).pg
        elif a.rule.kind == "muon":
            for dim in cuts:
                if placement.style is Style.EXPERTS and dim == 0:
                    continue  # whole experts per expert-parallel rank
                matrix_shards[a.name] = (groups.etp if placement.style is Style.EXPERTS else groups.tp, dim)
    return row_groups, matrix_shards
