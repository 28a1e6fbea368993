"""Memory one rank of this host may use: host memory shared by its CPU ranks, or one GPU.

Used by the start-up memory check (:func:`megatron_s2.training.run_checks.check_memory`) and by
the inference engine before it allocates its KV cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["GiB", "HostMemory"]

GiB = 1024 ** 3


@dataclass(frozen=True)
class HostMemory:
    """Memory one rank of this host may use, and how it was found."""

    bytes_per_rank: float
    source: str
    """e.g. "22.3 GiB of host memory available, shared by 4 CPU ranks"."""

    @classmethod
    def detect(cls, ranks_on_host: int, gpus: bool) -> "HostMemory | None":
        """GPU ranks: the memory of one device. CPU ranks: ``MemAvailable`` (Linux) shared by
        the host's ranks. None when it cannot be known here."""
        if gpus:
            import torch

            if not torch.cuda.is_available():
                return None
            device = torch.cuda.current_device()
            total = torch.cuda.get_device_properties(device).total_memory
            return cls(total, f"{total / GiB:.1f} GiB on GPU {device}")
        available = _mem_available()
        if available is None:
            return None
        ranks = max(1, ranks_on_host)
        share = f", shared by {ranks} CPU ranks" if ranks > 1 else ""
        return cls(available / ranks, f"{available / GiB:.1f} GiB of host memory available{share}")

    @classmethod
    def for_this_rank(cls) -> "HostMemory | None":
        """Inside a rank: NCCL ranks own a GPU each; gloo ranks share the host with the
        ``LOCAL_WORLD_SIZE`` ranks the launcher started here."""
        import torch.distributed as dist

        gpus = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        return cls.detect(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), gpus)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
