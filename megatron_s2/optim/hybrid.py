"""The combined optimiser of report §2.5 / §4.2.2: Muon + Sinkhorn-balanced momentum + AdamW.

:func:`build_optimizer` assigns every trainable parameter with the rule table
(:mod:`.param_groups`), makes one param group per (rule, head count) and hands the groups to
three sub-optimisers:

* :class:`.Muon`: linear matrices, head-wise for Query weights (mu 0.95, wd 0.1, RMS 0.18);
* :class:`.SinkhornMomentum`: embedding, prediction head, Engram tables (mu 0.95, K 11,
  gamma 0.18, Engram lr x5);
* ``torch.optim.AdamW``: norm weights (wd 0.1), biases and scalars (no wd); betas (0.9, 0.95),
  eps 1e-20.

:class:`HybridOptimizer` drives them as one: ``set_lr(base_lr)`` writes
``base_lr * lr_mult`` into every group (the schedule calls it each step), ``step()``,
``zero_grad()``, and a ``state_dict()`` that restores a run bit-identically on CPU.

Precision: the optimiser steps the parameters it is given, in their dtype, with momenta
``zeros_like`` them. With ``model.params_dtype: float32`` (GPU recipes: plus
``compute_dtype: bfloat16``) those parameters *are* the float32 master weights and the
gradients arrive in float32; there is no separate master copy to keep in sync
(:mod:`megatron_s2.models.v41.precision` gives the reasons and the memory arithmetic).

Sharded parameters (``ShardSpec``): Muon needs whole matrices, so a parameter whose shard cuts
a matrix dimension (tensor parallelism) is rejected; cutting the batch dimension of a 3-D
``[experts, out, in]`` tensor (expert parallelism) is exact and allowed. A Sinkhorn table whose
rows are partitioned (vocabulary-parallel embedding / head, engram-parallel tables) is exact
when its process group is given in ``row_groups``: the column statistics are then reduced over
that group (:func:`~megatron_s2.optim.sinkhorn.sinkhorn_balance`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_s2.config.optimizer import OptimizerConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.optim.muon import Muon
from megatron_s2.optim.param_groups import ParamAssignment, assign_param_groups
from megatron_s2.optim.sinkhorn import SinkhornMomentum
from megatron_s2.parallel.sharding import shard_spec

__all__ = ["HybridOptimizer", "build_optimizer"]

_FAMILY = {"muon": "muon", "muon_headwise": "muon", "sinkhorn": "sinkhorn", "adamw": "adamw"}


class HybridOptimizer:
    """Several ``torch.optim.Optimizer`` instances stepped, scheduled and checkpointed as one."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], *, allow_empty: bool = False) -> None:
        """``allow_empty``: no sub-optimiser (a rank with nothing to train; :func:`build_optimizer`)."""
        if not optimizers and not allow_empty:
            raise ValueError("HybridOptimizer needs at least one sub-optimiser")
        self.optimizers = dict(optimizers)
        self._lr_set = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All groups of all sub-optimisers (live dicts: each has ``lr``, ``lr_mult``, ``kind``)."""
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def set_lr(self, base_lr: float) -> None:
        """Set every group's learning rate to ``base_lr * lr_mult``."""
        if base_lr < 0:
            raise ValueError(f"base_lr must be non-negative, got {base_lr}")
        for group in self.param_groups:
            group["lr"] = base_lr * group["lr_mult"]
        self._lr_set = True

    @torch.no_grad()
    def step(self) -> None:
        if not self._lr_set:
            raise RuntimeError("HybridOptimizer.step() before set_lr(): call set_lr(schedule.lr_at(step)) first")
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Sub-optimiser state dicts by kind (tensors are live references, as in torch)."""
        return {"optimizers": {kind: optimizer.state_dict() for kind, optimizer in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore momenta, Adam moments, step counts and the last learning rates.

        Hyper-parameters (momentum, weight decay, betas, ...) stay those of this run's config,
        so a recipe change on resume takes effect instead of being overwritten by the checkpoint.
        """
        saved = state_dict.get("optimizers")
        if not isinstance(saved, dict) or set(saved) != set(self.optimizers):
            found = sorted(saved) if isinstance(saved, dict) else saved
            raise ValueError(f"optimizer state holds sub-optimisers {found}, this run has {sorted(self.optimizers)}; "
                             f"the parameter-group rules or the model changed since the checkpoint")
        for kind, optimizer in self.optimizers.items():
            _check_same_params(kind, optimizer.param_groups, saved[kind]["param_groups"])
        for kind, optimizer in self.optimizers.items():
            current = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
            optimizer.load_state_dict(saved[kind])
            for group, hyper in zip(optimizer.param_groups, current):
                group.update(hyper)
        self._lr_set = True

    def __repr__(self) -> str:
        parts = [f"{kind}: {len(opt.param_groups)} groups, {sum(len(g['params']) for g in opt.param_groups)} params"
                 for kind, opt in self.optimizers.items()]
        return f"HybridOptimizer({'; '.join(parts)})"


