"""Layer specs of the V4.1 backbone (megatron-core ``ModuleSpec`` convention).

A :class:`~megatron_s2.models.family.module_spec.ModuleSpec` (megatron-core's convention,
``megatron.core.transformer.spec_utils``; ours, so that building a model does not import
megatron-core and its Transformer Engine probes) names the block class and its submodules; a *provider* supplies the leaf classes (linears, norms). The local provider is
pure PyTorch and runs on CPU and GPU. A Transformer Engine provider fills the same slots
with TE modules (FP8 on NVIDIA GPUs); it is selected by ``model.transformer_impl``, and
``model.fp8`` picks FP8 GEMM subclasses (native blockwise FP8 under the local provider, TE
recipes under TE), so switching backends or FP8 on is a spec choice, never an ``if`` inside a
layer. TE is optional at import time: asking for it where it is not importable is a clear
:class:`BackendUnavailable` error.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.module_spec import ModuleSpec, build_module
from megatron_s2.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

__all__ = ["ModuleSpec", "build_module", "MODULE_SPEC_SOURCE", "LocalProvider", "TransformerEngineProvider", "BackendUnavailable", "get_provider",
           "BlockSubmodules", "LinearSubmodules", "block_spec"]


MODULE_SPEC_SOURCE = "megatron_s2.models.family.module_spec (megatron-core's ModuleSpec convention)"


class BackendUnavailable(ConfigError, RuntimeError):
    """A provider the recipe names cannot be built here: a configuration error (exit 2, one line)."""


@dataclass(frozen=True)
class LinearSubmodules:
    """Leaf classes of the attention and Engram projections."""

    replicated_linear: type = ReplicatedLinear
    column_parallel_linear: type = ColumnParallelLinear
    row_parallel_linear: type = RowParallelLinear


@dataclass
class BlockSubmodules:
    attention: ModuleSpec | type | None = None
    mlp: ModuleSpec | type | None = None
    hyper_connection: ModuleSpec | type | None = None
    engram: ModuleSpec | type | None = None
    norm: type | None = None
    linears: LinearSubmodules = field(default_factory=LinearSubmodules)
    experts: type | None = None
    """Routed experts class (``GroupedExperts`` or a GEMM-backend subclass)."""
    shared_expert: type | None = None
    """Shared expert class (``SharedExpert`` or a GEMM-backend subclass)."""


class LocalProvider:
    """Pure-PyTorch leaf modules: every layout runs on CPU (gloo) and GPU (NCCL). With
    ``model.fp8.recipe: blockwise`` the expert and/or attention GEMMs are the native
    fine-grained FP8 subclasses (:mod:`megatron_s2.parallel.fp8_linear`,
    :mod:`megatron_s2.models.v41.moe.fp8_experts`)."""

    name = "local"

    def __init__(self, fp8: FP8Config | None = None):
        self.fp8 = fp8 or FP8Config()

    def linears(self) -> LinearSubmodules:
        if self.fp8.enabled and self.fp8.attention:
            from megatron_s2.parallel.fp8_linear import fp8_linear_classes

            return LinearSubmodules(*fp8_linear_classes(self.fp8.block))
        return LinearSubmodules()

    def experts(self) -> tuple[type, type]:
        if self.fp8.enabled and self.fp8.experts:
            from megatron_s2.models.v41.moe.fp8_experts import fp8_expert_classes

            return fp8_expert_classes(self.fp8.block)
        from megatron_s2.models.v41.moe.experts import GroupedExperts, SharedExpert

        return GroupedExperts, SharedExpert

    def norm(self) -> type:
        from megatron_s2.models.v41.norm import RMSNorm

        return RMSNorm


class TransformerEngineProvider(LocalProvider):
    """Transformer Engine GEMMs for the linears and experts (grouped GEMMs for the routed
    experts) under ``fp8_autocast`` with the recipe of ``model.fp8``
    (:mod:`megatron_s2.parallel.te_linear`). Norms stay ours (an FP32 island)."""

    name = "transformer_engine"

    def linears(self) -> LinearSubmodules:
        from megatron_s2.parallel.te_linear import te_linear_classes

        fp8 = self.fp8 if self.fp8.attention else FP8Config()
        return LinearSubmodules(*te_linear_classes(fp8))

    def experts(self) -> tuple[type, type]:
        from megatron_s2.models.v41.moe.te_experts import te_expert_classes

        return te_expert_classes(self.fp8 if self.fp8.experts else FP8Config())


def transformer_engine_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # installed but unusable (no GPU / mismatched CUDA): not available
        return False
    return True


def get_provider(name: str, fp8: FP8Config | None = None) -> LocalProvider:
    if name == "local":
        return LocalProvider(fp8)
    if name == "transformer_engine":
        if not transformer_engine_available():
            raise BackendUnavailable(
                "model.transformer_impl=transformer_engine, but Transformer Engine is not importable here. "
                "Install it (NGC PyTorch containers ship it) or set model.transformer_impl=local.")
        return TransformerEngineProvider(fp8)
    raise BackendUnavailable(f"unknown transformer_impl '{name}' (choose local or transformer_engine)")


def block_spec(provider: LocalProvider) -> ModuleSpec:
    """ModuleSpec of one backbone block for ``provider``."""
    from megatron_s2.models.v41.attention.csa2 import CSA2Attention
    from megatron_s2.models.v41.block import V41Block
    from megatron_s2.models.v41.engram import Engram
    from megatron_s2.models.v41.mhc import HyperConnection
    from megatron_s2.models.v41.moe import MoELayer

    return ModuleSpec(
        module=V41Block,
        submodules=BlockSubmodules(
            attention=CSA2Attention,
            mlp=MoELayer,
            hyper_connection=HyperConnection,
            engram=Engram,
            norm=provider.norm(),
            linears=provider.linears(),
            experts=provider.experts()[0],
            shared_expert=provider.experts()[1],
        ),
    )
