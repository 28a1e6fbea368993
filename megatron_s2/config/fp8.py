"""FP8 training configuration (``model.fp8``): which GEMMs run in FP8 and with which recipe.

The backend follows ``model.transformer_impl``:

* ``local`` -> **native** fine-grained FP8 on ``torch._scaled_mm`` (DeepSeek-V3 recipe: 1 x 128
  activation tiles, 128 x 128 weight blocks; :mod:`megatron_s2.kernels.fp8_gemm`). Only the
  ``blockwise`` recipe exists natively.
* ``transformer_engine`` -> TE modules under ``fp8_autocast`` with the recipe named here
  (``delayed`` = DelayedScaling, ``current`` = Float8CurrentScaling, ``blockwise`` =
  Float8BlockScaling).

The FP32 islands of the precision map (router, LM head, mHC, norms) never run in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["FP8Config"]


@dataclass(frozen=True)
class FP8Config:
    recipe: Literal["none", "blockwise", "delayed", "current"] = "none"
    """FP8 scaling recipe; ``none`` keeps every GEMM in the compute dtype."""
    experts: bool = True
    """Routed and shared expert GEMMs in FP8 (the report's precision list)."""
    attention: bool = True
    """Attention / indexer / compressor projections in FP8 (linears whose dimensions are whole
    ``block`` tiles; the others keep the compute dtype, as DeepSeek-V3 does for small ones)."""
    block: int = 128
    """Tile edge of the native blockwise recipe (128 in DeepSeek-V3; smaller only for tiny test
    models)."""
    fp8_format: Literal["e4m3", "hybrid"] = "e4m3"
    """Transformer Engine: E4M3 everywhere, or E4M3 forward / E5M2 gradients (``hybrid``)."""
    amax_history_len: int = 1024
    """Transformer Engine delayed scaling: length of the amax history."""

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ConfigError(f"model.fp8.block: must be a power of two >= 16, got {self.block}")
        if self.amax_history_len < 1:
            raise ConfigError(f"model.fp8.amax_history_len: must be >= 1, got {self.amax_history_len}")

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def check_backend(self, transformer_impl: str) -> None:
        if self.enabled and transformer_impl == "local" and self.recipe != "blockwise":
            raise ConfigError(f"model.fp8.recipe: '{self.recipe}' needs model.transformer_impl=transformer_engine; "
                              "the native (local) FP8 path implements recipe: blockwise")
