"""The environment each rank sees, from the launcher section and the submitting shell.

Three kinds of variables (``launcher:`` fields, ``--env`` on the command line):

- ``env``: recipe defaults (e.g. ``NCCL_IB_TIMEOUT``); a value already in the environment wins.
- ``env_override`` (``--env NAME=VALUE``): set for every rank, whatever the environment says.
- ``env_passthrough`` (``--env NAME``): must exist in the submitting shell; its value travels
  through the process environment (sbatch exports it), never through the script or config.
"""

from __future__ import annotations

import os
from typing import Mapping

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.config.schema import ConfigError

__all__ = ["parse_env_flags", "check_passthrough", "rank_environment"]


def parse_env_flags(flags: list[str] | tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    """``--env`` values -> (overrides ``NAME=VALUE``, pass-through names ``NAME``)."""
    overrides: dict[str, str] = {}
    passthrough: list[str] = []
    for flag in flags:
        name, sep, value = flag.partition("=")
        if sep:
            overrides[name] = value
        elif name not in passthrough:
            passthrough.append(name)
    return overrides, tuple(passthrough)


def check_passthrough(config: LauncherConfig, env: Mapping[str, str] | None = None) -> None:
    """Every ``--env NAME`` must be set where the job is submitted from."""
    env = os.environ if env is None else env
    missing = [name for name in config.env_passthrough if name not in env]
    if missing:
        raise ConfigError(f"launcher.env_passthrough: {', '.join(missing)} not set in this shell; "
                          "export it before launching or give --env NAME=VALUE")


def rank_environment(config: LauncherConfig, base: Mapping[str, str], nproc_local: int) -> dict[str, str]:
    """Environment for a locally started rank (before its rank variables are added)."""
    check_passthrough(config, base)
    env = dict(base)
    for name, value in config.env.items():
        env.setdefault(name, value)
    env.update(config.env_override)
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank logs are read live and on failure
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_local))))
    return env
