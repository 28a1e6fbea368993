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
from megatron_s2.parallel.sharding import shard_spec

__all__ = ["optimizer_shard_groups"]


def optimizer_shard_groups(model: nn.Module, groups: ParallelGroups, cfg: OptimizerConfig):
    """(row_groups {name: pg}, matrix_shards {name: (Group, dim)}) for build_optimizer."""
    row_groups, matrix_shards = {}, {}
    for a in assign_param_groups(model, cfg.rules):
        p = a.param
        cuts = [dim for dim, _, count in shard_spec(p).splits if count > 1]
        if not cuts:
            continue
        expert = getattr(p, "is_expert", False)
        if a.rule.kind == "sinkhorn":
            group = groups.engram if getattr(p, "engram_table", False) else groups.tp
            row_groups[a.name] = group.pg
        elif a.rule.kind == "muon":
            for dim in cuts:
                if expert and dim == 0:
                    continue  # whole experts per expert-parallel rank
                matrix_shards[a.name] = (groups.etp if expert else groups.tp, dim)
    return row_groups, matrix_shards
