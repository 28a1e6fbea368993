"""Declarative parameter mappings between our names and the Hugging Face checkpoint's.

Megatron-Bridge's model (``models/conversion/param_mapping.py``): each row of a model's table
is one mapping object naming a parameter on both sides with wildcard placeholders, and the
object knows how to move tensors across — nothing else in the conversion loops over names.
Placeholders: ``{layer}`` (global layer index, on both sides) and ``{expert}`` (routed expert
index, Hugging Face side only: our experts are grouped 3-D tensors).

* :class:`DirectMapping` — one tensor, renamed.
* :class:`GroupedExpertMapping` — our ``[E, ...]`` grouped expert tensor <-> ``E`` per-expert
  tensors (split on export, stacked on import).
* :class:`FusedPartMapping` — one of several tensors of ours that the checkpoint stores
  concatenated along dim 0 (e.g. separately tensor-parallel q / k / v projections that the
  reference fuses into one ``in_proj_qkv``): a row block of one Hugging Face tensor.

A family adds its own mapping classes beside these (e.g. the V4.1 Engram table's padded rows,
:mod:`megatron_s2.models.v41.hf.mapping`).

Tensor/expert/etc. parallel splits are *not* rules here: the gather before export and the
scatter after import go through each tensor's ShardSpec (:mod:`.gather`), which the model
code defines where it creates the parameter.

A mapping may carry an :class:`ImportFallback`: how to obtain the tensor from another
Hugging Face tensor when its own name is absent (e.g. the reference checkpoint has no
``bias_vl`` without vision; image tokens then route with ``bias``). With
``elide_if_derivable`` the exporter omits the tensor when it equals what the fallback would
produce, so a checkpoint imported from the reference exports back to the reference's exact
name set.

``confirmed`` records whether the Hugging Face name was checked against the official
reference implementation (``inference/model.py``); unconfirmed rows carry a note.
"""

from __future__ import annotations

import abc

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch



