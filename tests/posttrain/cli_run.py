"""Running the ``megatron-s2`` command line from post-training tests, and reading its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path, timeout: float = 900) -> str:
    """``python -m megatron_s2.cli ARGS`` in ``cwd`` (one thread, unbuffered); its stdout. A
    non-zero exit fails the test with the last lines of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (metrics.jsonl, eval.jsonl, ...)."""
    return [json.loads(line) for line in path.read_text().splitlines()]
