"""The series encoder across pipeline stages (Intern-S2 report §2.2.2: the forecaster reads the
encoder's tokens; under pipeline parallelism it sits on the last stage, the encoder on the first).

The encoder is a module of the first stage's model (``model.timeseries``): it alone has optimiser
state and checkpoint entries. The last stage runs a replica of it (no module of its model, like
the V4.1 shadows of report §3.1.2, :mod:`megatron_s2.models.v41.pipeline.shadows`) to encode the
series its forecaster is conditioned on. After the backward pass the replica's gradient is summed
into the owner's over the first + last stage group (``groups.embedding``); after every optimiser
step, and after a load, the owner's parameters are broadcast back. Middle stages hold neither.
Without pipeline parallelism the owner is the only copy and nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_s2.models.timeseries.attach import build_series_encoder
from megatron_s2.parallel.groups import ParallelGroups

__all__ = ["SeriesEncoderStages"]


class SeriesEncoderStages:
    def __init__(self, model, model_cfg, groups: ParallelGroups, *, first: bool, last: bool, device):
        """``first`` / ``last``: this rank holds the first / last pipeline stage."""
        self.groups, self.first, self.last = groups, first, last
        self.replica = None
        if last and not first:
            with torch.device(device):
                self.replica = build_series_encoder(model_cfg)
        self.encoder = model.timeseries if first else self.replica
        """The encoder this rank runs (None on a middle stage)."""

    @property
    def exchanging(self) -> bool:
        return self.groups.embedding.active and (self.first or self.last)

    def _flat(self, of_grads: bool) -> torch.Tensor:
        # float32 on the wire: the owner is stored in the model's precision map (bf16 matrices under
        # params_dtype bfloat16), the replica as built (float32); both stages must send the same bytes
        params = list(self.encoder.parameters())
        if of_grads:
            return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                              for p in params])
        return torch.cat([p.detach().reshape(-1).float() for p in params])

    def _assign(self, flat: torch.Tensor, of_grads: bool) -> None:
        offset = 0
        for p in self.encoder.parameters():
            value = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if of_grads:
                p.grad = value.to(p.dtype, copy=True)  # in the parameter's own dtype
            else:
                p.copy_(value)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the replica's gradient into the owner's (before the data-parallel reduction)."""
        if not self.exchanging:
            return
        flat = self._flat(of_grads=True)
        dist.all_reduce(flat, group=self.groups.embedding.pg)
        if self.first:
            self._assign(flat, of_grads=True)
        else:
            for p in self.replica.parameters():
                p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The replica takes the owner's parameters (at start, after a load, after each step)."""
        if not self.exchanging:
            return
        flat = self._flat(of_grads=False)
        dist.broadcast(flat, src=self.groups.pp.ranks[0], group=self.groups.embedding.pg)
        if not self.first:
            self._assign(flat, of_grads=False)

    def max_divergence(self) -> float:
        """Largest |replica - owner| on this rank (0 on the owner); a parity check's probe."""
        if not self.exchanging:
            return 0.0
        flat = self._flat(of_grads=False)
        owner = flat.clone()
        dist.broadcast(owner, src=self.groups.pp.ranks[0], group=self.groups.embedding.pg)
        return float((flat - owner).abs().max())
