"""Launch a function on N local processes (gloo) from inside pytest, once per test module.

nanotron-style: the test body runs in spawned workers that initialise torch.distributed on a
free local port; results travel back through files in a temporary directory.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raise if any fails."""
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)
