"""What a mapping may ask about the model while converting: config, layer plan, Engram rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from megatron_s2.models.v41.layer_plan import LayerPlan
from megatron_s2.models.v41.config import V41Config

__all__ = ["ConversionContext"]


@dataclass
class ConversionContext:
    cfg: V41Config
    _rows: dict[int, int] = field(default_factory=dict, repr=False)

    @cached_property
    def plan(self) -> LayerPlan:
        return self.cfg.plan

    @property
    def num_experts(self) -> int:
        return self.cfg.num_routed_experts

    def engram_rows(self, layer: int) -> int:
        """Addressed (unpadded) rows of the Engram table of ``layer``: the sum of its primes."""
        if layer not in self._rows:
            from megatron_s2.models.v41.engram.hashing import EngramHasher

            self._rows[layer] = EngramHasher.from_config(self.cfg).num_rows(layer)
        return self._rows[layer]
