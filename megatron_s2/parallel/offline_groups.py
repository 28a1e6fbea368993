"""Process groups without processes: sizes, ranks and stage placement of any rank of a layout.

Planning, conversion and resharding build a rank's model (on the meta device) without starting
that rank; module constructors only read group sizes and this rank's coordinates, which
:func:`layout_groups` gives from the pure :class:`~megatron_s2.parallel.layout.ParallelLayout`.
"""

from __future__ import annotations

from functools import lru_cache

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["group_table", "layout_groups", "pp_rank_of", "stage_model_kwargs"]


@lru_cache(maxsize=32)
def group_table(layout: ParallelLayout) -> dict[str, dict[int, tuple[int, ...]]]:
    """``{ParallelGroups field: {rank: ranks of its group}}`` for every rank, computed once
    (``ParallelLayout.groups`` recomputes the rank grid on every call)."""
    from megatron_s2.parallel.setup import GROUP_KINDS

    table = {field: {r: tuple(g) for g in layout.groups(kind) for r in g} for field, kind in GROUP_KINDS.items()}
    # Engram replicas: same position in their engram group and same model shard (tp, pp) —
    # the rule of megatron_s2.parallel.setup._engram_replica_groups.
    by_key: dict[tuple, list[int]] = {}
    for g in layout.groups("engram"):
        for idx, r in enumerate(g):
            key = (table["tp"][r].index(r), table["pp"][r].index(r), idx)
            by_key.setdefault(key, []).append(r)
    table["engram_replica"] = {r: tuple(sorted(v)) for v in by_key.values() for r in v}
    return table


def layout_groups(layout: ParallelLayout, rank: int) -> ParallelGroups:
    """Communication-free :class:`ParallelGroups` of ``rank``: sizes and coordinates only."""
    handles = {}
    for field, by_rank in group_table(layout).items():
        ranks = by_rank.get(rank, (rank,))
        handles[field] = Group(pg=None, size=len(ranks), rank=ranks.index(rank), ranks=ranks)
    return ParallelGroups(sequence_parallel=layout.sequence_parallel, **handles)


def pp_rank_of(layout: ParallelLayout, rank: int) -> int:
    ranks = group_table(layout)["pp"][rank]
    return ranks.index(rank)


def stage_model_kwargs(layout: ParallelLayout, rank: int) -> dict:
    """``layers`` / ``pre_process`` / ``post_process`` of the model object held by ``rank``
    (the union of its virtual stages, as the trainer's model builder builds it)."""
    if layout.pp == 1:
        return {}
    stages = layout.stages_of_rank(pp_rank_of(layout, rank))
    layers = [layer for s in stages for layer in layout.stage_layers[s]]
    return {"layers": layers, "pre_process": 0 in stages, "post_process": len(layout.stage_layers) - 1 in stages}
