"""Layer specs of the V4.1 backbone (megatron-core ``ModuleSpec`` convention).

A :class:`~megatron.core.transformer.spec_utils.ModuleSpec` names the block class and its
submodules; a *provider* supplies the leaf classes (linears, norms). The local provider is
pure PyTorch and runs on CPU and GPU. A Transformer Engine provider fills the same slots
with TE modules (FP8 on NVIDIA GPUs); it is selected by ``model.transformer_impl``, so
switching backends is a spec choice, never an ``if`` inside a layer. TE is optional at import
time: asking for it where it is not importable is a clear :class:`BackendUnavailable` error.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field

from megatron_s2.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

with warnings.catch_warnings():  # megatron-core warns at import when TE/apex are absent
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

__all__ = ["ModuleSpec", "build_module", "LocalProvider", "BackendUnavailable", "get_provider",
           "BlockSubmodules", "LinearSubmodules", "block_spec"]


class BackendUnavailable(RuntimeError):
    pass


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


class LocalProvider:
    """Pure-PyTorch leaf modules: every layout runs on CPU (gloo) and GPU (NCCL)."""

    name = "local"

    def linears(self) -> LinearSubmodules:
        return LinearSubmodules()

    def norm(self) -> type:
        from megatron_s2.models.v41.norm import RMSNorm

        return RMSNorm


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def get_provider(name: str) -> LocalProvider:
    if name == "local":
        return LocalProvider()
    if name == "transformer_engine":
        if not transformer_engine_available():
            raise BackendUnavailable(
                "model.transformer_impl=transformer_engine, but Transformer Engine is not importable here. "
                "Install it (NGC PyTorch containers ship it) or set model.transformer_impl=local.")
        # The slot exists (LinearSubmodules / norm are the only leaf classes a provider swaps);
        # TE-backed leaves have not been validated on a GPU yet, so they are not shipped.
        raise BackendUnavailable(
            "Transformer Engine is importable, but this build ships no validated TE provider yet; "
            "set model.transformer_impl=local (pure PyTorch, runs on GPUs too).")
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
        ),
    )
