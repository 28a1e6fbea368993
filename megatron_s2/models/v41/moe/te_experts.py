"""Transformer Engine GEMMs for the routed and shared experts (``model.transformer_impl:
transformer_engine``), on the helpers of :mod:`megatron_s2.parallel.te_linear`.

* :class:`TEGroupedExperts` -> ``te.pytorch.GroupedLinear`` (one grouped GEMM per projection
  over this rank's experts, ``m_splits`` = tokens per expert);
* :class:`TESharedExpert` -> ``te.pytorch.Linear``.

The parameters stay ours (same names, shapes, ShardSpecs, checkpoint entries); the TE modules
hold references to them outside the module tree. Exercised only where TE imports
(tests/models/test_te_provider.py).
"""

from __future__ import annotations

import torch

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.models.v41.moe.experts import GroupedExperts, SharedExpert, swiglu
from megatron_s2.parallel.te_linear import adopt_parameters, bind_recipe, te_autocast

__all__ = ["TEGroupedExperts", "TESharedExpert", "te_expert_classes"]


class TEGroupedExperts(GroupedExperts):
    fp8_config = FP8Config()
    _te_recipe = None

    def _grouped(self, name: str):
        key = f"_te_{name}"
        te_mod = self.__dict__.get(key)
        if te_mod is None:
            import transformer_engine.pytorch as te

            p = getattr(self, name)
            te_mod = te.GroupedLinear(p.size(0), p.size(2), p.size(1), bias=False, params_dtype=p.dtype,
                                      device=p.device, parallel_mode=None)
            adopt_parameters(te_mod, [(f"weight{i}", None) for i in range(p.size(0))])
            object.__setattr__(self, key, te_mod)
        return te_mod

    def _grouped_gemm(self, name: str, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        te_mod, p = self._grouped(name), getattr(self, name)
        for i in range(p.size(0)):  # views of our 3-D parameter, re-taken every call (autograd)
            te_mod.__dict__[f"weight{i}"] = p[i]
        with te_autocast(self.fp8_config, self._te_recipe):
            return te_mod(x, splits)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        if len(tokens_per_expert) != self.num_local_experts or sum(tokens_per_expert) != tokens.size(0):
            raise ValueError(f"expert token counts {tokens_per_expert} do not match {tokens.size(0)} rows "
                             f"for {self.num_local_experts} local experts")
        x = tokens.to(self.w1.dtype)
        h = swiglu(self._grouped_gemm("w1", x, tokens_per_expert), self._grouped_gemm("w3", x, tokens_per_expert),
                   self.swiglu_limit, probs.unsqueeze(-1))
        return self._grouped_gemm("w2", h.to(self.w2.dtype), tokens_per_expert).to(tokens.dtype)


class TESharedExpert(SharedExpert):
    fp8_config = FP8Config()
    _te_recipe = None

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        key = f"_te_{id(weight)}"
        te_mod = self.__dict__.get(key)
        if te_mod is None:
            import transformer_engine.pytorch as te

            te_mod = te.Linear(weight.size(1), weight.size(0), bias=False, params_dtype=weight.dtype,
                               device=weight.device, parallel_mode=None)
            adopt_parameters(te_mod, [("weight", weight)])
            object.__setattr__(self, key, te_mod)
        with te_autocast(self.fp8_config, self._te_recipe):
            return te_mod(x)


def te_expert_classes(fp8: FP8Config) -> tuple[type, type]:
    """(routed, shared) experts with TE grouped / plain GEMMs."""
    return bind_recipe((TEGroupedExperts, TESharedExpert), fp8)
