"""Parameters, gradients and optimiser state of one rank — counted, not estimated.

The rank's parameters come from a skeleton of the model it builds (meta storage, the real
module code and ShardSpecs: :mod:`megatron_s2.models.family.skeleton`), so TP/EP/ETP splits,
vocabulary shards, Engram row partitions and pipeline placement are exactly the runtime's.
The optimiser side replays the runtime's decisions on those parameters:

* the update rule of every parameter from the recipe's rule table
  (:func:`~megatron_s2.optim.param_groups.assign_param_groups`): Muon, head-wise Muon and the
  Sinkhorn-balanced update keep one momentum buffer; AdamW keeps two moments and a float32
  ``step`` scalar;
* ZeRO-1 (``parallel.distributed_optimizer``): state only for the parameters this rank owns,
  with the owner assignment of :class:`~megatron_s2.optim.distributed_optimizer.DistributedOptimizer`
  (:func:`assign_owners` over each reduction group — data x context for dense parameters,
  expert-data for experts, Engram replicas for table partitions);
* frozen parameters (``phase.freeze``) have neither gradients nor optimiser state;
* pipeline shadow replicas (§3.1.2) hold parameters on consumer stages but no optimiser
  state; their gradients are folded into the owner's before the step;
* ``series_forecast`` (``phase.kind: timeseries_forecast``): the last stage's forecaster, trained
  with the model, and its replica of the series encoder under pp > 1, parameters and gradients
  without optimiser state (:mod:`.series_lane`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.optimizer import OptimizerConfig
from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.models.family.skeleton import model_skeleton
from megatron_s2.parallel.offline_groups import group_table, layout_groups, stage_model_kwargs
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["ModelStateBytes", "model_state_bytes", "component_of"]

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps ``step`` as a float32 scalar tensor


def component_of(name: str) -> str:
    """The planner's component of a parameter name (the families' naming conventions: V4.1's
    ``mlp`` / ``attention`` / ``engram`` / ``*_hc``, Intern-S2's ``moe`` / ``linear_attn``)."""
    if name.startswith(("embedding.", "output_layer.")):
        return "embedding + head"
    if name.startswith("vision."):
        return "vision encoder"
    if name.startswith("timeseries."):
        return "series encoder"
    if name.startswith("timeseries replica."):
        return "series encoder replica"
    if name.startswith("forecaster."):
        return "forecaster"
    if ".engram." in name:
        return "engram"
    if ".experts." in name:
        return "moe routed experts"
    if ".mlp." in name or ".moe." in name:
        return "moe router + shared"
    if ".linear_attn." in name:
        return "linear attention"
    if ".attention." in name:
        return "attention"
    if "_hc." in name:
        return "mhc"
    return "norms" if "norm" in name else "other"


@dataclass
class ModelStateBytes:
    parameters: dict[str, int] = field(default_factory=dict)    # component -> bytes
    shadow_parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer: dict[str, int] = field(default_factory=dict)     # rule kind -> bytes
    engram: int = 0                                              # table parameters + grads + optimiser

    @property
    def parameter_bytes(self) -> int:
        return sum(self.parameters.values()) + self.shadow_parameters

    @property
    def optimizer_bytes(self) -> int:
        return sum(self.optimizer.values())

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.buffers + self.gradients + self.optimizer_bytes


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


_SKELETONS: dict[tuple, object] = {}


def _full_skeleton(cfg: ModelSchema, key: tuple, groups):
    """All layers, embedding and head for the group sizes/ranks in ``key`` (the only thing
    module constructors read), shared by every layout and stage with the same key."""
    if (cfg, key) not in _SKELETONS:
        if len(_SKELETONS) >= 32:
            _SKELETONS.pop(next(iter(_SKELETONS)))
        _SKELETONS[(cfg, key)] = model_skeleton(cfg, groups)
    return _SKELETONS[(cfg, key)]


class _Subset:
    """The parameters of one pipeline rank, as ``assign_param_groups`` iterates a model."""

    def __init__(self, named: dict):
        self._named = named

    def named_parameters(self):
        return iter(self._named.items())


def _stage_state(cfg: ModelSchema, layout: ParallelLayout, rank: int) -> tuple[dict, dict]:
    """(parameters, persistent buffers) by name held by ``rank`` — a filter of the cached
    all-layer skeleton by the rank's stage layers (see ``build_pipeline_model``)."""
    groups = layout_groups(layout, rank)
    key = (groups.sequence_parallel,) + tuple((getattr(groups, f).size, getattr(groups, f).rank)
                                             for f in ("tp", "ep", "etp", "engram"))
    model = _full_skeleton(cfg, key, groups)
    kwargs = stage_model_kwargs(layout, rank)
    layers = set(kwargs.get("layers", range(cfg.num_layers)))
    pre, post = kwargs.get("pre_process", True), kwargs.get("post_process", True)

    def keep(name: str) -> bool:
        if name.startswith("layers."):
            return int(name.split(".")[1]) in layers
        # the embedding and the vision and series encoders sit on the first stage (§3.1.1), the rest with the head
        return pre if name.startswith(("embedding.", "vision.", "timeseries.")) else post

    params = {n: p for n, p in model.named_parameters() if keep(n)}
    buffers = {n: b for n, b in model.state_dict(keep_vars=True).items() if keep(n) and n not in params}
    return params, buffers


