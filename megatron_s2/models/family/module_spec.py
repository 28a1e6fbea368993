"""``ModuleSpec`` / ``build_module`` where megatron-core cannot be imported.

The layer specs follow megatron-core's convention (``megatron.core.transformer.spec_utils``),
and megatron-core is a dependency (setup.py). A GPU container installed with
``pip install -e . --no-deps`` may lack it, or carry a build that does not import against its
torch; the backbone then uses these two names, which implement the part of the convention
the specs use: a spec names a module class, constructor ``params`` and ``submodules``;
``build_module(spec_or_class, *args, **kwargs)`` instantiates the class with the params, the
submodules (when given) and the call's arguments. :data:`megatron_s2.models.v41.spec.MODULE_SPEC_SOURCE`
says which one is in use (``tools/gpu_check.py`` reports it).
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
