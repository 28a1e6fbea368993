"""Talking to SLURM from the submitting machine: sbatch (with dependencies) and scancel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["SlurmError", "sbatch_argv", "submit", "cancel"]


class SlurmError(RuntimeError):
    """sbatch/scancel is missing or refused the request (the message carries SLURM's words)."""


def sbatch_argv(script: Path, dependency: str | None = None) -> list[str]:
    """``sbatch --parsable [--dependency=afterok:<id> --kill-on-invalid-dep=yes] <script>``.

    A dependent job whose predecessor failed is cancelled rather than left pending forever.
    """
    argv = ["sbatch", "--parsable"]
    if dependency:
        argv += [f"--dependency=afterok:{dependency}", "--kill-on-invalid-dep=yes"]
    return argv + [str(script)]


def submit(script: Path, dependency: str | None = None) -> str:
    """Submit ``script``; returns the job id."""
    if shutil.which("sbatch") is None:
        raise SlurmError("sbatch not found on PATH: submit from a SLURM login node, or use --local")
    result = subprocess.run(sbatch_argv(script, dependency), capture_output=True, text=True)
    if result.returncode != 0:
        raise SlurmError(f"sbatch refused {script}: {result.stderr.strip() or result.stdout.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id for {script}: {result.stdout.strip()!r}")
    return job_id


def cancel(job_ids: list[str]) -> None:
    """Best-effort scancel (used to roll back a partly submitted pipeline)."""
    if job_ids and shutil.which("scancel"):
        subprocess.run(["scancel", *job_ids], capture_output=True, text=True)
