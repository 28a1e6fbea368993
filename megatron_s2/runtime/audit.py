"""Device audit: find tensor factories in our code that forget their device.

On a GPU rank every tensor the trainer and the inference engine create must live on the
rank's device (:mod:`.device`). A ``torch.zeros(n)`` without ``device=`` silently makes a CPU
tensor there, which either crashes at the first mixed-device op or — worse — moves a whole
computation to the host. On CPU nothing would notice, so :class:`DeviceAudit` makes the rule
checkable on CPU: it is a :class:`torch.overrides.TorchFunctionMode` that records every call of
a tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) made *directly*
from a frame of this repository (``megatron_s2``, ``kernels``, ``launcher``) without an
explicit ``device=``. Host-side code that deliberately builds CPU tensors (data loading, the
CPU generators of the layout-independent initialisation) says ``device="cpu"``.

``*_like`` and ``Tensor.new_*`` inherit the device of their argument and are never flagged.
``torch.from_numpy`` has no device argument and always makes a host tensor: data code copies
its batches to the device in one place (:func:`megatron_s2.runtime.device.to_device`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DeviceAudit", "FactoryCall", "FACTORIES"]

FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.linspace, torch.logspace,
    torch.eye, torch.tensor, torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices, torch.normal,
})
"""Functions that create a tensor on the default device unless told otherwise."""

_REPO = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_REPO / d) + "/" for d in ("megatron_s2", "kernels", "launcher", "tools"))


@dataclass(frozen=True)
class FactoryCall:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: torch.{self.function}(...) without device="


@dataclass
class DeviceAudit(TorchFunctionMode):
    """Records factory calls without ``device=`` made from this repository's code.

    ``with DeviceAudit() as audit: ...`` then ``audit.offenders`` (unique call sites, in
    order of first occurrence). ``ignore`` holds path fragments not to report (e.g. a test's
    own helpers)."""

    ignore: tuple[str, ...] = ()
    calls: list[FactoryCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not self._inherits_device(func, args):
            frame = sys._getframe(1)
            path = frame.f_code.co_filename
            if path.startswith(_OURS) and not any(part in path for part in self.ignore):
                self.calls.append(FactoryCall(func.__name__, str(Path(path).relative_to(_REPO)), frame.f_lineno))
        return func(*args, **kwargs)

    @staticmethod
    def _inherits_device(func, args) -> bool:
        """``torch.as_tensor(t)`` / ``torch.tensor(t)`` of a tensor keep its device;
        ``torch.normal(mean_tensor, ...)`` follows its tensor arguments."""
        return bool(args) and isinstance(args[0], torch.Tensor) and func in (torch.as_tensor, torch.tensor, torch.normal)

    @property
    def offenders(self) -> list[FactoryCall]:
        return list(dict.fromkeys(self.calls))

    def report(self) -> str:
        return "\n".join(str(c) for c in self.offenders)
