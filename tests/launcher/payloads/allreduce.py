"""Bootstrap payload: init_distributed, all_reduce the ranks, write what this rank saw.

    allreduce.py OUT_DIR [SOURCE]     (SOURCE: auto, torchrun, mpi, slurm)

Writes OUT_DIR/rank<r>.json: rank, world size, local rank/size, rendezvous source, the
all-reduced sum of (rank + 1), and, when mpi4py is loaded, MPI's own rank and size.
"""

import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_s2.runtime.bootstrap import init_distributed, shutdown_distributed

out_dir, source = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "auto")
info = init_distributed(backend="gloo", source=source)
value = torch.tensor([float(info.rank + 1)])
dist.all_reduce(value)
record = {"rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
          "local_world_size": info.local_world_size, "source": info.source, "backend": info.backend,
          "sum": value.item(), "host": socket.gethostname()}
if "mpi4py.MPI" in sys.modules:
    from mpi4py import MPI

    record["mpi_rank"], record["mpi_size"] = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{info.rank}.json").write_text(json.dumps(record))
shutdown_distributed()
