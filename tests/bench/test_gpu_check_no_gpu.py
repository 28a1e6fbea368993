"""``tools/gpu_check.sh`` without ``--smoke`` on a machine with no CUDA GPU: it ran every part
against ``cuda`` and reported cryptic per-part errors ("Torch not compiled with CUDA enabled",
a ``TypeError`` from ``torch.cuda.device``) as FAILURES. It must say in one line that no GPU is
present and that the check has not run (exit 2), install nothing, and leave a JSON / markdown
that say the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_without_gpu_says_so_and_runs_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the no-GPU path does not apply")
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--smoke" in lines[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] is False and report["no_gpu"] is True and report["parts"] == {}
    assert "NOT RUN" in (out / "gpu_check.md").read_text()
    assert not (out / "logs" / "pip_install.log").exists(), "nothing is installed on a machine without a GPU"


def test_summary_omits_missing_values():
    """A check without a figure printed "triton importable: None" in gpu_check.md."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    report = {"smoke": True, "device": "cpu", "ok": True, "parts": {"env": {"status": "ok", "checks": [
        {"name": "triton importable", "ok": True, "value": None}, {"name": "x", "ok": True, "value": 0.0, "limit": 0}]}}}
    text = gpu_check.summary(report)
    assert "- [ok] env: triton importable\n" in text and "None" not in text and "- [ok] env: x: 0 (limit 0)" in text


@pytest.mark.parametrize("args, words", [
    (["--bogus"], "unknown option '--bogus'"),
    (["a", "b"], "one OUT_DIR only"),
    (["--smoke", "FILE"], "is not a writable directory"),
])
def test_bad_arguments_exit_2_in_one_line(tmp_path, args, words):
    """`--bogus` became an OUT_DIR named '--bogus' (mkdir and argparse errors); an OUT_DIR that is a
    file crashed with a NotADirectoryError traceback."""
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / a) if a in ("FILE", "a", "b") else a for a in args]
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (done.stdout, done.stderr)