class ConversionContext(Protocol):
    """What a mapping may ask about the model while converting (a family's adapter builds it)."""

    cfg: Any
    """The model's config (the family's ModelSchema)."""

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (:class:`GroupedExpertMapping`)."""

__all__ = ["Bindings", "ConversionContext", "ImportFallback", "ParamMapping", "DirectMapping", "GroupedExpertMapping",
           "FusedPartMapping", "compile_pattern"]

Bindings = dict[str, int]
_PLACEHOLDER = re.compile(r"\{(layer|expert|stage)\}")


def compile_pattern(pattern: str) -> re.Pattern:
    """``layers.{layer}.attn.wq_a.weight`` -> a full-match regex with named integer groups."""
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[pos:m.start()]))
        parts.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts))


@dataclass(frozen=True)
class ImportFallback:
    """Where to take a tensor from when its Hugging Face name is absent."""

    hf: str
    """Pattern of the Hugging Face tensor to use instead (same placeholders)."""
    applicable: Callable[["ConversionContext", Bindings], str | None]
    """None when the substitution is exact for these bindings, else the reason it is not."""
    note: str = ""


@dataclass(frozen=True)
class ParamMapping(abc.ABC):
    megatron: str
    """Our name pattern (``model.state_dict()`` keys of the single-rank model)."""
    hf: str
    """Hugging Face name pattern (official reference naming)."""
    confirmed: bool = True
    """The Hugging Face name was checked against the official reference implementation."""
    note: str = ""
    keep_fp32: bool = False
    """Stays float32 when exporting with a lower ``dtype`` (float32 in the reference too)."""
    fallback: ImportFallback | None = None
    elide_if_derivable: bool = False
    """Export omits the tensor when the fallback reproduces it exactly."""
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", compile_pattern(self.megatron))

    # ---- names -----------------------------------------------------------------------------
    def match(self, name: str) -> Bindings | None:
        m = self._regex.fullmatch(name)
        return {k: int(v) for k, v in m.groupdict().items()} if m else None

    def megatron_name(self, bindings: Bindings) -> str:
        return self.megatron.format(**bindings)

    def hf_names(self, bindings: Bindings, ctx: "ConversionContext") -> list[str]:
        return [self.hf.format(**bindings)]

    # ---- tensors ---------------------------------------------------------------------------
    @abc.abstractmethod
    def to_hf(self, tensor: torch.Tensor, bindings: Bindings, ctx: "ConversionContext") -> dict[str, torch.Tensor]:
        """Our full tensor -> the Hugging Face tensors it becomes (by name)."""

    @abc.abstractmethod
    def from_hf(self, tensors: dict[str, torch.Tensor], bindings: Bindings, ctx: "ConversionContext",
                full_shape: tuple[int, ...]) -> torch.Tensor:
        """The Hugging Face tensors of :meth:`hf_names` -> our full tensor of ``full_shape``."""


@dataclass(frozen=True)
class DirectMapping(ParamMapping):
    """One tensor, renamed, values unchanged."""

    def to_hf(self, tensor, bindings, ctx):
        return {self.hf.format(**bindings): tensor}

    def from_hf(self, tensors, bindings, ctx, full_shape):
        (tensor,) = tensors.values()
        return tensor


@dataclass(frozen=True)
class GroupedExpertMapping(ParamMapping):
    """Our grouped ``[num_experts, ...]`` tensor <-> one Hugging Face tensor per expert."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if "{expert}" not in self.hf or "{expert}" in self.megatron:
            raise ValueError(f"GroupedExpertMapping '{self.megatron}': the expert index belongs in the "
                             "Hugging Face pattern only")

    def hf_names(self, bindings, ctx):
        return [self.hf.format(**bindings, expert=e) for e in range(ctx.num_experts)]

    def to_hf(self, tensor, bindings, ctx):
        if tensor.size(0) != ctx.num_experts:
            raise ValueError(f"{self.megatron_name(bindings)}: {tensor.size(0)} experts, the config has "
                             f"{ctx.num_experts}")
        return {self.hf.format(**bindings, expert=e): tensor[e] for e in range(tensor.size(0))}

    def from_hf(self, tensors, bindings, ctx, full_shape):
        return torch.stack([tensors[n] for n in self.hf_names(bindings, ctx)], dim=0)


@dataclass(frozen=True)
class FusedPartMapping(ParamMapping):
    """Our tensor = rows ``[offset, offset + rows)`` of a Hugging Face tensor that concatenates
    ``parts`` tensors of ours along dim 0 (``part``: our tensor's place among them).

    ``rows(cfg)`` gives the dim-0 sizes of all parts (from the model config, so import knows
    where each block starts); ``hf_shape_suffix``: trailing dims the Hugging Face tensor has
    beyond ours (e.g. a depthwise conv weight ``[C, 1, K]`` for our ``[C, K]``: ``(1,)`` inserted
    at dim 1). Export assembles the fused tensor once every part is present
    (:meth:`~megatron_s2.models.family.mapping_registry.MappingRegistry.export_views`)."""

    part: int = 0
    rows: Callable[[Any], list[int]] | None = None
    insert_dim: int | None = None

    def block(self, ctx: "ConversionContext") -> tuple[int, int]:
        sizes = self.rows(ctx.cfg)
        return sum(sizes[:self.part]), sizes[self.part]

    def to_hf(self, tensor, bindings, ctx):
        return {self.hf.format(**bindings): tensor if self.insert_dim is None else tensor.unsqueeze(self.insert_dim)}

    def from_hf(self, tensors, bindings, ctx, full_shape):
        (tensor,) = tensors.values()
        start, size = self.block(ctx)
        if tensor.size(0) != sum(self.rows(ctx.cfg)):
            raise ValueError(f"{self.hf.format(**bindings)}: {tensor.size(0)} rows, the config's parts "
                             f"{self.rows(ctx.cfg)} need {sum(self.rows(ctx.cfg))}")
        out = tensor[start:start + size]
        return out if self.insert_dim is None else out.squeeze(self.insert_dim)
