"""Hugging Face tensors by name for import: dequantised, and every read recorded.

:meth:`~megatron_s2.models.family.mapping_registry.MappingRegistry.import_state` pulls tensors from
a :class:`TensorSource`; afterwards every source tensor must have been read, be a read tensor's
scale, or lie under a family's documented skipped prefix.

Every tensor is checked to be finite as it is read (after dequantisation), so each reader of an
export — ``checkpoint import``, ``serve``, ``generate`` — refuses a NaN or infinity naming the
tensor and its file, before a model is built from it.
"""

from __future__ import annotations

import torch

from megatron_s2.checkpoint.hf.quant import dequantize, is_quantized
from megatron_s2.models.family.mapping_registry import ConversionError
from megatron_s2.runtime.finite import first_non_finite

__all__ = ["TensorSource"]


class TensorSource:
    """Hugging Face tensors by name, dequantised, with a record of what was read."""

    def __init__(self, reader):
        self.reader = reader
        self.used: set[str] = set()
        self.dequantized = 0

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(self, name: str) -> torch.Tensor:
        tensor = self._read(name)
        if first_non_finite([(name, tensor)]):
            raise ConversionError(f"{self.reader.file_of(name)}: tensor '{name}' holds NaN or infinite values; "
                                  "the export is damaged — export it again from a good checkpoint")
        return tensor

    def _read(self, name: str) -> torch.Tensor:
        tensor = self.reader.get(name)
        self.used.add(name)
        scale_name = name[: -len("weight")] + "scale" if name.endswith("weight") else None
        if is_quantized(tensor.dtype):
            if scale_name is None or scale_name not in self.reader:
                raise ConversionError(f"'{name}' is stored as {tensor.dtype} without a '{scale_name}' tensor")
            self.used.add(scale_name)
            self.dequantized += 1
            return dequantize(tensor, self.reader.get(scale_name))
        if scale_name is not None and scale_name in self.reader:
            raise ConversionError(f"'{name}' ({tensor.dtype}) has a '{scale_name}' companion, but only FP8 E4M3 and "
                                  "packed FP4 weights are scaled in this format")
        return tensor
