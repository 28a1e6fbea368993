"""Launch a function on N local processes (gloo) from inside pytest, once per test module.

nanotron-style: the test body runs in spawned workers that initialise torch.distributed;
results travel back through files in a temporary directory.

The ranks meet through a ``FileStore`` in a fresh temporary directory, not a TCP port: a port
found free and released before rank 0 listens on it can be taken in between by another test
of the same run (pytest-xdist runs two at once), which failed CI with EADDRINUSE — and a rank
whose rank 0 failed could connect to *another* test's store on that port. Gloo's own pair
connections bind ephemeral ports, so nothing here picks a port.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_gloo", "rendezvous_dir", "run_distributed", "spawn"]


def init_gloo(rank: int, world: int, store_dir: str, timeout_s: float | None = None) -> None:
    """Join the gloo process group of ``world`` ranks meeting in ``store_dir``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=rank,
                            world_size=world, **kwargs)


class rendezvous_dir:
    """A fresh directory for one spawn's file store, removed afterwards (``with rendezvous_dir() as d``)."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="ms2-rdv-")
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def spawn(worker, nprocs: int, *args) -> None:
    """``mp.spawn(worker, (store_dir, *args))``: each rank calls ``init_gloo(rank, nprocs, store_dir)``."""
    with rendezvous_dir() as store_dir:
        mp.spawn(worker, args=(store_dir, *args), nprocs=nprocs, join=True)


def _worker(rank: int, store_dir: str, world: int, fn, args) -> None:
    import torch

    torch.set_num_threads(1)
    init_gloo(rank, world, store_dir)
    try:
        fn(rank, world, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raise if any fails."""
    spawn(_worker, world, world, fn, args)
