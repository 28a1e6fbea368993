"""``ModuleSpec`` / ``build_module``: megatron-core's layer-spec convention, without importing it.

The layer specs follow megatron-core's convention (``megatron.core.transformer.spec_utils``):
a spec names a module class, constructor ``params`` and ``submodules``;
``build_module(spec_or_class, *args, **kwargs)`` instantiates the class with the params, the
submodules (when given) and the call's arguments. megatron-core stays a dependency (setup.py),
but importing ``megatron.core`` costs seconds (it probes Transformer Engine and pulls
``torch._inductor``) in every rank and CLI call, for two small names; these implement exactly the
part of the convention the specs use, and tests/models/test_module_spec.py checks them against
megatron-core's own on the same specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModuleSpec", "build_module"]


@dataclass
class ModuleSpec:
    module: type
    """The class to instantiate."""
    params: dict = field(default_factory=dict)
    """Keyword arguments of its constructor fixed by the spec."""
    submodules: object = None
    """Passed as ``submodules=`` when not None."""
    metainfo: dict = field(default_factory=dict)
    """Free-form annotations (unused by ``build_module``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def build_module(spec_or_module: ModuleSpec | type, *args: Any, **kwargs: Any) -> Any:
    if isinstance(spec_or_module, type):
        return spec_or_module(*args, **kwargs)
    if not isinstance(spec_or_module.module, type):
        raise TypeError(f"ModuleSpec.module must be a class, got {spec_or_module.module!r}")
    if spec_or_module.submodules is not None:
        kwargs["submodules"] = spec_or_module.submodules
    return spec_or_module.module(*args, **spec_or_module.params, **kwargs)
