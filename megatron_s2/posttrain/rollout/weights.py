"""Co-located weights: the rollout engine's model, and moving the learner's weights into it (report §5.2.1).

Two placements, chosen by :func:`megatron_s2.parallel.rollout_layout.rollout_placement` from the training layout:

* **shared** — the training layout is tensor / expert / data parallel only (pp = cp = 1, no
  sequence parallelism): the engine runs the training model itself. An optimiser step changes
  the weights in place; a weight "update" is only the version bump (no copy, no memory).
* **transferred** — under pipeline or context parallelism or sequence parallelism the engine
  cannot run the training stages, so every rank also holds a rollout model with tensor
  parallelism of the training tp and expert parallelism ``rollout_ep`` (pp = cp = 1; its process
  groups come from :func:`~megatron_s2.parallel.setup.build_groups` of a rollout layout).
  :class:`WeightTransfer` moves the weights in memory after each update: for each tensor of
  the model, the ranks holding distinct slices of it (by their global-slice
  :class:`~megatron_s2.parallel.sharding.ShardSpec`; replicas write once) place them into a
  zero global buffer, one all-reduce (sum) per bucket of tensors assembles the global tensors
  on every rank, and each rank copies the slice its rollout parameter holds. No file, no pickle.
  Cost per update: one all-reduce of the model's bytes (bucketed, transient buffers of at most
  ``bucket_mb``); this is the simple, layout-independent path, not a bandwidth-optimal one.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megatron_s2.parallel.sharding import shard_spec

__all__ = ["WeightTransfer", "assemble", "global_plan"]


def _slices(spec) -> list[list[int]]:
    return [[s.start, s.stop] for s in spec.slices()]


class WeightTransfer:
    """Global tensors assembled from the training shards, sliced into a rollout model (module docstring)."""

    def __init__(self, train_model: torch.nn.Module, rollout_model: torch.nn.Module, *, rank: int, world_size: int,
                 bucket_mb: float = 256.0):
        self.rank, self.world = rank, world_size
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.source = train_model.state_dict(keep_vars=True)
        self.target = rollout_model.state_dict(keep_vars=True)
        self.plan = global_plan(self.source, world_size)
        missing = sorted(set(self.target) - set(self.plan))
        if missing:
            raise RuntimeError(f"weight transfer: the training model holds no '{missing[0]}' (and {len(missing) - 1} "
                               "more) that the rollout model needs")
        for name, t in self.target.items():
            if list(shard_spec(t).full_shape) != self.plan[name]["shape"]:
                raise RuntimeError(f"weight transfer: '{name}' is {list(shard_spec(t).full_shape)} in the rollout "
                                   f"model, {self.plan[name]['shape']} in training")
        self.names = sorted(self.target)

    @torch.no_grad()
    def __call__(self) -> int:
        """Move the weights; returns the bytes assembled per rank. Collective over the world."""
        total = 0
        for dtype, names in self._buckets():
            device = next(iter(self.target.values())).device
            flat, views = assemble(self.plan, self.source, names, dtype, device, self.rank, self.world)
            for name in names:
                dst = self.target[name]
                dst.copy_(views[name][shard_spec(dst).slices()].to(dst.dtype))
            total += flat.numel() * flat.element_size()
        return total

    def _buckets(self):
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in self.names:
            by_dtype.setdefault(getattr(torch, self.plan[name]["dtype"]), []).append(name)
        for dtype, names in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            bucket, used = [], 0
            item = torch.empty((), dtype=dtype).element_size()
            for name in names:
                size = _volume([[0, n] for n in self.plan[name]["shape"]]) * item
                if bucket and used + size > self.bucket_bytes:
                    yield dtype, bucket
                    bucket, used = [], 0
                bucket.append(name)
                used += size
            if bucket:
                yield dtype, bucket


def global_plan(source: dict[str, torch.Tensor], world_size: int) -> dict[str, dict]:
    """Every tensor of the model over the world's ranks: its global shape, dtype and which rank
    writes each distinct slice (the lowest holding it); collective (an all-gather of the metadata)."""
    local = {name: {"shape": list(shard_spec(t).full_shape), "slices": _slices(shard_spec(t)),
                    "dtype": str(t.dtype).replace("torch.", "")} for name, t in source.items()}
    if world_size == 1:
        everyone = [local]
    else:
        from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects

        device = next(iter(source.values())).device
        everyone = gather_objects(local, ReplicaTopology(0, 1, True, world_size, str(device)))
    plan: dict[str, dict] = {}
    for r, part in enumerate(everyone):
        for name, m in part.items():
            entry = plan.setdefault(name, {"shape": m["shape"], "dtype": m["dtype"], "writers": {}})
            if entry["shape"] != m["shape"]:
                raise RuntimeError(f"weight transfer: '{name}' has global shape {m['shape']} on rank {r}, "
                                   f"{entry['shape']} elsewhere")
            entry["writers"].setdefault(json.dumps(m["slices"]), r)  # the lowest rank holding a slice writes it
    for name, entry in plan.items():
        covered = sum(_volume(json.loads(k)) for k in entry["writers"])
        total = _volume([[0, n] for n in entry["shape"]])
        if covered != total:
            raise RuntimeError(f"weight transfer: the training shards of '{name}' cover {covered} of {total} "
                               "elements (overlapping or missing slices)")
    return plan


@torch.no_grad()
def assemble(plan: dict[str, dict], source: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype,
             device, rank: int, world_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The global tensors ``names`` (one dtype) in one flat buffer on every rank: each slice's
    writer places it in a zero buffer, one all-reduce (sum) assembles them; collective.
    Returns the buffer and each tensor's view into it."""
    sizes = [_volume([[0, n] for n in plan[n]["shape"]]) for n in names]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    views, offset = {}, 0
    for name, size in zip(names, sizes):
        views[name] = flat[offset:offset + size].view(plan[name]["shape"])
        offset += size
    for name in names:
        src = source.get(name)
        if src is None:
            continue
        spec = shard_spec(src)
        if plan[name]["writers"].get(json.dumps(_slices(spec))) == rank:
            views[name][spec.slices()] = src.detach().to(device=device, dtype=dtype)
    if world_size > 1:
        dist.all_reduce(flat)
    return flat, views


def _volume(slices: list[list[int]]) -> int:
    v = 1
    for a, b in slices:
        v *= b - a
    return v
