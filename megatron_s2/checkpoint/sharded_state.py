"""What a rank saves and what it asks for when loading, as flat dicts of :class:`GlobalShard`.

Every tensor is keyed by a layout-independent name (see :mod:`.format`) and described by its
global shape and this rank's slice (the parameter's ShardSpec), so the same key set, with
different slices, comes out of every layout:

* model: ``model.state_dict(keep_vars=True)`` — the rank's own parameters and persistent
  buffers under their global names. Pipeline shadow replicas are not submodules of the model
  (they live in the pipeline runtime's ``shadows``) and never appear; buffers and parameters without
  a ShardSpec are whole tensors replicated on every rank that holds them.
* optimiser: the state of every parameter this rank *updates*: all of its parameters without
  ZeRO-1, only the parameters it owns with it (``DistributedOptimizer.owned``), so a state
  tensor is written by its owner only and read, after a layout change, by the new owner.
  State tensors shaped like the parameter share its ShardSpec; 0-d ones (Adam's step) are
  stored whole.
* RNG: this rank's generator states (torch, Python, NumPy), under ``rng/<rank>/``.
* local: other tensors of this rank only (a rollout engine's caches), under ``local/<rank>/``;
  like the RNG states they are read back only by the same rank of the same layout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_s2.checkpoint.dcp_io import GlobalShard
from megatron_s2.checkpoint.format import (
    LOCAL_PREFIX,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    RNG_PREFIX,
    CheckpointError,
)
from megatron_s2.parallel.sharding import shard_spec

__all__ = [
    "OptimizerTargets",
    "local_from_tensors",
    "local_shards",
    "local_targets",
    "model_shards",
    "optimizer_shards",
    "optimizer_targets",
    "rng_from_tensors",
    "rng_shards",
    "rng_targets",
    "updated_parameters",
]


def _copy(t: torch.Tensor, snapshot: bool) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if snapshot else t


def model_shards(model: nn.Module, *, snapshot: bool = False) -> dict[str, GlobalShard]:
    """This rank's model tensors (``snapshot``: copied to host memory, for asynchronous saves;
    otherwise the live tensors, which a load fills in place)."""
    return {MODEL_PREFIX + name: GlobalShard.from_spec(_copy(t, snapshot), shard_spec(t))
            for name, t in model.state_dict(keep_vars=True).items()}


def updated_parameters(optimizer) -> Iterator[tuple[str, str, nn.Parameter, torch.optim.Optimizer]]:
    """(sub-optimiser kind, parameter name, parameter, sub-optimiser) of every parameter whose
    optimiser state lives on this rank."""
    inner = getattr(optimizer, "inner", optimizer)
    owned = getattr(optimizer, "owned", None)  # ZeRO-1: ids of the parameters this rank updates
    subs = getattr(inner, "optimizers", None)
    if subs is None:
        raise CheckpointError(f"{type(inner).__name__}: expected a HybridOptimizer (sub-optimisers by kind)")
    for kind, opt in subs.items():
        for group in opt.param_groups:
            names = group.get("param_names")
            if names is None or len(names) != len(group["params"]):
                raise CheckpointError(f"optimizer '{kind}': its param groups carry no parameter names; "
                                      "build it with (name, parameter) pairs")
            for name, p in zip(names, group["params"]):
                if owned is None or id(p) in owned:
                    yield kind, name, p, opt


def _state_shard(fqn: str, value, param: nn.Parameter, snapshot: bool) -> GlobalShard:
    if not torch.is_tensor(value):
        if not isinstance(value, (int, float)):
            raise CheckpointError(f"'{fqn}': optimiser state of type {type(value).__name__} cannot be stored")
        value = torch.tensor(value, dtype=torch.float64, device="cpu")
    value = _copy(value, snapshot)
    if tuple(value.shape) == tuple(param.shape):
        return GlobalShard.from_spec(value, shard_spec(param))
    if value.dim() == 0:
        return GlobalShard(value, (), ())
    raise CheckpointError(f"'{fqn}': state of shape {tuple(value.shape)} for a parameter of local shape "
                          f"{tuple(param.shape)}; only parameter-shaped and scalar state is layout-independent")


def optimizer_shards(optimizer, *, snapshot: bool = False) -> dict[str, GlobalShard]:
    out = {}
    for kind, name, p, opt in updated_parameters(optimizer):
        for key, value in opt.state.get(p, {}).items():
            fqn = f"{OPTIM_PREFIX}{kind}/{name}/{key}"
            out[fqn] = _state_shard(fqn, value, p, snapshot)
    return out


def rng_shards(rng: dict, rank: int) -> dict[str, GlobalShard]:
    out = {}
    for key, value in rng.items():
        t = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else torch.tensor(int(value), dtype=torch.int64, device="cpu")
        out[f"{RNG_PREFIX}{rank:05d}/{key}"] = GlobalShard(t, tuple(t.shape), (0,) * t.dim())
    return out


@dataclass
class OptimizerTargets:
    """Where loaded optimiser state goes: DCP targets plus (sub-optimiser, parameter, state)."""

    shards: dict[str, GlobalShard] = field(default_factory=dict)
    assignments: list[tuple[torch.optim.Optimizer, nn.Parameter, dict[str, torch.Tensor]]] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)  # parameters without stored state (start from zero)

    def apply(self) -> None:
        for opt, p, state in self.assignments:
            opt.state[p] = dict(state)


def optimizer_targets(optimizer, index) -> OptimizerTargets:
    """Allocate this rank's optimiser state from the checkpoint index (dtype, global shape)."""
    stored: dict[tuple[str, str], dict[str, object]] = defaultdict(dict)
    kinds: dict[str, str] = {}
    for fqn, md in index.state_dict_metadata.items():
        if fqn.startswith(OPTIM_PREFIX):
            if not isinstance(md, TensorStorageMetadata) or fqn.count("/") < 3:
                raise CheckpointError(f"'{fqn}': not an optimiser state tensor (optim/<kind>/<parameter>/<key>)")
            kind, rest = fqn[len(OPTIM_PREFIX):].split("/", 1)
            name, key = rest.rsplit("/", 1)
            stored[(kind, name)][key] = md
            kinds[name] = kind
    out = OptimizerTargets()
    for kind, name, p, opt in updated_parameters(optimizer):
        entries = stored.get((kind, name))
        if entries is None:
            if name in kinds:
                raise CheckpointError(f"optimizer state of '{name}' was saved by '{kinds[name]}', this run updates it "
                                      f"with '{kind}'; the optimiser rules changed (load without optimizer state: "
                                      "checkpoint.load_optimizer=false)")
            out.fresh.append(name)
            continue
        spec = shard_spec(p)
        state = {}
        for key, md in sorted(entries.items()):
            fqn = f"{OPTIM_PREFIX}{kind}/{name}/{key}"
            if tuple(md.size) == spec.full_shape:
                dtype = p.dtype if md.properties.dtype.is_floating_point else md.properties.dtype
                local = torch.empty(p.shape, dtype=dtype, device=p.device)
                out.shards[fqn] = GlobalShard.from_spec(local, spec)
            elif len(md.size) == 0:
                local = torch.empty((), dtype=md.properties.dtype, device="cpu")  # step counts: host scalars
                out.shards[fqn] = GlobalShard(local, (), ())
            else:
                raise CheckpointError(f"'{fqn}': stored with shape {tuple(md.size)}, but parameter '{name}' has "
                                      f"global shape {spec.full_shape}")
            state[key] = local
        out.assignments.append((opt, p, state))
    return out


