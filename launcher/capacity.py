"""Can the partition ever run this job? Asked of ``sinfo`` before anything is queued.

sbatch accepts a job that no node of the partition can hold (too many nodes, more tasks
per node than CPUs, more GPUs than a node has) and leaves it pending forever with reason
``PartitionConfig`` or ``Resources``. This check compares the request with the
partition's largest node and node count, and names the field to change. Where ``sinfo``
is missing or cannot reach the controller (e.g. a dry run on a laptop) it is skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.job import JobSpec

__all__ = ["PartitionCapacity", "query_partition", "check_capacity", "gres_gpus"]


@dataclass(frozen=True)
class PartitionCapacity:
    name: str
    nodes: int
    cpus_per_node: int
    """CPUs of the partition's largest node."""
    gpus_per_node: int
    """GPUs of the partition's best-equipped node."""


def gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES string: ``gpu:8``, ``gpu:h100:4(S:0-1),nic:2`` -> 8, 4."""
    total = 0
    for item in re.split(r",(?![^()]*\))", gres):
        match = re.fullmatch(r"gpu(?::[^:()]+)?:(\d+)(?:\(.*\))?", item.strip())
        if match:
            total += int(match.group(1))
    return total


def query_partition(partition: str) -> PartitionCapacity | None:
    """Capacity of ``partition`` (empty = the default one), or None when sinfo cannot tell."""
    if shutil.which("sinfo") is None:
        return None
    argv = ["sinfo", "--noheader", "--format=%P|%D|%c|%G"] + (["--partition", partition] if partition else [])
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None
    if result.returncode != 0:
        return None
    rows = [line.split("|") for line in result.stdout.splitlines() if line.count("|") == 3]
    if not partition:
        rows = [row for row in rows if row[0].endswith("*")]
    if not rows:
        if partition:
            raise ConfigError(f"launcher.partition: SLURM knows no partition {partition!r}; "
                              "see `sinfo --summarize` for the partitions of this cluster")
        return None
    return PartitionCapacity(
        name=rows[0][0].rstrip("*"),
        nodes=sum(int(row[1]) for row in rows),
        cpus_per_node=max(int(row[2].rstrip("+")) for row in rows),
        gpus_per_node=max(gres_gpus(row[3]) for row in rows),
    )


def _cpus_per_task(job: JobSpec) -> int:
    for arg in job.launcher.sbatch_args:
        match = re.fullmatch(r"--cpus-per-task=(\d+)", arg)
        if match:
            return int(match.group(1))
    return 1


def check_capacity(job: JobSpec, capacity: PartitionCapacity | None = None) -> None:
    """Raise ConfigError when ``job`` cannot fit the partition; no-op when sinfo cannot tell."""
    capacity = capacity or query_partition(job.launcher.partition)
    if capacity is None:
        return
    where = f"partition {capacity.name!r}"
    if job.nodes > capacity.nodes:
        raise ConfigError(f"launcher.nodes: {job.nodes} nodes requested but {where} has {capacity.nodes}; "
                          "lower --nodes or choose another --partition")
    tasks = 1 if job.launcher.mode == "torchrun" else job.nproc_per_node
    cpus = tasks * _cpus_per_task(job)
    if cpus > capacity.cpus_per_node:
        raise ConfigError(f"launcher.nproc_per_node: {job.nproc_per_node} ranks per node need {cpus} CPUs but the "
                          f"largest node of {where} has {capacity.cpus_per_node}; use more --nodes or fewer ranks")
    if job.gpus_per_node > capacity.gpus_per_node:
        raise ConfigError(f"launcher.gpus_per_node: {job.gpus_per_node} GPUs per node requested but the nodes of "
                          f"{where} have at most {capacity.gpus_per_node}; lower --gpus-per-node or change "
                          "--partition")
