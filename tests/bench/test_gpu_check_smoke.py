"""``tools/gpu_check.sh --smoke``: every part of the prepared GPU check runs on CPU (tiny shapes,
Triton under the interpreter) through the same script, orchestrator and per-part processes as on
the GPU, so the check cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ["env", "kernel_parity", "kernel_bench", "train_parity", "main_recipe", "layer_mfu", "decode"]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_part(tmp_path):
    pytest.importorskip("triton", reason="the kernel parts need Triton (pip install -e .[dev])")
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--smoke", str(out)], capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "PYTHON": sys.executable})
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {name: p.get("error") or [c for c in p["checks"] if not c["ok"]]
              for name, p in report["parts"].items() if p["status"] != "ok"}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    assert list(report["parts"]) == PARTS
    assert all(report["parts"][name]["checks"] for name in PARTS)
    summary = (out / "gpu_check.md").read_text()
    assert "all checks passed" in summary and "| decode | ok |" in summary
    # the figures the GPU run reports exist in the smoke run too
    assert set(report["parts"]["layer_mfu"]["figures"]) >= {"bf16", "fp8_experts"}
    assert {"engram_gather_fp8", "sparse_attention_fwd"} <= set(report["parts"]["kernel_bench"]["figures"])
    assert report["parts"]["main_recipe"]["figures"]["losses"]
