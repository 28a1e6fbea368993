"""Start torch.distributed in a rank process, whoever launched it.

``init_distributed()`` is the first thing a rank does: it discovers its rank, the world and
rank 0's address (:mod:`megatron_s2.runtime.rendezvous`: torchrun, mpirun, srun, or a
single process), picks the backend and the rank's device in one place
(:func:`megatron_s2.runtime.device.resolve_rank_device`: nccl <=> the GPU of its local rank,
gloo <=> CPU), makes that GPU the current device, initialises the default process group and exports the torchrun-style
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) so that code which
reads them (megatron-core, torch utilities) sees one consistent story. It never chooses an
MPI plugin: with ``srun --mpi=pmix`` or ``mpirun`` the site's MPI is used as found.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from megatron_s2.runtime.peer_loss import lost_peer
from megatron_s2.runtime.store_fd import take_store_fd
from megatron_s2.runtime.rendezvous import Rendezvous, discover
from megatron_s2.runtime.device import resolve_rank_device

__all__ = ["DistInfo", "init_distributed", "shutdown_distributed", "resolve_backend"]

_TIMEOUT_ENV = "MEGATRON_S2_DIST_TIMEOUT_S"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    """"nccl" or "gloo" ("none" for an uninitialised single process)."""
    source: str = "single"
    """Where the rank came from: torchrun, mpi, slurm, single (or existing: already initialised)."""
    master_addr: str = ""
    master_port: int = 0
    device: torch.device = torch.device("cpu")
    """Where this rank computes (:mod:`megatron_s2.runtime.device`): the trainer and the
    inference engine put everything there."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when this process sees a GPU, else ``gloo``; ``nccl`` without a
    GPU is a ConfigError (exit 2, one line)."""
    return resolve_rank_device(backend).backend


def _export(rdv: Rendezvous) -> None:
    os.environ.update({
        "RANK": str(rdv.rank), "WORLD_SIZE": str(rdv.world_size),
        "LOCAL_RANK": str(rdv.local_rank), "LOCAL_WORLD_SIZE": str(rdv.local_world_size),
        "MASTER_ADDR": rdv.master_addr, "MASTER_PORT": str(rdv.master_port),
    })


def _info(rdv: Rendezvous, backend: str, device: torch.device) -> DistInfo:
    return DistInfo(rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size, backend,
                    rdv.source, rdv.master_addr, rdv.master_port, device)


def _rendezvous_store(rdv: Rendezvous, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's TCPStore: rank 0 serves it, the others connect (retrying until ``timeout``).

    Every rank builds the store the same way, so its keys agree (``init_method=tcp://`` would
    add a prefix that an explicitly passed store does not). When a local launcher handed rank 0
    the socket it already listens on (:mod:`~megatron_s2.runtime.store_fd`), rank 0 serves the
    store on that socket instead of binding ``MASTER_PORT`` again: no other process can take the
    port in between.
    """
    store_fd = take_store_fd()
    served = {"master_listen_fd": store_fd} if rdv.rank == 0 and store_fd is not None else {}
    host = rdv.master_addr.strip("[]")  # an IPv6 address as a URL would write it
    return dist.TCPStore(host, rdv.master_port, rdv.world_size, rdv.rank == 0, timeout, **served)


def init_distributed(backend: str = "auto", source: str = "auto") -> DistInfo:
    """Initialise the default process group from the launch environment; idempotent.

    ``backend``: auto, nccl or gloo. ``source``: auto (see
    :mod:`~megatron_s2.runtime.rendezvous`) or one of torchrun, mpi, slurm, single.
    A single process (no launcher) gets no process group and backend "none", and the device
    the backend table gives it (its GPU with ``auto``/``nccl`` when one is visible, else CPU).
    The timeout of collectives defaults to torch's, or ``$MEGATRON_S2_DIST_TIMEOUT_S``.
    """
    if dist.is_available() and dist.is_initialized():  # e.g. a test harness got there first
        from megatron_s2.runtime.device import process_device

        env = os.environ
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", dist.get_world_size())), dist.get_backend(),
                        "existing", env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", 0)), process_device())
    rdv = discover(source=source)
    placed = resolve_rank_device(backend, rdv.local_rank, rank=rdv.rank)
    if placed.is_cuda:
        torch.cuda.set_device(placed.device)
    if rdv.world_size == 1 and rdv.source == "single":
        return _info(rdv, "none", placed.device)
    backend = placed.backend
    _export(rdv)
    kwargs = {}
    if os.environ.get(_TIMEOUT_ENV):
        kwargs["timeout"] = datetime.timedelta(seconds=float(os.environ[_TIMEOUT_ENV]))
    if backend == "nccl":
        kwargs["device_id"] = placed.device
    timeout = kwargs.get("timeout", default_pg_timeout)
    dist.init_process_group(backend=backend, store=_rendezvous_store(rdv, timeout), rank=rdv.rank,
                            world_size=rdv.world_size, **kwargs)
    return _info(rdv, backend, placed.device)


def shutdown_distributed(leave_together: bool = True) -> None:
    """Leave together and tear the process group down before the interpreter exits.

    Call it on every rank at the end of a run (also after a preemption save). Without it
    gloo/NCCL threads may still be running while Python finalises, and a rank that finished
    cleanly can die with SIGABRT ("terminate called without an active exception"), which
    the launchers must report as a failure. ``leave_together=False`` skips the final barrier:
    for a rank that lost a peer (:mod:`megatron_s2.runtime.peer_loss`), where it could only fail
    again (gloo) or wait forever (NCCL). A peer found gone at the barrier itself (it died after
    this rank's last collective) is not this rank's failure: its launcher names that rank.
    """
    if dist.is_available() and dist.is_initialized():
        if leave_together and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except RuntimeError as exc:
                if lost_peer(exc) is None:
                    raise
        dist.destroy_process_group()
