"""Shared attention state, addressed by producing layer (report §3.1.2).

CSA2 layers hand main KV, indexer K, top-k indices and the candidate pool to later layers,
and the CED decoder reads the last encoder layer's hidden state (§2.2, §2.3). Inference code
can keep one slot per quantity because it runs layers strictly in order; training with
pipelining, recomputation and several micro-batches in flight cannot. Every state here is
keyed by ``(producer layer, kind)`` and the registry knows, from the layer plan, which
layers consume it, so that

* a pipeline stage can export exactly the states a cut needs (payload extensions) and
  import them on the next stage;
* a state is released as soon as its last consumer has read it in the forward pass
  (autograd keeps what backward needs), which keeps the memory held by shared states bounded
  by what the schedule keeps in flight;
* the attention code never depends on where a producer physically runs.

One registry lives per micro-batch forward (see :class:`ForwardContext`).
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_s2.models.v41.layer_plan import LayerPlan, SharedStateKind

__all__ = ["SharedStateRegistry", "MissingSharedState"]


class MissingSharedState(RuntimeError):
    pass


class SharedStateRegistry:
    def __init__(self, plan: LayerPlan):
        self.plan = plan
        self._states: dict[tuple[int, SharedStateKind], torch.Tensor] = {}
        self._pending: dict[tuple[int, SharedStateKind], set[int]] = {}
        self.requested: set[tuple[int, SharedStateKind]] = set()  # kept for a pipeline export
        self.peak_bytes = 0

    # ---- producer / consumer API -------------------------------------------------------
    def publish(self, producer: int, kind: SharedStateKind, value: torch.Tensor) -> None:
        key = (producer, kind)
        consumers = set(self.plan.consumers(producer, kind))
        if key in self.requested:
            consumers.add(-1)  # the pipeline export holds it until the stage's output is built
        if not consumers:
            return  # nobody downstream reads it: do not keep it alive
        self._states[key] = value
        self._pending[key] = consumers
        self.peak_bytes = max(self.peak_bytes, self.bytes_held())

    def consume(self, consumer: int, producer: int, kind: SharedStateKind) -> torch.Tensor:
        key = (producer, kind)
        if key not in self._states:
            raise MissingSharedState(
                f"layer {consumer} needs {kind.value} of layer {producer}, which was not published in this "
                "forward (is the producer on another pipeline stage without a payload entry?)")
        value = self._states[key]
        pending = self._pending[key]
        pending.discard(consumer)
        if not pending:  # last consumer in this forward: release the reference
            del self._states[key]
            del self._pending[key]
        return value

    def peek(self, producer: int, kind: SharedStateKind) -> torch.Tensor | None:
        return self._states.get((producer, kind))

    # ---- pipeline payload support --------------------------------------------------------
    def export(self, keys: Iterable[tuple[int, SharedStateKind]]) -> dict[tuple[int, SharedStateKind], torch.Tensor]:
        """The states a pipeline cut must carry (the registry is discarded after the export)."""
        out = {}
        for key in keys:
            if key not in self._states:
                raise MissingSharedState(f"pipeline payload needs {key[1].value} of layer {key[0]}, which is not held")
            out[key] = self._states[key]
        return out

    def import_states(self, states: dict[tuple[int, SharedStateKind], torch.Tensor], below: int) -> None:
        """Register states received from an upstream stage; only consumers at or above
        layer ``below`` are still pending."""
        for (producer, kind), value in states.items():
            consumers = {c for c in self.plan.consumers(producer, kind) if c >= below}
            if (producer, kind) in self.requested:
                consumers.add(-1)
            if consumers:
                self._states[(producer, kind)] = value
                self._pending[(producer, kind)] = consumers
        self.peak_bytes = max(self.peak_bytes, self.bytes_held())

    def drop_consumers_outside(self, layers: Iterable[int]) -> None:
        """Forget pending consumers not in ``layers`` (they run on another stage)."""
        keep = set(layers)
        for key in list(self._pending):
            self._pending[key] &= keep
            if not self._pending[key]:
                del self._pending[key]
                self._states.pop(key, None)

    # ---- observability -------------------------------------------------------------------
    def held(self) -> list[tuple[int, SharedStateKind]]:
        return sorted(self._states, key=lambda k: (k[0], k[1].value))

    def bytes_held(self) -> int:
        return sum(t.nbytes for t in self._states.values())  # a tensor's numel * element_size, or what a stand-in holds

    def __len__(self) -> int:
        return len(self._states)
