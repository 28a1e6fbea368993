"""Transformer Engine GEMM backend: the parallel linears with TE GEMMs under
``fp8_autocast`` (``model.transformer_impl: transformer_engine``); a family's experts build on the
same helpers (e.g. :mod:`megatron_s2.models.v41.moe.te_experts`).

Like the native FP8 classes, each class subclasses our module and overrides only ``gemm``:
the parameter (ours: same name, shape, ShardSpec, initialisation, checkpoint entry) and the
tensor/sequence-parallel communication stay ours. The TE module is built on the *local*
shard with ``parallel_mode=None`` (a local GEMM, no TE communication; megatron-core's
``TELinear`` instead hands TE the tp group — we keep one place for communication), holds a
reference to our parameter instead of its own, and is kept outside the module tree so that
``state_dict()`` / ``parameters()`` list each weight once. TE's FP8 metadata (amax history of
delayed scaling) is therefore not checkpointed: it is rebuilt within ``amax_history_len``
steps after a restart.

* :class:`TELinearMixin` -> ``te.pytorch.Linear`` for replicated / column / row linears;

Every TE call runs under ``te.pytorch.fp8_autocast(enabled, fp8_recipe)`` with the recipe of
``model.fp8`` (:func:`te_recipe`); with ``recipe: none`` TE runs in the compute dtype. The FP32
islands (router, LM head, mHC, norms) are not TE modules. Written against TE's documented
PyTorch API; this machine cannot install TE, so it is exercised only where TE imports
(tests/models/test_te_provider.py).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

__all__ = ["te_recipe", "te_autocast", "adopt_parameters", "bind_recipe", "te_linear_classes"]


def te_recipe(fp8: FP8Config):
    """The ``transformer_engine.common.recipe`` object for ``model.fp8`` (None when off)."""
    if not fp8.enabled:
        return None
    from transformer_engine.common import recipe as te_recipes

    fmt = te_recipes.Format.HYBRID if fp8.fp8_format == "hybrid" else te_recipes.Format.E4M3
    if fp8.recipe == "delayed":
        return te_recipes.DelayedScaling(fp8_format=fmt, amax_history_len=fp8.amax_history_len,
                                         amax_compute_algo="max")
    if fp8.recipe == "current":
        return te_recipes.Float8CurrentScaling(fp8_format=fmt)
    return te_recipes.Float8BlockScaling(fp8_format=te_recipes.Format.E4M3)


def te_autocast(fp8: FP8Config, recipe):
    import transformer_engine.pytorch as te

    if not fp8.enabled:
        return contextlib.nullcontext()
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def adopt_parameters(te_module, names_and_params):
    """Make ``te_module`` use our parameters instead of the ones it created."""
    for name, param in names_and_params:
        delattr(te_module, name)
        if param is not None:
            setattr(te_module, name, param)


class TELinearMixin:
    fp8_config = FP8Config()
    _te_recipe = None

    def _te(self):
        te_mod = self.__dict__.get("_te_module")
        if te_mod is None:
            import transformer_engine.pytorch as te

            out_f, in_f = self.weight.shape
            te_mod = te.Linear(in_f, out_f, bias=False, params_dtype=self.weight.dtype, device=self.weight.device,
                               parallel_mode=None)
            adopt_parameters(te_mod, [("weight", self.weight)])
            object.__setattr__(self, "_te_module", te_mod)  # outside the module tree
        return te_mod

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        with te_autocast(self.fp8_config, self._te_recipe):
            return self._te()(x.to(self.weight.dtype))


def bind_recipe(classes, fp8: FP8Config):
    recipe = te_recipe(fp8)
    return tuple(type(f"TE{cls.__name__.removeprefix('TE')}", (cls,), {"fp8_config": fp8, "_te_recipe": recipe})
                 for cls in classes)


def te_linear_classes(fp8: FP8Config) -> tuple[type, type, type]:
    """(replicated, column, row) linears with TE GEMMs under the recipe of ``fp8``."""
    bases = [type(f"TE{cls.__name__}", (TELinearMixin, cls), {})
             for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)]
    return bind_recipe(bases, fp8)
