"""ZeRO-1: optimiser state sharded over data-parallel replicas, by whole parameters.

Muon and Sinkhorn need whole matrices, so the unit of sharding is a parameter (a TP/EP
shard of it), not a flat slice of a buffer. Within each *replica group* of a parameter —
the ranks holding an identical copy: data x context for dense parameters, expert data
parallel for experts, the Engram replica group for table partitions — one rank *owns* it:
only the owner keeps optimiser state (momentum, Adam moments) and computes its update; after
the step every owner broadcasts its updated parameters to its replica group, so all replicas
stay bit-identical. Owners are assigned greedily by size (largest first, to the least loaded
rank) from a deterministic order, so every rank agrees on the assignment and tensor-parallel
peers (same data-parallel coordinate) own the same parameters — which Muon's gathered
Newton-Schulz and Sinkhorn's column statistics over tp require.

Costs: optimiser state per rank ~ 1/|replica group|; gradients are still all-reduced (not
reduce-scattered) and one broadcast of each parameter per step is added.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.training.grad_finalize import reduction_group

__all__ = ["DistributedOptimizer", "assign_owners"]


def assign_owners(named: list[tuple[str, torch.nn.Parameter]], size: int) -> dict[str, int]:
    load = [0] * size
    owners = {}
    for name, p in sorted(named, key=lambda np_: (-np_[1].numel(), np_[0])):
        i = min(range(size), key=lambda r: (load[r], r))
        owners[name] = i
        load[i] += p.numel()
    return owners


class DistributedOptimizer:
    """Wraps the hybrid optimiser; same interface (set_lr, step, zero_grad, state_dict)."""

    def __init__(self, inner, model: torch.nn.Module, groups: ParallelGroups):
        self.inner = inner
        self.by_group: dict[str, tuple[Group, list[tuple[str, torch.nn.Parameter]]]] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            kind, group = reduction_group(p, groups)
            self.by_group.setdefault(kind, (group, []))[1].append((name, p))
        self.owned: set[int] = set()
        self.plan: list[tuple[Group, int, list[torch.nn.Parameter]]] = []  # (group, owner index, params)
        for kind in sorted(self.by_group):
            group, named = self.by_group[kind]
            owners = assign_owners(named, group.size)
            per_owner: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
            for name, p in named:
                per_owner[owners[name]].append(p)
                if owners[name] == group.rank:
                    self.owned.add(id(p))
            for owner in sorted(per_owner):
                self.plan.append((group, owner, per_owner[owner]))

    @property
    def param_groups(self):
        return self.inner.param_groups

    def set_lr(self, base_lr: float) -> None:
        self.inner.set_lr(base_lr)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.inner.param_groups:
            for p in group["params"]:
                if id(p) not in self.owned:
                    p.grad = None  # not ours: no state, no update
        self.inner.step()
        for group, owner, params in self.plan:
            if not group.active:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=group.ranks[owner], group=group.pg)
            offset = 0
            for p in params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    def state_bytes(self) -> int:
        total = 0
        for opt in self.inner.optimizers.values():
            for st in opt.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return total
