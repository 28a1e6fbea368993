"""The process groups a module is handed (STYLE.md habit 4: no module reads global state).

:class:`ParallelGroups` is built in one place (``megatron_s2.parallel.setup``) from the pure
layout object and passed down to every module that communicates. A size-1 group is
represented by ``None`` and means "no communication", so the same module code runs on one
process without ``torch.distributed`` being initialised at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_s2.parallel.sequence import SequenceSharding

__all__ = ["Group", "ParallelGroups"]


@dataclass(frozen=True)
class Group:
    """A process group with its size and this process's rank in it (``pg=None`` when size 1)."""

    pg: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = (0,)

    @property
    def active(self) -> bool:
        return self.size > 1

    @staticmethod
    def single() -> "Group":
        return Group()


@dataclass(frozen=True)
class ParallelGroups:
    """Groups of one process: tensor, sequence (shares tp), expert, expert-tensor, data,
    context, pipeline and engram parallelism, plus the expert data-parallel group."""

    tp: Group = field(default_factory=Group.single)
    sequence_parallel: bool = False
    ep: Group = field(default_factory=Group.single)
    etp: Group = field(default_factory=Group.single)
    dp: Group = field(default_factory=Group.single)
    dp_cp: Group = field(default_factory=Group.single)  # data x context: gradient reduction group
    cp: Group = field(default_factory=Group.single)
    pp: Group = field(default_factory=Group.single)
    engram: Group = field(default_factory=Group.single)
    expert_dp: Group = field(default_factory=Group.single)  # replicas of the same experts
    tp_ep: Group = field(default_factory=Group.single)  # tp x ep: MoE token-dispatch domain
    embedding: Group = field(default_factory=Group.single)  # first+last pipeline stage
    stage: Group = field(default_factory=Group.single)  # tp x cp x dp: every rank of this pipeline stage
    engram_replica: Group = field(default_factory=Group.single)  # ranks holding the same Engram row partition

    @staticmethod
    def single() -> "ParallelGroups":
        return ParallelGroups()

    @property
    def sequence(self) -> "SequenceSharding":
        """How a micro-batch's tokens are spread over tp (SP) and cp (see :mod:`.sequence`)."""
        from megatron_s2.parallel.sequence import SequenceSharding

        return SequenceSharding.of(self.tp, self.cp, self.sequence_parallel)
