"""A launchable job: what to run on how many ranks, and where its files go.

:class:`JobSpec` is the launcher's single description of one run, built once by the CLI
(from a recipe and the pre-flight plan) or directly by tests with a stand-in command. The
local launcher and the sbatch script generator both consume it.

Job directory (= the run directory ``training.run_dir``)::

    <run_dir>/launch/config.yaml       resolved recipe every rank is started with
    <run_dir>/launch/plan.json         world size, layout, launch mode, submitted job ids
    <run_dir>/slurm/job.sbatch         generated batch script (SLURM mode)
    <run_dir>/slurm/job-<jobid>.out    batch shell output, all restarts appended
    <run_dir>/logs/restart<N>/rank<r>.log   one log per rank and restart (node<n>.log under torchrun)
    <run_dir>/config.yaml, metrics.jsonl, checkpoints/   written by the trainer
    <run_dir>/FINISHED, PREEMPTED      how the last attempt ended (megatron_s2.runtime.markers)
    <run_dir>/run.lock                 held while a run uses the directory
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.runtime.markers import FINISHED_MARKER, PREEMPTED_MARKER, is_finished

__all__ = ["JobSpec", "JobDir", "RoleSpec", "trainer_command", "rank_python", "FINISHED_MARKER", "PREEMPTED_MARKER"]



class JobDir:
    """Paths inside one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(os.path.abspath(run_dir))

    @property
    def config(self) -> Path:
        return self.root / "launch" / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "launch" / "plan.json"

    @property
    def slurm_dir(self) -> Path:
        return self.root / "slurm"

    @property
    def script(self) -> Path:
        return self.slurm_dir / "job.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def finished(self) -> Path:
        return self.root / FINISHED_MARKER

    @property
    def preempted(self) -> Path:
        return self.root / PREEMPTED_MARKER

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def restart_logs(self, restart: int) -> Path:
        return self.logs / f"restart{restart}"

    def next_restart(self) -> int:
        """Index for a new local launch in this directory (one past the highest existing)."""
        found = [int(m.group(1)) for p in self.logs.glob("restart*") if (m := re.fullmatch(r"restart(\d+)", p.name))]
        return max(found, default=-1) + 1

    def write_plan(self, plan: dict) -> None:
        self.plan.parent.mkdir(parents=True, exist_ok=True)
        self.plan.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")

    def read_plan(self) -> dict:
        return json.loads(self.plan.read_text()) if self.plan.is_file() else {}


@dataclass(frozen=True)
class RoleSpec:
    """Processes beside the trainer ranks: disaggregated RL's inference servers (one node each)
    and its orchestrator (one task), run as further components of a heterogeneous SLURM job
    (:mod:`megatron_s2.launcher.disaggregated`)."""

    servers: int
    """Inference server nodes (heterogeneous component 1)."""
    server_command: tuple[str, ...]
    """argv of one server without ``--port`` (the script adds server ``i``'s: ``port + i``)."""
    orchestrator_command: tuple[str, ...]
    """argv of the orchestrator, to which ``--servers <the servers' URLs>`` is appended at run time."""
    port: int
    """Server ``i`` listens on ``port + i`` (every interface)."""
    server_gpus: int = 0
    """GPUs per server node (0 = CPU)."""
    exchange: Path | None = None
    """The run's ``disaggregated/`` directory: a previous attempt's ``servers.json`` and
    ``ORCHESTRATOR_FAILED`` are removed there; a role that ends early writes the latter."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    """Job name (SLURM --job-name; log prefix locally)."""
    run_dir: Path
    """Absolute run directory (see :class:`JobDir`)."""
    command: tuple[str, ...]
    """The program every rank runs (argv)."""
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    launcher: LauncherConfig
    """Partition, time, env, container, restart policy, ..."""
    train_steps: int | None = None
    """The recipe's ``training.train_steps``: a FINISHED marker of an earlier, shorter target
    does not count as finished (None: any FINISHED marker does)."""
    roles: RoleSpec | None = None
    """Processes beside the ranks (disaggregated RL); None for every other phase."""

    @property
    def finished(self) -> bool:
        """Whether the run directory's FINISHED marker covers this job's target."""
        return is_finished(self.run_dir, self.train_steps or 0)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def dir(self) -> JobDir:
        return JobDir(self.run_dir)


def rank_python(config: LauncherConfig) -> str:
    """Interpreter for rank processes: ``launcher.python``, else ``python`` inside a container
    (the submitting machine's path means nothing there), else this interpreter."""
    return config.python or ("python" if config.container_image else sys.executable)


def trainer_command(config: LauncherConfig, run_dir: Path) -> tuple[str, ...]:
    """argv of one trainer rank: ``python -m megatron_s2.cli train <launch config> --run-dir <dir>``."""
    jobdir = JobDir(run_dir)
    return (rank_python(config), "-m", "megatron_s2.cli", "train", str(jobdir.config), "--run-dir", str(jobdir.root))
