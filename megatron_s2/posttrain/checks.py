"""Checks of a post-training recipe that need the post-training code itself.

The ``rl:`` / ``opd:`` sections are plain dataclasses (:mod:`megatron_s2.config.posttrain`), so
loading a recipe never imports torch; the names they give for registered pieces — group
estimators, advantage transforms, loss terms, token masks — are checked here against the
registries (which a plugin may extend), before any rank starts (``megatron-s2 launch`` and
``train``) and again when the post-training trainer is built.
"""

from __future__ import annotations

from megatron_s2.config.posttrain.recipe_checks import posttrain_section
from megatron_s2.config.schema import ConfigError

__all__ = ["check_registered_names"]


def _known(path: str, name: str, registry: dict, what: str) -> None:
    if name not in registry:
        raise ConfigError(f"{path}: '{name}' is not a registered {what}; use one of {', '.join(sorted(registry))}")


def check_registered_names(recipe) -> None:
    """Every registry name of the recipe's ``rl`` / ``opd`` section exists (no-op for other phases)."""
    section = posttrain_section(recipe)
    if section is None:
        return
    from megatron_s2.posttrain.advantages import ADVANTAGE_TRANSFORMS, GROUP_ESTIMATORS
    from megatron_s2.posttrain.losses import LOSS_TERMS, TOKEN_MASKS

    kind = recipe.phase.kind
    advantage = getattr(section, "advantage", None)
    if advantage is not None:
        _known(f"{kind}.advantage.estimator", advantage.estimator, GROUP_ESTIMATORS, "group estimator")
        for name in advantage.transforms:
            _known(f"{kind}.advantage.transforms", name, ADVANTAGE_TRANSFORMS, "advantage transform")
    for i, term in enumerate(section.loss.terms):
        _known(f"{kind}.loss.terms[{i}].kind", term.kind, LOSS_TERMS, "loss term")
    for name in section.loss.masks:
        _known(f"{kind}.loss.masks", name, TOKEN_MASKS, "token mask")
