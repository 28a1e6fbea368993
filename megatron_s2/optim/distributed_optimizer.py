"""ZeRO-1: optimiser state sharded over data-parallel replicas, by whole parameters.

Muon and Sinkhorn need whole matrices, so the unit of sharding is a parameter (a TP/EP
shard of it), not a flat slice of a buffer. Within each *replica group* of a parameter —
the ranks holding an identical copy (its placement's ``replicas``): data x context for dense
parameters, expert data parallel for experts, the Engram replica group for table partitions —
one rank *owns* it: only the owner keeps optimiser state (momentum, Adam moments) and computes
its update. Owners are assigned greedily by size (largest first, to the least loaded rank)
from a deterministic order, so every rank agrees on the assignment and tensor-parallel peers
(same data-parallel coordinate) own the same parameters — which Muon's gathered Newton-Schulz
and Sinkhorn's column statistics over tp require.

Communication (megatron-core's distributed optimiser, by whole parameters): the gradients are
**reduce-scattered to their owners** instead of all-reduced, and after the step the owners'
updated parameters are **all-gathered** back. Each bucket lays out, for every owner in rank
order, a chunk of that owner's parameters (whole tensors, about ``bucket_mb / g`` each),
padded to the bucket's largest chunk; one reduce-scatter of the bucket leaves each owner the
sums of its own gradients, one all-gather of the same layout returns every updated parameter.
Per rank a ring all-reduce of N bytes sends 2(g-1)/g N; reduce-scatter + all-gather send
(g-1)/g (N + padding) each — plain data parallelism's wire, where the former all-reduce +
broadcast of the updated parameters cost 1.5x (``bench/comm_volume.py`` prints the ratio).
Non-owners drop their gradients after the reduce-scatter, so clipping sees each reduced
gradient once per owner (:func:`~megatron_s2.parallel.grad_finalize.clip_grads` with ``zero1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.grad_finalize import reduction_group

__all__ = ["DistributedOptimizer", "assign_owners", "owner_buckets"]


def assign_owners(named: list[tuple[str, torch.nn.Parameter]], size: int) -> dict[str, int]:
    load = [0] * size
    owners = {}
    for name, p in sorted(named, key=lambda np_: (-np_[1].numel(), np_[0])):
        i = min(range(size), key=lambda r: (load[r], r))
        owners[name] = i
        load[i] += p.numel()
    return owners


def owner_buckets(per_owner: list[list[int]], bucket_elems: int) -> list[list[list[int]]]:
    """Split each owner's parameter sizes (in order) into chunks of about ``bucket_elems / g``
    elements (whole parameters, at least one per chunk); bucket ``b`` holds chunk ``b`` of every
    owner. Returns ``buckets[b][owner]`` = indices into that owner's list."""
    budget = max(1, bucket_elems // max(len(per_owner), 1))
    chunked: list[list[list[int]]] = []
    for sizes in per_owner:
        chunks, current, filled = [], [], 0
        for i, n in enumerate(sizes):
            if current and filled + n > budget:
                chunks.append(current)
                current, filled = [], 0
            current.append(i)
            filled += n
        if current:
            chunks.append(current)
        chunked.append(chunks)
    count = max((len(c) for c in chunked), default=0)
    return [[c[b] if b < len(c) else [] for c in chunked] for b in range(count)]


@dataclass
class _Bucket:
    """One reduce-scatter / all-gather: ``chunks[r]`` are owner r's parameters, ``width`` the
    padded elements per owner."""

    group: Group
    chunks: list[list[torch.nn.Parameter]]
    width: int
    dtype: torch.dtype


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Group) -> None:
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op(out, flat, group=group.pg)


def _all_gather(out: torch.Tensor, flat: torch.Tensor, group: Group) -> None:
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    op(out, flat, group=group.pg)


class DistributedOptimizer:
    """Wraps the hybrid optimiser; same interface (set_lr, step, zero_grad, state_dict), plus
    :meth:`reduce_scatter_grads` which the gradient finaliser calls instead of the replicas'
    all-reduce."""

    def __init__(self, inner, model: torch.nn.Module, groups: ParallelGroups, bucket_mb: float = 25.0):
        self.inner = inner
        by_group: dict[str, tuple[Group, list[tuple[str, torch.nn.Parameter]]]] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            kind, group = reduction_group(p, groups)
            by_group.setdefault(kind, (group, []))[1].append((name, p))
        self.owned: set[int] = set()
        self.buckets: list[_Bucket] = []
        for kind in sorted(by_group):
            group, named = by_group[kind]
            owners = assign_owners(named, group.size)
            for name, p in named:
                if owners[name] == group.rank:
                    self.owned.add(id(p))
            if not group.active:
                continue
            for dtype in sorted({p.dtype for _, p in named}, key=str):
                per_owner = [[p for name, p in named if owners[name] == r and p.dtype == dtype]
                             for r in range(group.size)]
                elems = int(bucket_mb * 2 ** 20) // torch.empty((), dtype=dtype).element_size()
                for layout in owner_buckets([[p.numel() for p in ps] for ps in per_owner], elems):
                    chunks = [[per_owner[r][i] for i in idx] for r, idx in enumerate(layout)]
                    width = max(sum(p.numel() for p in chunk) for chunk in chunks)
                    self.buckets.append(_Bucket(group, chunks, width, dtype))

    @property
    def param_groups(self):
        return self.inner.param_groups

    def set_lr(self, base_lr: float) -> None:
        self.inner.set_lr(base_lr)

    @torch.no_grad()
    def reduce_scatter_grads(self) -> None:
        """Sum every gradient over its replica group into its owner; drop the others' copies.
        (Replicas run the same graph, so a parameter without a gradient has none anywhere.)"""
        for b in self.buckets:
            mine = b.chunks[b.group.rank]
            device = next(p.device for chunk in b.chunks for p in chunk)
            flat = torch.zeros(b.group.size * b.width, dtype=b.dtype, device=device)
            for r, chunk in enumerate(b.chunks):
                offset = r * b.width
                for p in chunk:
                    if p.grad is not None:
                        flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                    offset += p.numel()
            out = torch.empty(b.width, dtype=b.dtype, device=device)
            _reduce_scatter(out, flat, b.group)
            offset = 0
            for p in mine:
                if p.grad is not None:
                    p.grad.copy_(out[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            for r, chunk in enumerate(b.chunks):
                if r != b.group.rank:
                    for p in chunk:
                        p.grad = None

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every owner's updated parameters to every replica."""
        for b in self.buckets:
            mine = b.chunks[b.group.rank]
            device = next(p.device for chunk in b.chunks for p in chunk)
            local = torch.zeros(b.width, dtype=b.dtype, device=device)
            offset = 0
            for p in mine:
                local[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
            out = torch.empty(b.group.size * b.width, dtype=b.dtype, device=device)
            _all_gather(out, local, b.group)
            for r, chunk in enumerate(b.chunks):
                offset = r * b.width
                for p in chunk:
                    if r != b.group.rank:
                        p.copy_(out[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.inner.param_groups:
            for p in group["params"]:
                if id(p) not in self.owned:
                    p.grad = None  # not ours: no state, no update
        self.inner.step()
        self.all_gather_params()

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
