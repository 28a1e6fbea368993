"""Rollout replicas: which ranks generate together, and how their results reach every rank.

A rollout model runs under a layout with tensor and expert parallelism only (the engine needs
every layer on the rank, no sequence or context parallelism). Ranks joined by a tensor-, an
expert- (``etp-ep``) or an engram-parallel group execute one forward together, so they must
run *the same requests in lockstep*: they form one **replica** (the connected components of
those groups). Replicas are independent: each runs the samples assigned to it
(``sample_id % num_replicas``), and after every engine step the replica leaders' completed
samples are all-gathered, so the orchestrator — replicated on every rank — ingests the same
completions in the same order everywhere and takes the same decisions (report §5.2.1's
co-located rollout, with rollout work divided over the data-parallel dimension).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ReplicaTopology", "replica_topology", "gather_objects"]


@dataclass(frozen=True)
class ReplicaTopology:
    index: int
    """This rank's replica."""
    count: int
    """Number of replicas."""
    leader: bool
    """This rank reports its replica's results (the lowest rank of the replica)."""
    world_size: int = 1
    device: str = "cpu"
    """Device of the gather buffers (the rank's accelerator under NCCL)."""

    def owns(self, sample_id: int) -> bool:
        return sample_id % self.count == self.index

    @staticmethod
    def single() -> "ReplicaTopology":
        return ReplicaTopology(0, 1, True, 1)


def replica_topology(layout, rank: int, device: str = "cpu") -> ReplicaTopology:
    """Replicas of a rollout ``layout`` (a :class:`~megatron_s2.parallel.layout.ParallelLayout`
    with pp = cp = 1): connected components of its tp, etp-ep and engram groups."""
    if layout.pp != 1 or layout.cp != 1:
        raise ValueError(f"a rollout layout has pp = cp = 1, got {layout.describe()}")
    parent = list(range(layout.world_size))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for kind in ("tp", "etp-ep", "engram"):
        for group in layout.groups(kind):
            for other in group[1:]:
                a, b = find(group[0]), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots = sorted({find(r) for r in range(layout.world_size)})
    mine = find(rank)
    members = [r for r in range(layout.world_size) if find(r) == mine]
    return ReplicaTopology(roots.index(mine), len(roots), rank == min(members), layout.world_size, str(device))


def gather_objects(local: Any, topology: ReplicaTopology) -> list[Any]:
    """Every rank's ``local`` (JSON-safe values), in rank order. Sent as UTF-8 JSON in byte
    tensors (two all-gathers over the world group; nothing is pickled)."""
    if topology.world_size == 1:
        return [local]
    data = json.dumps(local, separators=(",", ":")).encode()
    dev = torch.device(topology.device)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(topology.world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    bufs = [torch.empty_like(buf) for _ in range(topology.world_size)]
    dist.all_gather(bufs, buf)
    return [json.loads(b[:int(n)].cpu().numpy().tobytes().decode()) for b, n in zip(bufs, sizes)]
