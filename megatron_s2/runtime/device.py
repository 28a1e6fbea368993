"""Where a rank computes: the one place that decides each rank's device.

Every rank computes on exactly one device, decided here from the communication backend the
recipe asks for (``parallel.backend``) and the launcher's rank environment (``LOCAL_RANK``,
exported by :mod:`megatron_s2.runtime.bootstrap` whatever started the rank):

=============  ===============================  ==========================================
backend        device                           when
=============  ===============================  ==========================================
``gloo``       ``cpu``                          always (GPUs, if visible, are not used)
``nccl``       ``cuda:<local index>``           a GPU is visible; otherwise a ConfigError
``auto``       nccl + ``cuda:<local index>``    this process sees a GPU
``auto``       gloo + ``cpu``                   no GPU
=============  ===============================  ==========================================

The local index is ``LOCAL_RANK`` when the node shows several GPUs, and 0 when the launcher
gave every rank exactly one (``CUDA_VISIBLE_DEVICES`` per rank). A single process without a
launcher follows the same table (without a process group).

What lives on the device (everything the trainer and the inference engine create): the
model's parameters and buffers (the model is *built* under :func:`build_on`, so tensors a
module creates at construction land there too; initial values are drawn on the host from
CPU generators, so every device starts from the same weights), every micro-batch
(:func:`to_device`, the single host-to-device copy of the data path), optimiser state (created
``zeros_like`` the parameters), checkpoint targets (DCP reads into the parameters' own
storage), pipeline receive buffers and the KV cache. The RNG state of a checkpoint holds the
CPU generator and, on GPU ranks, the CUDA generator of the rank's device
(:mod:`megatron_s2.training.rng`). :class:`~megatron_s2.runtime.audit.DeviceAudit` checks on
CPU that no tensor factory in our code forgets its device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_s2.config.schema import ConfigError

__all__ = ["RankDevice", "resolve_rank_device", "process_device", "check_device_backend", "to_device", "build_on",
           "cuda_count"]

BACKENDS = ("auto", "nccl", "gloo")


def cuda_count() -> int:
    """GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class RankDevice:
    """The backend and the device of one rank (module table)."""

    backend: str
    """``nccl`` or ``gloo``."""
    device: torch.device
    """``cpu`` or ``cuda:<index>``."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_rank_device(backend: str = "auto", local_rank: int = 0, *, gpus: int | None = None,
                        rank: int | None = None) -> RankDevice:
    """The module table for one rank. ``gpus`` defaults to the GPUs this process sees."""
    if backend not in BACKENDS:
        raise ConfigError(f"parallel.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    gpus = cuda_count() if gpus is None else gpus
    if backend == "gloo" or (backend == "auto" and gpus == 0):
        return RankDevice("gloo", torch.device("cpu"))
    if gpus == 0:
        raise ConfigError("parallel.backend: nccl needs a GPU but none is visible to this process; "
                          "use parallel.backend=gloo (CPU) or auto, or run on a GPU allocation")
    if gpus == 1:
        return RankDevice("nccl", torch.device("cuda", 0))
    if local_rank >= gpus:
        who = f"rank {rank}: " if rank is not None else ""
        raise ConfigError(f"launcher.nproc_per_node: {who}local rank {local_rank} but only {gpus} GPUs are visible; "
                          "start at most one rank per GPU (nproc_per_node <= gpus_per_node)")
    return RankDevice("nccl", torch.device("cuda", local_rank))


def process_device(backend: str = "auto") -> torch.device:
    """This process's device: the initialised process group's (nccl -> its current CUDA
    device, gloo -> cpu), else the module table for ``backend`` and ``$LOCAL_RANK``."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return resolve_rank_device(backend, int(os.environ.get("LOCAL_RANK", "0") or 0)).device


def check_device_backend(device: torch.device) -> None:
    """nccl <=> cuda: a device that the initialised process group cannot talk from is an error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    backend = dist.get_backend()
    if (backend == "nccl") != (device.type == "cuda"):
        raise ConfigError(f"parallel.backend: the process group uses {backend} but this rank computes on {device}; "
                          "nccl needs CUDA devices and gloo CPU tensors (use parallel.backend=auto)")


def to_device(obj, device: torch.device, non_blocking: bool = True):
    """Tensors in (nested dicts / lists / tuples of) ``obj`` on ``device``; other values as they are.

    The data path's one host-to-device copy: micro-batches are built on the host (pinned
    memory is not required) and moved here right before the forward."""
    if torch.is_tensor(obj):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return type(obj)((k, to_device(v, device, non_blocking)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj


@contextlib.contextmanager
def build_on(device: torch.device) -> Iterator[None]:
    """Build modules on ``device``: factories without an explicit device default to it (the
    ``torch.device`` context), and the CUDA device is the current one while building."""
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        stack.enter_context(device)
        yield
