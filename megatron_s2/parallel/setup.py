"""Create every process group from a :class:`ParallelLayout`, in one place.

``torch.distributed.new_group`` must be called by every rank in the same order for every
group, including groups the rank is not part of; this module walks the layout's group
lists in a fixed order and hands back this rank's :class:`ParallelGroups`. Nothing else in
the project creates process groups.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["build_groups", "GROUP_KINDS"]

# ParallelGroups field -> layout group kind.
GROUP_KINDS = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "pp": "pp",
    "ep": "ep",
    "etp": "etp",
    "expert_dp": "edp",
    "tp_ep": "etp-ep",
    "stage": "tp-cp-dp",
    "engram": "engram",
    "embedding": "embedding",
}


def _engram_replica_groups(layout: ParallelLayout) -> list[list[int]]:
    """Ranks holding the same Engram row partition: same position in their engram group,
    same model shard (same tp, pp)."""
    by_key: dict[tuple, list[int]] = {}
    for group in layout.groups("engram"):
        for idx, rank in enumerate(group):
            c = layout.coords(rank)
            by_key.setdefault((c["tp"], c["pp"], idx), []).append(rank)
    return sorted(sorted(v) for v in by_key.values())


def build_groups(layout: ParallelLayout, rank: int | None = None) -> ParallelGroups:
    """Create all groups (collective over the world) and return this rank's handles."""
    if layout.world_size == 1:
        return ParallelGroups.single()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before building process groups")
    rank = dist.get_rank() if rank is None else rank
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
    handles: dict[str, Group] = {}
    plan = [(field, layout.groups(kind)) for field, kind in GROUP_KINDS.items()]
    plan.append(("engram_replica", _engram_replica_groups(layout)))
    for field, groups in plan:
        mine = Group()
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine = Group(pg=pg, size=len(ranks), rank=ranks.index(rank), ranks=tuple(ranks))
        handles[field] = mine
    return ParallelGroups(sequence_parallel=layout.sequence_parallel, **handles)
