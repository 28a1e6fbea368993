"""Health checks before training: NVML inventory and a per-rank sniff test.

Nodes that hang at start-up or run at half speed cost a whole job. After
``init_distributed`` every rank runs a short sniff test: a timed GEMM on its device and
timed ``all_reduce`` / ``all_gather`` on the default group. Per-rank times and each node's
NVML inventory (:mod:`~megatron_s2.runtime.gpu_inventory`) are gathered; a rank slower
than ``outlier_factor`` x the median of a measurement is named by rank and host. Hard
problems (uncorrected ECC errors, fewer GPUs than ranks on a node) make ``report.ok``
false; outliers are warnings for the operator (the trainer decides what to do).

The trainer calls::

    report = maybe_run_health_checks(dist_info, recipe.launcher)   # None when disabled
    if report and dist_info.is_main: print(report.format())
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.runtime.bootstrap import DistInfo
from megatron_s2.runtime.gpu_inventory import NodeInventory, query_inventory

__all__ = ["RankTiming", "Outlier", "HealthReport", "run_health_checks", "maybe_run_health_checks",
           "health_checks_enabled", "find_outliers"]

MEASUREMENTS = ("gemm_s", "all_reduce_s", "all_gather_s")
_MIN_OUTLIER_EXCESS_S = 1e-3
"""An outlier must also be this much slower than the median: sub-millisecond jitter is noise."""


@dataclass(frozen=True)
class RankTiming:
    rank: int
    host: str
    gemm_s: float
    all_reduce_s: float
    all_gather_s: float


@dataclass(frozen=True)
class Outlier:
    rank: int
    host: str
    measurement: str
    seconds: float
    median_s: float

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host}: {self.measurement.removesuffix('_s')} {self.seconds * 1e3:.2f} ms is "
                f"{self.seconds / self.median_s:.1f}x the median {self.median_s * 1e3:.2f} ms")


@dataclass(frozen=True)
class HealthReport:
    timings: tuple[RankTiming, ...]
    nodes: tuple[NodeInventory, ...]
    outliers: tuple[Outlier, ...]
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """No hard problem (ECC errors, missing GPUs); outliers are warnings."""
        return not self.problems

    def format(self) -> str:
        lines = [f"health: {len(self.timings)} ranks on {len(self.nodes)} nodes"]
        for node in self.nodes:
            lines.append(f"  {node.host}: {node.message}")
            for gpu in node.gpus:
                lines.append(f"    GPU {gpu.index} {gpu.name} {gpu.memory_total_mib} MiB "
                             f"temp={gpu.temperature_c}C sm={gpu.sm_clock_mhz}/{gpu.max_sm_clock_mhz} MHz "
                             f"ecc uncorrected={gpu.ecc_uncorrected} corrected={gpu.ecc_corrected}")
        for name in MEASUREMENTS:
            values = [getattr(t, name) for t in self.timings]
            lines.append(f"  {name.removesuffix('_s')}: median {statistics.median(values) * 1e3:.2f} ms, "
                         f"max {max(values) * 1e3:.2f} ms")
        lines += [f"  OUTLIER {o.describe()}" for o in self.outliers]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, **asdict(self)}, indent=1)


def find_outliers(timings: list[RankTiming] | tuple[RankTiming, ...], factor: float) -> list[Outlier]:
    """Ranks whose time in any measurement exceeds ``factor`` x the median over ranks."""
    out = []
    for name in MEASUREMENTS:
        median = statistics.median(getattr(t, name) for t in timings)
        for t in timings:
            value = getattr(t, name)
            if value > factor * median and value - median > _MIN_OUTLIER_EXCESS_S:
                out.append(Outlier(t.rank, t.host, name, value, median))
    return out


def _timed(fn, iters: int, sync) -> float:
    fn()  # warm-up (allocations, NCCL communicator set-up)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _sniff(info: DistInfo, host: str, gemm_size: int, comm_numel: int, iters: int) -> RankTiming:
    cuda = info.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a = torch.randn(gemm_size, gemm_size, device=device)
    b = torch.randn(gemm_size, gemm_size, device=device)
    gemm = _timed(lambda: torch.mm(a, b), iters, sync)
    distributed = dist.is_available() and dist.is_initialized()
    buf = torch.ones(comm_numel, device=device)
    chunks = [torch.empty_like(buf) for _ in range(info.world_size)]
    all_reduce = _timed(lambda: dist.all_reduce(buf), iters, sync) if distributed else 0.0
    all_gather = _timed(lambda: dist.all_gather(chunks, buf), iters, sync) if distributed else 0.0
    return RankTiming(info.rank, host, gemm, all_reduce, all_gather)


def run_health_checks(info: DistInfo, *, outlier_factor: float = 3.0, gemm_size: int | None = None,
                      comm_numel: int = 1 << 18, iters: int = 5) -> HealthReport:
    """Collective: every rank must call it. Every rank gets the same full report.

    ``gemm_size`` defaults to 4096 on GPUs and 256 on CPU; ``comm_numel`` float32 elements
    (1 MiB) go through each collective.
    """
    host = socket.gethostname()
    gemm_size = gemm_size or (4096 if info.backend == "nccl" else 256)
    timing = _sniff(info, host, gemm_size, comm_numel, iters)
    inventory = query_inventory(host) if info.local_rank == 0 else None
    mine = (timing, inventory, info.local_world_size if info.backend == "nccl" else 0)
    if dist.is_available() and dist.is_initialized():
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    timings = tuple(sorted((g[0] for g in gathered), key=lambda t: t.rank))
    nodes = tuple(g[1] for g in gathered if g[1] is not None)
    problems = tuple(p for g in gathered if g[1] is not None for p in g[1].problems(expected_gpus=g[2]))
    return HealthReport(timings, nodes, tuple(find_outliers(timings, outlier_factor)), problems)


def health_checks_enabled(config: LauncherConfig, env: dict | None = None) -> bool:
    """``launcher.health_checks``: on, off, or auto (= on inside a SLURM job)."""
    if config.health_checks == "auto":
        return "SLURM_JOB_ID" in (os.environ if env is None else env)
    return config.health_checks == "on"


def maybe_run_health_checks(info: DistInfo, config: LauncherConfig) -> HealthReport | None:
    """Run the checks when ``launcher.health_checks`` enables them (collective), else None."""
    if not health_checks_enabled(config):
        return None
    return run_health_checks(info, outlier_factor=config.health_outlier_factor)
