"""How one cached vector is stored: the report's packed formats, or lossless float32.

=================  ======================  ==========================================  =========
cache              model flag              stored as (``kernels/quant_formats.py``)    bytes/vec
=================  ======================  ==========================================  =========
main KV (§2.4.4)   ``fp4_main_kv``         E2M1 codes + one E4M3 scale per 16           d/2+d/16
index K (V4 QAT)   ``fp4_indexer``         E2M1 codes + one E8M0 exponent per 32        d/2+d/32
SWA KV (§2.4.4)    ``fp8_swa_kv``          E4M3 bytes + one E8M0 exponent per 32        d+d/32
any, flag off      —                       float32 (the value the forward computed)     4d
=================  ======================  ==========================================  =========

A vector is a tuple of *parts* (codes, scales), each stored in its own buffer with the same
leading shape, so a page or ring of vectors is a tuple of tensors. The model's forward applies
the matching fake quantiser (:mod:`megatron_s2.kernels.quantize`) to the values it hands the
cache; packing those already-quantised values reproduces them bit for bit on unpacking (the
grids are closed under re-quantisation; ``tests/inference/test_kv_storage.py`` checks it), so
decode reads exactly what the full forward attends to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_s2.kernels.quant_formats import (
    pack_fp4_e4m3,
    pack_fp8,
    pack_mxfp4,
    unpack_fp4_e4m3,
    unpack_fp8,
    unpack_mxfp4,
)

__all__ = ["VectorFormat", "vector_format"]

_PACK = {"fp4_e4m3": (pack_fp4_e4m3, unpack_fp4_e4m3), "mxfp4": (pack_mxfp4, unpack_mxfp4),
         "fp8": (pack_fp8, unpack_fp8)}


@dataclass(frozen=True)
class VectorFormat:
    """Storage of ``dim``-channel vectors in format ``name`` (fp4_e4m3 | mxfp4 | fp8 | float32)."""

    name: str
    dim: int

    def part_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(trailing shape, dtype) of each stored part."""
        d = self.dim
        if self.name == "fp4_e4m3":
            return [((d // 2,), torch.uint8), ((d // 16,), torch.float8_e4m3fn)]
        if self.name == "mxfp4":
            return [((d // 2,), torch.uint8), ((d // 32,), torch.uint8)]
        if self.name == "fp8":
            return [((d,), torch.float8_e4m3fn), ((d // 32,), torch.uint8)]
        return [((d,), torch.float32)]

    @property
    def bytes_per_vector(self) -> int:
        total = 0
        for shape, dtype in self.part_shapes():
            total += shape[0] * dtype.itemsize
        return total

    def allocate(self, leading: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Zeroed buffers ``[*leading, *part]`` for every part (zero decodes to 0.0)."""
        return tuple(torch.zeros(*leading, *shape, dtype=dtype, device=device) for shape, dtype in self.part_shapes())

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.name == "float32":
            return (x if x.dtype is torch.float32 else x.float(),)
        return tuple(_PACK[self.name][0](x))

    def unpack(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """float32 values ``[..., dim]``."""
        if self.name == "float32":
            return parts[0]
        return _PACK[self.name][1](*parts)


def vector_format(quantised: bool, packed_name: str, dim: int) -> VectorFormat:
    return VectorFormat(packed_name if quantised else "float32", dim)
