"""What crosses a pipeline cut: the family's part (:class:`StagePayloads`), and the message of a
family whose stages share nothing but the hidden state.

:class:`HiddenOnlyPayloads` is what :meth:`ModelFamily.stage_payloads` returns unless a family
sends more (the V4.1 backbone adds its CSA2 shared states): one field, the residual stream
``[batch, tokens on this rank, hidden_size]`` in the compute dtype, with its gradient flowing
back. Each field is checked against the expected shape and dtype before it is sent.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_s2.parallel.p2p import PayloadField

__all__ = ["StagePayloads", "HiddenOnlyPayloads", "HiddenSpec", "check_outgoing"]


class StagePayloads(abc.ABC):
    """A family's part of a pipeline cut: the message entering each stage beyond the hidden
    state, its export from the producing stage and import into the consuming one, and any
    replicated components (shadows) whose gradients and parameters must be synchronised."""

    num_hidden: int = 1
    """Leading fields of every message that are the hidden state (``run_layers``' tuple)."""

    @abc.abstractmethod
    def spec_for(self, stage: int, micro_batch: dict) -> Any:
        """The message entering ``stage`` (``.fields``: :class:`~megatron_s2.parallel.p2p.PayloadField`)."""

    @abc.abstractmethod
    def export(self, stage: int, hidden: tuple[torch.Tensor, ...], ctx, micro_batch: dict) -> list[torch.Tensor]:
        """The tensors leaving ``stage`` in the order of ``spec_for(stage + 1)``."""

    @abc.abstractmethod
    def import_states(self, stage: int, spec, tensors: list[torch.Tensor], ctx) -> None:
        """Hand the received states (beyond the hidden state) to ``ctx`` before ``stage`` runs."""

    def request_exports(self, stage: int, ctx) -> None:
        """Tell ``ctx`` which states ``stage`` must keep for the next stage (default: nothing)."""

    def refresh(self) -> None:
        """After each optimiser step: replicas take their owners' parameters."""

    def sync_grads(self) -> None:
        """After the last backward of a step: replica gradients flow to their owners."""

    def replica_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters of the replicas this rank holds (not the model's own; for memory accounting)."""
        return []


@dataclass
class HiddenSpec:
    cut: int
    fields: list[PayloadField] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)


def check_outgoing(tensors: list[torch.Tensor], spec, where: str) -> list[torch.Tensor]:
    """The tensors of a message, each equal in dtype and shape to its field (a mismatch would be
    reinterpreted silently by the receiver); non-gradient fields are cast to their compact dtype."""
    out = []
    for t, f in zip(tensors, spec.fields):
        if not f.requires_grad and t.dtype != f.dtype:
            t = t.to(f.dtype)
        if t.dtype != f.dtype or tuple(t.shape) != f.shape:
            raise RuntimeError(f"pipeline payload field '{f.name}' at {where}: expected {f.dtype} {f.shape}, "
                               f"produced {t.dtype} {tuple(t.shape)}")
        out.append(t)
    return out


class HiddenOnlyPayloads(StagePayloads):
    num_hidden = 1

    def __init__(self, model, layout, groups):
        self.cfg, self.layout, self.groups = model.config, layout, groups

    def spec_for(self, stage: int, micro_batch: dict) -> HiddenSpec:
        b, local = micro_batch["tokens"].shape
        stream = self.groups.sequence.stream_length(local)
        dtype = getattr(torch, self.cfg.compute_dtype)
        cut = self.layout.stage_layers[stage][0]
        return HiddenSpec(cut, [PayloadField("hidden", (b, stream, self.cfg.hidden_size), dtype, True)])

    def export(self, stage, hidden, ctx, micro_batch):
        spec = self.spec_for(stage + 1, micro_batch)
        return check_outgoing(list(hidden), spec, f"the cut before layer {spec.cut}")

    def import_states(self, stage, spec, tensors, ctx) -> None:
        pass  # nothing beyond the hidden state crosses the cut
