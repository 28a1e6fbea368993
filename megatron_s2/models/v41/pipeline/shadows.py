"""Shadow replicas of shared components across pipeline stages (report §3.1.2).

When a consumer stage must *execute* a component whose parameters belong to a producer layer
on another stage — the index-key projection of a Full layer (re-deriving index K from the
main-KV latent) or the query projection of the candidate-source indexer (re-selecting the
candidate pool) — it runs a lightweight replica. The owner alone is a module of the model:
it alone has optimiser state and appears in checkpoints. After the backward pass every
replica's gradient is summed into the owner's over the pipeline group; after the optimiser
step the owner's parameters are broadcast back to the replicas. When owner and consumer
share a rank (interleaved stages) the owner module itself is used and nothing is replicated.

Every rank derives the same ordered list of shadowed components from the plan and the
layout, so the collectives line up without any exchange of metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_s2.models.v41.layer_plan import SharedStateKind as K
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.attention.indexer import IndexKeyProjection, Indexer
from megatron_s2.parallel.groups import ParallelGroups

__all__ = ["ShadowComponent", "ShadowSet"]


@dataclass(frozen=True)
class ShadowComponent:
    owner_layer: int
    kind: str                   # "index_key" | "candidate_query"
    owner_pp: int               # pipeline rank holding the owner
    holders: tuple[int, ...]    # pipeline ranks that execute it (owner included)
    grads: bool                 # replica gradients flow back to the owner

    @property
    def owner_path(self) -> str:
        return (f"layers.{self.owner_layer}.attention.index_key" if self.kind == "index_key"
                else f"layers.{self.owner_layer}.attention.indexer")


class ShadowSet:
    def __init__(self, cfg: V41Config, groups: ParallelGroups, components: list[ShadowComponent],
                 pp_rank: int, model: nn.Module):
        self.cfg, self.groups, self.components, self.pp_rank = cfg, groups, components, pp_rank
        self.model = model
        self.replicas: dict[tuple[int, str], nn.Module] = {}
        for c in components:
            if pp_rank in c.holders and pp_rank != c.owner_pp:
                replica = (IndexKeyProjection(cfg, groups.tp) if c.kind == "index_key"
                           else Indexer(cfg, groups.tp))
                for p in replica.parameters():
                    p.requires_grad_(c.grads)
                self.replicas[(c.owner_layer, c.kind)] = replica

    def module(self, owner_layer: int, kind: str) -> nn.Module:
        """The module to execute on this rank: the owner itself or its replica."""
        if (owner_layer, kind) in self.replicas:
            return self.replicas[(owner_layer, kind)]
        comp = next(c for c in self.components if c.owner_layer == owner_layer and c.kind == kind)
        return self.model.get_submodule(comp.owner_path)

    def _params(self, c: ShadowComponent) -> list[torch.Tensor] | None:
        if self.pp_rank == c.owner_pp:
            return list(self.model.get_submodule(c.owner_path).parameters())
        if (c.owner_layer, c.kind) in self.replicas:
            return list(self.replicas[(c.owner_layer, c.kind)].parameters())
        return None

    def _template(self, c: ShadowComponent) -> list[torch.Tensor]:
        module = (IndexKeyProjection(self.cfg, self.groups.tp) if c.kind == "index_key"
                  else Indexer(self.cfg, self.groups.tp))
        return [torch.zeros_like(p) for p in module.parameters()]

    def _flat(self, c: ShadowComponent, of_grads: bool = False):
        """(this rank's tensors of ``c`` or None, their flat copy — zeros where it holds none)."""
        params = self._params(c)
        if params is None:
            tensors = self._template(c)
        elif of_grads:
            tensors = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        else:
            tensors = [p.detach() for p in params]
        return params, torch.cat([t.reshape(-1) for t in tensors])

    @staticmethod
    def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]):
        offset = 0
        for p in params:
            n = p.numel()
            yield p, flat[offset:offset + n].view_as(p)
            offset += n

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum replica gradients into the owner's gradient (before clipping and the step)."""
        pp = self.groups.pp
        for c in self.components:
            if not c.grads or len(c.holders) < 2:
                continue
            params, flat = self._flat(c, of_grads=True)
            dist.all_reduce(flat, group=pp.pg)
            if self.pp_rank == c.owner_pp:
                for p, g in self._unflatten(flat, params):
                    p.grad = g.clone()
            elif params is not None:
                for p in params:
                    p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the owners' updated parameters into the replicas (after the optimiser step)."""
        pp = self.groups.pp
        for c in self.components:
            if len(c.holders) < 2:
                continue
            params, flat = self._flat(c)
            dist.broadcast(flat, src=pp.ranks[c.owner_pp], group=pp.pg)
            if params is not None and self.pp_rank != c.owner_pp:
                for p, value in self._unflatten(flat, params):
                    p.copy_(value)

    def max_divergence(self) -> float:
        """Largest |replica - owner| seen by this rank (replicas compare against a broadcast copy)."""
        worst = 0.0
        pp = self.groups.pp
        for c in self.components:
            if len(c.holders) < 2:
                continue
            params, flat = self._flat(c)
            owner = flat.clone()
            dist.broadcast(owner, src=pp.ranks[c.owner_pp], group=pp.pg)
            if params is not None:
                worst = max(worst, float((flat - owner).abs().max()))
        return worst


def shadow_components(plan, stage_layers, pp_of_stage, payload_keys_of_cut) -> list[ShadowComponent]:
    """Components executed away from their owner, from the payload each stage imports."""
    found: dict[tuple[int, str], set[int]] = {}
    for stage, layers in enumerate(stage_layers):
        if stage == 0:
            continue
        cut = layers[0]
        keys = payload_keys_of_cut(cut)
        crossing = plan.crossing(cut)
        for producer, kind in keys:
            if kind is K.LATENT and (producer, K.INDEX_K) in crossing:
                found.setdefault((producer, "index_key"), set()).add(pp_of_stage(stage))
            if kind is K.CANDIDATE_QUERY:
                found.setdefault((producer, "candidate_query"), set()).add(pp_of_stage(stage))
    out = []
    for (layer, kind), holders in sorted(found.items()):
        owner_stage = next(i for i, ls in enumerate(stage_layers) if layer in ls)
        owner_pp = pp_of_stage(owner_stage)
        out.append(ShadowComponent(layer, kind, owner_pp, tuple(sorted(holders | {owner_pp})),
                                   grads=kind == "index_key"))
    return out
