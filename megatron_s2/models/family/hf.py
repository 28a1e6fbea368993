"""A family's Hugging Face adapter: ``config.json`` mapping, tensor-name mapping, tokenizer checks.

The generic conversion (:mod:`megatron_s2.checkpoint.hf`) writes and reads sharded safetensors,
verifies round trips and gathers / scatters shards for any layout; everything that depends on
the architecture comes from the adapter of the checkpoint's family:

* :meth:`HFAdapter.config_to_hf` / :meth:`HFAdapter.config_from_hf` — ``config.json`` <-> the
  family's :class:`~megatron_s2.config.model_schema.ModelSchema`. Exports carry our lossless
  ``megatron_s2`` block (``{"format_version", "model": {...}}``), which names the family;
* :attr:`HFAdapter.registry` — the declarative tensor-name table
  (:class:`~megatron_s2.models.family.mapping_registry.MappingRegistry`) and
  :meth:`HFAdapter.context`, what its mappings may ask about the model;
* :meth:`HFAdapter.claims` — whether a ``config.json`` without our block (a released checkpoint)
  is this family's, so that :func:`megatron_s2.models.family.registry.family_for_hf_config` finds
  its reader.
"""

from __future__ import annotations

import abc
from typing import Any

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.models.family.mapping_registry import MappingRegistry

__all__ = ["HFAdapter", "BLOCK_KEY"]

BLOCK_KEY = "megatron_s2"


class HFAdapter(abc.ABC):
    training_only_keys: frozenset[str] = frozenset()
    """``config.json`` keys only training reads (initialisation, auxiliary-loss coefficients): two
    configs differing only there describe models that compute the same from the same weights
    (:func:`~megatron_s2.inference.weights.check_same_architecture` ignores them)."""

    @property
    @abc.abstractmethod
    def registry(self) -> MappingRegistry: ...

    @abc.abstractmethod
    def claims(self, config: dict[str, Any]) -> bool:
        """This ``config.json`` (without a ``megatron_s2`` block) describes a model of this family."""

    @abc.abstractmethod
    def config_to_hf(self, cfg: ModelSchema, torch_dtype: str) -> dict[str, Any]: ...

    @abc.abstractmethod
    def config_from_hf(self, config: dict[str, Any]) -> ModelSchema:
        """The model a ``config.json`` describes; a ConfigError naming the key when it cannot."""

    def registry_for(self, config: dict[str, Any]) -> MappingRegistry:
        """The name table for reading this ``config.json``'s checkpoint (default: :attr:`registry`;
        a family whose releases nest the same tensors under another prefix picks by the config)."""
        return self.registry

    def context(self, cfg: ModelSchema):
        """What the mappings may ask about the model (default: the config and its expert count)."""
        return _DefaultContext(cfg)

    def annotate_export(self, config: dict[str, Any], cfg: ModelSchema, tokenizer) -> None:
        """Record tokenizer-derived facts in an exported ``config.json`` (default: nothing)."""

    def check_tokenizer(self, config: dict[str, Any], tokenizer, where: str) -> None:
        """Refuse a tokenizer the checkpoint's weights were not trained with, when the config
        states something checkable about it (default: nothing)."""


class _DefaultContext:
    def __init__(self, cfg: ModelSchema):
        self.cfg = cfg

    @property
    def num_experts(self) -> int:
        return int(getattr(self.cfg, "num_routed_experts", 0))
