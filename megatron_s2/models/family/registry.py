"""``model.family`` -> the family's implementation (:class:`~megatron_s2.models.family.base.ModelFamily`).

The name resolves to a package exactly as for the recipe schema
(:func:`megatron_s2.config.model_schema.family_package`: an installed entry point, or a dotted
package path); the package's ``family`` module defines ``FAMILY``. Imported on first use only.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from megatron_s2.config.model_schema import ModelSchema, family_package, installed_families
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.base import ModelFamily

__all__ = ["family_of", "get_family", "all_installed_families"]


@lru_cache(maxsize=None)
def _load(package: str) -> ModelFamily:
    module = importlib.import_module(f"{package}.family")
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, ModelFamily):
        raise TypeError(f"{package}.family.FAMILY must be a ModelFamily, got {family!r}")
    return family


def get_family(name: str, where: str = "model.family") -> ModelFamily:
    package = family_package(name, where)
    try:
        return _load(package)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{where}: family '{name}' cannot be imported ({exc})") from None


def family_of(cfg: ModelSchema) -> ModelFamily:
    """The family a model config belongs to."""
    return get_family(cfg.family)


def all_installed_families() -> list[ModelFamily]:
    """Every family registered as an entry point (e.g. to find who claims a Hugging Face config)."""
    return [get_family(name) for name in sorted(installed_families())]
