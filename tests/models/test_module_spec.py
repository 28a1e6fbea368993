"""Our ModuleSpec / build_module (megatron_s2.models.family.module_spec) follow megatron-core's
convention exactly: the same specs build the same modules with megatron-core's own builder.
(The runtime does not import megatron-core; this test does.)"""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from megatron_s2.models.family import module_spec as ours


@pytest.fixture(scope="module")
def core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import spec_utils
    return spec_utils


class Leaf(nn.Module):
    def __init__(self, width: int, *, scale: float = 1.0, submodules=None):
        super().__init__()
        self.width, self.scale, self.submodules = width, scale, submodules


@pytest.mark.parametrize("params, submodules", [({}, None), ({"scale": 2.0}, None), ({"scale": 3.0}, "subs")])
def test_same_spec_same_module(core, params, submodules):
    built = []
    for spec_cls, build in ((ours.ModuleSpec, ours.build_module), (core.ModuleSpec, core.build_module)):
        spec = spec_cls(module=Leaf, params=params, submodules=submodules)
        module = build(spec, 8)
        built.append((type(module), module.width, module.scale, module.submodules))
    assert built[0] == built[1]


def test_a_class_builds_itself(core):
    assert isinstance(ours.build_module(Leaf, 4), Leaf) and isinstance(core.build_module(Leaf, 4), Leaf)
