"""Verifier integrity: how an episode is graded (walkthrough Ch. 7, "Verifier integrity").

"Executable environments expose the reward channel to solution leakage, test manipulation, and
other forms of reward hacking." Each attack is closed by *sequencing*, not by trusting the agent:

* grading starts only after the agent's sandbox is closed (nothing it started still runs);
* it happens in a **fresh sandbox**: the agent's final workspace files (regular files only), then
  ``reset`` outputs removed, then the task's **canonical files overlaid last** — the agent may
  edit or delete the tests, it cannot change what grades it;
* the tests run from a **read-only mount** of the grader folder, under a trusted stdlib runner
  (:mod:`._grade`, ``python3 -I``: no pytest, conftest, plugins, PYTHONPATH or cwd imports),
  in their own sandbox with the same limits as the agent's;
* no solution leakage: the workspace the agent sees is a fresh git repository whose only
  commit is the task's starting state, and neither the grader folder nor the reference solution
  is mounted in the agent's sandbox;
* "Missing grading artifacts, execution failures, and unparseable verifier outputs are tracked
  separately from genuine task failure": a run without its nonce-stamped result line, with an
  error exit, or missing any canonical test id is ``grader_error`` (reward 0), never a pass.

All-correct semantics: reward 1 only when every canonical test passes.
"""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from megatron_s2.posttrain.agentic.sandbox import SandboxCrashed, SandboxRuntime, tar_directory
from megatron_s2.posttrain.agentic.tasks import AgenticTask

__all__ = ["Grade", "grade_workspace", "grading_tar", "workspace_tar"]

_RUNNER = Path(__file__).with_name("_grade.py")
GRADE_TIMEOUT_S = 30.0


@dataclass
class Grade:
    """The verifier's verdict on one episode."""

    status: str
    """'passed', 'failed', or 'grader_error' (no trustworthy verdict; tracked apart from failures)."""
    results: dict[str, str] = field(default_factory=dict)
    """Canonical test id -> 'pass' or 'fail: <why>'."""
    detail: str = ""

    @property
    def reward(self) -> float:
        return 1.0 if self.status == "passed" else 0.0


def grading_tar(task: AgenticTask, agent_tar: bytes) -> bytes:
    """The grading view: the agent's regular files, minus ``reset`` outputs and anything at a
    canonical path, then the canonical overlay (last)."""
    canonical = {dst: task.files[dst].encode() if dst in task.files else (task.grader / src).read_bytes()
                 for src, dst in task.overlay.items()}  # a variant's input is the canonical one
    dropped = set(task.reset) | set(canonical)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(agent_tar)) as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
        for member in src.getmembers():
            name = member.name.removeprefix("./")
            blocked = name in dropped or any(d.startswith(name + "/") for d in dropped)  # a folder in a file's way
            if member.isfile() and not blocked and not name.startswith(".git/"):
                dst.addfile(member, src.extractfile(member))
        for name, data in canonical.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))
    return out.getvalue()


def grade_workspace(task: AgenticTask, agent_tar: bytes, runtime: SandboxRuntime,
                    timeout: float = GRADE_TIMEOUT_S) -> Grade:
    """Grade the agent's final workspace ``agent_tar`` in a fresh sandbox (module docstring)."""
    nonce = secrets.token_hex(16)
    expected = task.test_ids()
    try:
        with runtime.open(readonly={"grader": task.grader, "runner": _RUNNER}) as box:
            box.import_tar(grading_tar(task, agent_tar))
            result = box.run(f"echo {nonce} | python3 -I {box.mounts['runner']} {box.mounts['grader']} "
                             f"{box.workspace}", timeout=timeout)
    except (SandboxCrashed, OSError, ValueError) as exc:
        return Grade("grader_error", detail=f"grading sandbox: {exc}")
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"GRADE {nonce} ")]
    if result.status != "ok" or len(lines) != 1:
        return Grade("grader_error", detail=f"runner {result.status}, {len(lines)} result lines; "
                                            f"stderr: {result.stderr[-300:]}")
    try:
        results = json.loads(lines[0][len(f"GRADE {nonce} "):])
    except json.JSONDecodeError:
        return Grade("grader_error", detail="unparseable result line")
    imported = {k for k in results if not k.endswith("::<import>")}
    if any(k.endswith("::<import>") for k in results):  # the code under test broke the import: a failure
        return Grade("failed", results, detail="a canonical test file failed to import")
    if imported != expected:
        return Grade("grader_error", results, detail=f"expected tests {sorted(expected)}, got {sorted(imported)}")
    passed = all(v == "pass" for v in results.values())
    return Grade("passed" if passed else "failed", results)


def workspace_tar(task: AgenticTask) -> bytes:
    """The task's starting workspace as a tar (what each episode's sandbox is filled with), a
    variant's files laid over it."""
    if not task.files:
        return tar_directory(task.workspace)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar_directory(task.workspace))) as src, \
            tarfile.open(fileobj=out, mode="w:gz") as dst:
        for member in src.getmembers():
            if member.name not in task.files:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        for name, text in sorted(task.files.items()):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))
    return out.getvalue()