def _check_same_params(kind: str, groups: list[dict], saved_groups: list[dict]) -> None:
    if len(groups) != len(saved_groups):
        raise ValueError(f"optimizer state for '{kind}' has {len(saved_groups)} param groups, this run has "
                         f"{len(groups)}; the parameter-group rules or the model changed")
    for group, saved in zip(groups, saved_groups):
        names, saved_names = group.get("param_names"), saved.get("param_names")
        if names is not None and saved_names is not None and list(names) != list(saved_names):
            diff = next((a, b) for a, b in zip([*names, None], [*saved_names, None]) if a != b)
            raise ValueError(f"optimizer state for '{kind}' group '{group.get('rule')}' holds different "
                             f"parameters: this run has {diff[0]!r} where the checkpoint has {diff[1]!r}")


def _check_shards(assignment: ParamAssignment, row_groups: Mapping[str, Any], matrix_shards: Mapping[str, Any]) -> None:
    """Reject shards on which the update would differ from the single-rank update."""
    if assignment.rule.kind == "adamw":
        return
    param = assignment.param
    spec = shard_spec(param)
    split_dims = {dim for dim, _, count in spec.splits if count > 1}
    allowed = {0} if param.ndim == 3 else set()
    if assignment.rule.kind == "sinkhorn" and assignment.name in row_groups:
        allowed.add(param.ndim - 2)
    if assignment.rule.kind == "muon_headwise" and assignment.head_split >= 1:
        allowed.add(param.ndim - 2)  # whole heads per rank: each head's matrix is local
    if assignment.name in matrix_shards:
        allowed.add(matrix_shards[assignment.name][1] % param.ndim)
    if split_dims - allowed:
        hint = ("pass the group its rows are partitioned over in row_groups"
                if assignment.rule.kind == "sinkhorn" else "gather it first or run without tensor parallelism")
        raise ConfigError(f"'{assignment.name}' ({assignment.rule.kind}) is sharded along dim {sorted(split_dims)} of "
                          f"its full shape {spec.full_shape}, but the update needs the whole matrix; {hint}")


def _new_group(assignment: ParamAssignment, cfg: OptimizerConfig) -> dict[str, Any]:
    rule = assignment.rule
    group: dict[str, Any] = {"params": [], "lr": 0.0, "lr_mult": rule.lr_mult, "kind": rule.kind, "rule": rule.pattern}
    if rule.kind in ("muon", "muon_headwise"):
        group["weight_decay"] = cfg.muon_weight_decay if rule.weight_decay else 0.0
        group["head_split"] = assignment.head_split
    elif rule.kind == "adamw":
        group["weight_decay"] = cfg.adamw_weight_decay if rule.weight_decay else 0.0
    return group


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimizerConfig,
    *,
    row_groups: Mapping[str, dist.ProcessGroup | None] | None = None,
    matrix_shards: Mapping[str, tuple[Any, int]] | None = None,
    allow_empty: bool = False,
) -> HybridOptimizer:
    """Assign ``model``'s trainable parameters by ``cfg.rules`` and build the hybrid optimiser.

    ``row_groups`` maps the name of a row-partitioned Sinkhorn table to the process group of
    its row shards. Learning rates start at zero; call ``set_lr`` (the schedule) before the
    first ``step``. ``allow_empty``: a rank may hold nothing to train (a pipeline stage of a frozen
    backbone while the DSpark drafter on the last stage trains); its optimiser is then empty.
    """
    row_groups = dict(row_groups or {})
    matrix_shards = dict(matrix_shards or {})
    assignments = assign_param_groups(model, cfg.rules_for(getattr(model, "config", None)))
    if not assignments and not allow_empty:
        raise ConfigError("model has no trainable parameters to optimise")
    unknown = set(row_groups) - {a.name for a in assignments if a.rule.kind == "sinkhorn"}
    if unknown:
        raise ConfigError(f"row_groups names {sorted(unknown)}, which are not trainable Sinkhorn parameters")
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for assignment in assignments:
        _check_shards(assignment, row_groups, matrix_shards)
        key = (assignment.rule_index, assignment.head_split)
        if key not in groups:
            groups[key] = _new_group(assignment, cfg)
        groups[key]["params"].append((assignment.name, assignment.param))
    by_family: dict[str, list[dict[str, Any]]] = {"muon": [], "sinkhorn": [], "adamw": []}
    for group in groups.values():
        by_family[_FAMILY[group["kind"]]].append(group)

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if by_family["muon"]:
        optimizers["muon"] = Muon(by_family["muon"], momentum=cfg.momentum, nesterov=cfg.nesterov,
                                  update_rms=cfg.muon_update_rms, ns_steps=cfg.ns_steps, ns_dtype=cfg.ns_dtype,
                                  ns_polish_steps=cfg.ns_polish_steps,
                                  matrix_shards={a.param: matrix_shards[a.name] for a in assignments
                                                 if a.name in matrix_shards and a.rule.kind == "muon"})
    if by_family["sinkhorn"]:
        optimizers["sinkhorn"] = SinkhornMomentum(by_family["sinkhorn"], momentum=cfg.momentum, nesterov=cfg.nesterov,
                                                  lr_scale=cfg.sinkhorn_lr_scale, iters=cfg.sinkhorn_iters,
                                                  tau=cfg.sinkhorn_tau, eps=cfg.sinkhorn_eps,
                                                  row_groups={a.param: row_groups[a.name] for a in assignments
                                                              if a.name in row_groups})
    if by_family["adamw"]:
        optimizers["adamw"] = torch.optim.AdamW(by_family["adamw"], lr=0.0, betas=cfg.adamw_betas,
                                                eps=cfg.adamw_eps, weight_decay=0.0)
    return HybridOptimizer(optimizers, allow_empty=allow_empty)
