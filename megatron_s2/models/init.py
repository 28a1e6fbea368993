"""Layout-independent parameter initialisation.

Each parameter's *full* (unsharded) tensor is generated from a generator seeded by
(model seed, parameter name) and the rank copies its slice (see
:mod:`megatron_s2.parallel.sharding`). A model therefore starts from identical weights under
every parallel layout, which is what parity tests and layout changes between runs rely on.
Modules attach an ``init_fn(full, generator)`` to parameters whose initialisation is not the
default normal(0, init_std).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatron_s2.parallel.sharding import init_from_full

__all__ = ["normal_init", "constant_init", "initialize_parameters"]

InitFn = Callable[[torch.Tensor, torch.Generator], None]


def normal_init(std: float) -> InitFn:
    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        t.normal_(0.0, std, generator=gen)
    return fn


def constant_init(value: float) -> InitFn:
    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        t.fill_(value)
    return fn


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter of ``model`` from (seed, name); names must not depend on
    the parallel layout (global layer indices, full expert ids)."""
    default = normal_init(std)
    for name, param in model.named_parameters():
        init_from_full(param, name, seed, default)
