"""Launcher section of a recipe (``launcher:``): defaults for `megatron-s2 launch`.

Every field has a command-line flag of the same name (``nodes`` <-> ``--nodes``,
``container_mounts`` <-> ``--mount``, ``env_override``/``env_passthrough`` <-> ``--env``);
a flag replaces the recipe's value and the resolved value is written with the run's config.
Nothing here is forced on a site: no MPI plugin, container or partition is chosen unless
asked for, and ``env`` values are defaults that the job's environment overrides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["LauncherConfig", "PREEMPTION_SIGNALS", "ENV_NAME_PATTERN"]

PREEMPTION_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP")
"""Signals SLURM may send ahead of the time limit (``--signal=B:<sig>@<lead>``)."""

ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A portable environment variable name (anything else is rejected, never quoted)."""

_TIME_PATTERN = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _time_limit_seconds(text: str) -> int:
    """Seconds in a SLURM time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hms = parts + [0] * (3 - len(parts))  # D-H, D-H:M, D-H:M:S
    elif len(parts) == 1:
        hms = [0, parts[0], 0]  # M
    elif len(parts) == 2:
        hms = [0, parts[0], parts[1]]  # M:S
    else:
        hms = parts
    return int(days or 0) * 86400 + hms[0] * 3600 + hms[1] * 60 + hms[2]


@dataclass(frozen=True)
class LauncherConfig:
    nodes: int = 1
    """Nodes to request on SLURM (local mode runs on one machine: 1)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 = CPU ranks (gloo)."""
    nproc_per_node: int = 0
    """Rank processes per node; 0 = one per GPU, or for CPU ranks the layout's world size
    (parallel.dp set) divided by the nodes."""
    mode: Literal["srun", "torchrun"] = "srun"
    """How ranks start on SLURM: one srun task per rank, or one torchrun per node."""
    partition: str = ""
    """SLURM partition (empty = cluster default)."""
    time: str = ""
    """SLURM time limit, e.g. 04:00:00 or 1-12:00:00 (empty = partition default)."""
    account: str = ""
    """SLURM account (empty = user default)."""
    job_name: str = ""
    """SLURM job name (empty = the recipe file's name)."""
    sbatch_args: tuple[str, ...] = ()
    """Extra sbatch options, one per item (e.g. --qos=high, --exclusive)."""
    srun_args: tuple[str, ...] = ()
    """Extra srun options for the training step, one per item."""
    mpi: str = ""
    """srun --mpi plugin (e.g. pmix); empty = the site's MpiDefault, never hard-coded."""
    container_image: str = ""
    """Container image for pyxis (srun --container-image); empty = no container."""
    container_mounts: tuple[str, ...] = ()
    """Container mounts SRC:DST (srun --container-mounts); the run directory must be visible."""
    python: str = ""
    """Interpreter that starts each rank; empty = the one running `megatron-s2 launch`
    (``python`` inside a container)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment defaults (e.g. NCCL settings); a variable already set in the job's
    environment (the submitting shell) wins."""
    env_override: dict[str, str] = field(default_factory=dict)
    """Variables set for every rank, overriding the environment (--env NAME=VALUE)."""
    env_passthrough: tuple[str, ...] = ()
    """Variables taken from the submitting shell, never written into the script (--env NAME)."""
    max_restarts: int = 3
    """Times a preempted job requeues itself (counted by SLURM_RESTART_COUNT)."""
    signal: str = "USR1"
    """Signal SLURM sends to the batch shell before the time limit; forwarded to every rank."""
    signal_lead_time: int = 120
    """Seconds before the time limit at which ``signal`` is sent (longer than a step plus a save)."""
    health_checks: Literal["auto", "on", "off"] = "auto"
    """NVML inventory and sniff test before training; auto = on under SLURM."""
    health_outlier_factor: float = 3.0
    """A rank whose sniff-test time exceeds this multiple of the median is named as an outlier."""
    terminate_grace_s: float = 10.0
    """Local mode: seconds surviving ranks get after SIGTERM, once a rank failed, before SIGKILL."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"launcher.nodes: must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"launcher.gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        if self.nproc_per_node < 0:
            raise ConfigError(f"launcher.nproc_per_node: must be >= 0 (0 derives it), got {self.nproc_per_node}")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(f"launcher.nproc_per_node: {self.nproc_per_node} ranks per node but "
                              f"gpus_per_node={self.gpus_per_node}; run one rank per GPU (drop --nproc-per-node)")
        if self.time and not _TIME_PATTERN.fullmatch(self.time):
            raise ConfigError(f"launcher.time: {self.time!r} is not a SLURM time limit; use MM, HH:MM:SS or D-HH:MM:SS")
        if self.signal not in PREEMPTION_SIGNALS:
            raise ConfigError(f"launcher.signal: {self.signal!r} is not one of {list(PREEMPTION_SIGNALS)}")
        if not 0 < self.signal_lead_time <= 65535:
            raise ConfigError(f"launcher.signal_lead_time: must be in 1..65535 seconds, got {self.signal_lead_time}")
        if self.time and self.signal_lead_time >= self.time_limit_seconds():
            raise ConfigError(f"launcher.signal_lead_time: {self.signal_lead_time} s is not shorter than the time "
                              f"limit {self.time!r}; lower it or raise launcher.time")
        if self.max_restarts < 0:
            raise ConfigError(f"launcher.max_restarts: must be >= 0, got {self.max_restarts}")
        if self.health_outlier_factor <= 1.0:
            raise ConfigError(f"launcher.health_outlier_factor: must be > 1, got {self.health_outlier_factor}")
        if self.terminate_grace_s < 0:
            raise ConfigError(f"launcher.terminate_grace_s: must be >= 0, got {self.terminate_grace_s}")
        for mount in self.container_mounts:
            src, sep, dst = mount.partition(":")
            if not (sep and src and dst) or "," in mount:
                raise ConfigError(f"launcher.container_mounts: {mount!r} must look like SRC:DST[:FLAGS] "
                                  "without commas (give one mount per --mount)")
        for section in ("env", "env_override"):
            for name in getattr(self, section):
                self._check_env_name(f"launcher.{section}", name)
        for name in self.env_passthrough:
            self._check_env_name("launcher.env_passthrough", name)
        for name in ("partition", "account", "job_name", "mpi", "container_image", "python"):
            self._check_one_line(f"launcher.{name}", getattr(self, name))
        for name in ("sbatch_args", "srun_args", "container_mounts"):
            for item in getattr(self, name):
                self._check_one_line(f"launcher.{name}", item)

    def time_limit_seconds(self) -> int | None:
        """The time limit in seconds, or None when the partition default applies."""
        return _time_limit_seconds(self.time) if self.time else None

    @staticmethod
    def _check_env_name(path: str, name: str) -> None:
        if not ENV_NAME_PATTERN.fullmatch(name):
            raise ConfigError(f"{path}: {name!r} is not a valid environment variable name "
                              "(letters, digits and _, not starting with a digit)")

    @staticmethod
    def _check_one_line(path: str, value: str) -> None:
        # SLURM directive lines and option values cannot carry control characters; quoting
        # cannot help there, so such values are refused rather than mangled.
        if _CONTROL_CHARS.search(value):
            raise ConfigError(f"{path}: {value!r} contains a newline or control character; remove it")
