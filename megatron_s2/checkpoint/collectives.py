"""The few collectives the checkpoint protocol needs, on its own process group.

Checkpoint traffic runs on a dedicated gloo group (created once per manager): it carries
small Python objects (file checksums, error messages, key sets) between host memories, and
an asynchronous save can use it from a background thread without interleaving with the
training loop's collectives on the model's groups. ``group=None`` means a single process:
every function then degenerates to the local value.

Errors are agreed on collectively (:func:`agree_on_error`): a rank that finds a problem must
not raise alone while its peers wait in the next collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = [
    "agree_on_error",
    "barrier",
    "broadcast_object",
    "checkpoint_group",
    "gather_objects",
    "gather_to_first",
    "group_rank",
    "group_size",
]


def checkpoint_group(world_size: int):
    """A new gloo group over all ranks (collective: every rank calls it at the same point),
    or None for a single process."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def gather_objects(obj: Any, group) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_to_first(obj: Any, group) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on the group's first rank (None elsewhere)."""
    if group is None:
        return [obj]
    first = dist.get_global_rank(group, 0)
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(obj, out, dst=first, group=group)
    return out


def agree_on_error(error: str | None, group) -> str | None:
    """The first (lowest-rank) non-empty error of any rank, on every rank."""
    return next((e for e in gather_objects(error, group) if e), None)


def barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def broadcast_object(obj: Any, group, src: int = 0) -> Any:
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]
