"""``model.family`` -> the family's implementation (:class:`~megatron_s2.models.family.base.ModelFamily`).

The name resolves to a package exactly as for the recipe schema
(:func:`megatron_s2.config.model_schema.family_package`: an installed entry point, or a dotted
package path); the package's ``family`` module defines ``FAMILY``. Imported on first use only.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from megatron_s2.config.model_schema import ModelSchema, family_package, installed_families
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.base import ModelFamily
from megatron_s2.models.family.hf import BLOCK_KEY

__all__ = ["family_of", "get_family", "all_installed_families", "family_for_hf_config"]


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


def family_for_hf_config(config: Any):
    """The family of a ``config.json``: the one our ``megatron_s2`` block names, else the installed
    family whose adapter claims it."""
    if not isinstance(config, dict):
        raise ConfigError("config.json: expected a JSON object")
    block = config.get(BLOCK_KEY)
    if isinstance(block, dict) and isinstance(block.get("model"), dict):
        model = block["model"]
        return get_family(model.get("family", "v41") if isinstance(model.get("family", "v41"), str) else "",
                          f"config.json: {BLOCK_KEY}.model.family")
    families = all_installed_families()
    for family in families:
        if family.hf.claims(config):
            return family
    kind = config.get("model_type") or config.get("architectures") or "unknown"
    raise ConfigError(f"config.json: no installed model family reads this architecture ({kind}); installed: "
                      f"{', '.join(f.name for f in families)}")
