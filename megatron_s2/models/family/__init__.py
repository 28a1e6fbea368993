"""The model-family interface: what generic code may know about a model (see :mod:`.base`).

Import :func:`family_of` / :func:`get_family` from here; the interface modules (:mod:`.base`,
:mod:`.engine`, :mod:`.hf`, :mod:`.pipeline`, :mod:`.skeleton`, the conversion mappings) are
imported where used. Importing this package does not import torch.
"""

from megatron_s2.config.model_schema import ModelSchema


def family_of(cfg: ModelSchema):
    """The :class:`~.base.ModelFamily` of a model config (``cfg.family``)."""
    from megatron_s2.models.family.registry import family_of as _family_of

    return _family_of(cfg)


def get_family(name: str, where: str = "model.family"):
    """The :class:`~.base.ModelFamily` registered as ``name`` (or the package at that path)."""
    from megatron_s2.models.family.registry import get_family as _get_family

    return _get_family(name, where)


__all__ = ["family_of", "get_family", "ModelSchema"]