def rng_targets(index, rank: int) -> dict[str, GlobalShard]:
    prefix = f"{RNG_PREFIX}{rank:05d}/"
    out = {}
    for fqn, md in index.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            local = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu")  # RNG states are host tensors
            out[fqn] = GlobalShard(local, tuple(md.size), (0,) * len(md.size))
    return out


def rng_from_tensors(shards: dict[str, GlobalShard]) -> dict:
    """Back to :func:`megatron_s2.training.rng.rng_state`'s form (0-d integers -> int)."""
    out = {}
    for fqn, shard in shards.items():
        t = shard.local
        out[fqn.rsplit("/", 1)[1]] = int(t) if t.dim() == 0 and not t.dtype.is_floating_point else t
    return out


def local_shards(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, GlobalShard]:
    out = {}
    for key, value in tensors.items():
        t = value.detach().to("cpu", copy=True).contiguous()
        out[f"{LOCAL_PREFIX}{rank:05d}/{key}"] = GlobalShard(t, tuple(t.shape), (0,) * t.dim())
    return out


def local_targets(index, rank: int) -> dict[str, GlobalShard]:
    prefix = f"{LOCAL_PREFIX}{rank:05d}/"
    out = {}
    for fqn, md in index.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            local = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu")
            out[fqn] = GlobalShard(local, tuple(md.size), (0,) * len(md.size))
    return out


def local_from_tensors(shards: dict[str, GlobalShard], rank: int) -> dict[str, torch.Tensor]:
    prefix = f"{LOCAL_PREFIX}{rank:05d}/"
    return {fqn[len(prefix):]: shard.local for fqn, shard in shards.items()}