def _zero1_owned(trainable: dict, layout: ParallelLayout, rank: int, worst: bool) -> set[str]:
    """Names whose optimiser state ``rank`` keeps under ZeRO-1 (the runtime's owner rule); with
    ``worst`` the owned set of the most loaded rank of the same pipeline stage and model shard."""
    from megatron_s2.optim.distributed_optimizer import assign_owners
    from megatron_s2.parallel.grad_finalize import reduction_group

    table = group_table(layout)
    groups = layout_groups(layout, rank)
    by_kind: dict[str, list] = defaultdict(list)
    field_of = {"dp_cp": "dp_cp", "expert_dp": "expert_dp", "engram_replica": "engram_replica"}
    for name, p in trainable.items():
        kind, _ = reduction_group(p, groups)
        by_kind[kind].append((name, p))
    owners = {kind: assign_owners(named, len(table[field_of[kind]][rank])) for kind, named in by_kind.items()}
    sizes = {name: _nbytes(p) for name, p in trainable.items()}

    def owned_by(r: int) -> set[str]:
        return {name for kind, own in owners.items() for name, o in own.items()
                if o == table[field_of[kind]][r].index(r)}

    if not worst:
        return owned_by(rank)
    peers = set(table["dp_cp"][rank]) | set(table["expert_dp"][rank]) | set(table["engram_replica"][rank])
    return max((owned_by(r) for r in sorted(peers)), key=lambda names: sum(sizes[n] for n in names))


def model_state_bytes(cfg: ModelSchema, layout: ParallelLayout, rank: int, optimizer: OptimizerConfig, *,
                      freeze: tuple[str, ...] = (), parallel: ParallelConfig | None = None,
                      zero1_worst: bool = False, skeleton=None, series_forecast: bool = False) -> ModelStateBytes:
    """Bytes of parameters, buffers, gradients and optimiser state held by ``rank`` (with
    ``zero1_worst``: the optimiser state of the most loaded ZeRO-1 peer of ``rank``).
    ``skeleton``: the rank's own model on the meta device (the trainer's, before it materialises
    it), instead of one built here. ``series_forecast``: count the forecasting phase's modules
    beside the model (module docstring)."""
    from megatron_s2.models.family import family_of
    from megatron_s2.optim.param_groups import assign_param_groups
    from megatron_s2.planning.series_lane import encoder_replica_parameters, forecast_branch_parameters

    if skeleton is not None:
        params = dict(skeleton.named_parameters())
        buffers = {n: b for n, b in skeleton.state_dict(keep_vars=True).items() if n not in params}
    else:
        params, buffers = _stage_state(cfg, layout, rank)
    replica: dict[str, torch.Tensor] = {}
    stage = stage_model_kwargs(layout, rank)
    if series_forecast and stage.get("post_process", True):
        params = {**params, **{n: p for n, p in forecast_branch_parameters(cfg).items() if n not in params}}
        if not stage.get("pre_process", True):
            replica = encoder_replica_parameters(cfg)
    out = ModelStateBytes()
    trainable = {n: p for n, p in params.items() if not any(fnmatch(n, pat) for pat in freeze)}
    for name, p in params.items():
        comp = component_of(name)
        out.parameters[comp] = out.parameters.get(comp, 0) + _nbytes(p)
    out.buffers = sum(_nbytes(b) for b in buffers.values())
    shadows = family_of(cfg).memory_model(cfg).shadow_parameters(layout, rank, parallel or ParallelConfig())
    out.shadow_parameters = sum(_nbytes(p) for p, _ in shadows)
    out.gradients = sum(_nbytes(p) for p in trainable.values())
    for p in replica.values():  # parameters and gradients, no optimiser state
        out.parameters["series encoder replica"] = out.parameters.get("series encoder replica", 0) + _nbytes(p)
        out.gradients += _nbytes(p)
    owned = _zero1_owned(trainable, layout, rank, zero1_worst) if layout.distributed_optimizer else set(trainable)
    frozen_model = set(params) - set(trainable)
    for p in params.values():
        p.requires_grad_(True)
    for a in assign_param_groups(_Subset(params), optimizer.rules_for(cfg)):
        if a.name in frozen_model or a.name not in owned:
            continue
        size = _nbytes(a.param)
        kind = "adamw" if a.rule.kind == "adamw" else ("sinkhorn" if a.rule.kind == "sinkhorn" else "muon")
        out.optimizer[kind] = out.optimizer.get(kind, 0) + (2 * size + ADAM_STEP_BYTES if kind == "adamw" else size)
        if ".engram.table" in a.name:
            out.engram += size
    out.engram += sum(_nbytes(p) * (2 if n in trainable else 1) for n, p in params.items() if ".engram.table" in n)
    return out
