"""Helpers shared by the launcher tests: stand-in payloads and job builders."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.launcher.job import JobSpec

PAYLOADS = Path(__file__).resolve().parent / "payloads"
RESUMABLE = PAYLOADS / "resumable.py"
ALLREDUCE = PAYLOADS / "allreduce.py"
RECIPES = Path(__file__).resolve().parent / "recipes"

requires_trainer = pytest.mark.skipif(
    importlib.util.find_spec("megatron_s2.cli.train") is None,
    reason="needs the trainer (megatron_s2.cli.train, `megatron-s2 train`), not in this build")


def expected_loss(steps: int, world: int) -> float:
    """The stand-in's loss after ``steps`` uninterrupted steps (see payloads/resumable.py)."""
    loss = 10.0
    for _ in range(steps):
        loss = round(loss * 0.9 + 0.001 * world * (world + 1) / 2, 9)
    return loss


def payload_job(run_dir: Path, payload: Path, *args: str, nodes: int = 1, nproc: int = 2,
                **launcher) -> JobSpec:
    """A JobSpec running a stand-in payload (python <payload> <run_dir> <args>) on every rank."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return JobSpec(name=f"test-{payload.stem}", run_dir=run_dir.absolute(),
                   command=(sys.executable, str(payload), str(run_dir), *args), nodes=nodes, nproc_per_node=nproc,
                   gpus_per_node=0, launcher=LauncherConfig(**launcher))


_SRUN_STUB = """#!/usr/bin/env python3
import json, os, sys
with open(os.path.join(os.environ["STUB_DIR"], "srun.json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, fh)
if os.environ.get("STUB_SRUN_WRITES"):  # a file the ranks would write (e.g. PREEMPTED)
    path, _, text = os.environ["STUB_SRUN_WRITES"].partition("=")
    with open(path, "w") as fh:
        fh.write(text)
sys.exit(int(os.environ.get("STUB_SRUN_RC", "0")))
"""
_SCONTROL_STUB = """#!/usr/bin/env python3
import os, sys
with open(os.path.join(os.environ["STUB_DIR"], "scontrol.log"), "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("localhost")
"""


@dataclass
class StubbedRun:
    returncode: int
    output: str
    srun: dict | None
    """argv and environment the (stub) srun was started with; None when it never ran."""
    scontrol: list[str]
    """scontrol invocations (e.g. "requeue 4242")."""


def run_script_with_stubs(script: Path, stub_dir: Path, *, srun_rc: int = 0, restart: int | None = None,
                          env: dict[str, str] | None = None, srun_writes: tuple[Path, str] | None = None
                          ) -> StubbedRun:
    """Run a generated batch script with bash, outside SLURM, with srun and scontrol replaced by
    recorders: shows exactly what the script would start and whether it requeues.
    ``srun_writes``: (path, text) the stub srun writes, as the ranks would."""
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", _SRUN_STUB), ("scontrol", _SCONTROL_STUB)):
        (stub_dir / name).write_text(text)
        (stub_dir / name).chmod(0o755)
    run_env = {**os.environ, **(env or {}), "PATH": f"{stub_dir}:{os.environ['PATH']}", "STUB_DIR": str(stub_dir),
               "STUB_SRUN_RC": str(srun_rc), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost"}
    if restart is not None:
        run_env["SLURM_RESTART_COUNT"] = str(restart)
    if srun_writes is not None:
        run_env["STUB_SRUN_WRITES"] = f"{srun_writes[0]}={srun_writes[1]}"
    result = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=60)
    srun_file, scontrol_file = stub_dir / "srun.json", stub_dir / "scontrol.log"
    srun = json.loads(srun_file.read_text()) if srun_file.exists() else None
    scontrol = scontrol_file.read_text().splitlines() if scontrol_file.exists() else []
    for path in (srun_file, scontrol_file):
        path.unlink(missing_ok=True)
    return StubbedRun(result.returncode, result.stdout + result.stderr, srun, scontrol)


def parse_directive(line: str) -> list[str]:
    """Arguments of one ``#SBATCH`` line as SLURM 22.05's sbatch reads them: whitespace splits
    (even after a backslash, outside quotes), quotes group, a backslash takes the next character
    literally, an unquoted ``#`` starts a comment. An independent reading of our quoting."""
    text, args, i = line[len("#SBATCH"):], [], 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text) or text[i] == "#":
            break
        word, quote, escape = [], "", False
        while i < len(text) and (quote or not text[i].isspace()):
            ch = text[i]
            i += 1
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
                continue
            elif quote:
                if ch == quote:
                    quote = ""
                    continue
            elif ch in "\"'":
                quote = ch
                continue
            elif ch == "#":
                i = len(text)
                break
            word.append(ch)
        args.append("".join(word))
    return args


def sbatch_options(script: str) -> list[str]:
    """All ``#SBATCH`` arguments of a script, in order (only the leading comment block counts)."""
    options = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            options += parse_directive(line)
    return options
