"""Rotation that a crash cannot turn into a "failed checkpoint", and values `verify` checks.

Reproduced breaks:
* kill -9 while ``keep_last`` rotation deleted an old checkpoint left a committed-looking,
  half-deleted ``step_*`` directory, and ``checkpoint verify`` exited 1 although resume was fine;
* a checkpoint full of NaN passed ``checkpoint verify``.

The checkpoints are written by the real :class:`CheckpointManager` from a small stand-in model in
a subprocess (so that the injected SIGKILL does not hit the test process).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import CheckpointManager, CheckpointStore
from megatron_s2.checkpoint.dcp_io import GlobalShard, save_shards
from megatron_s2.checkpoint.faults import FAULT_ENV
from megatron_s2.checkpoint.format import DCP_METADATA, Manifest, sha256_file
from megatron_s2.cli import main

REPO = Path(__file__).resolve().parents[2]
SAVER = """
import sys, torch
from megatron_s2.checkpoint import CheckpointManager
root, keep, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mgr = CheckpointManager(root, keep_last=keep, log=lambda m: None)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
for step in range(first, last + 1):
    mgr.save(step, {"model": model, "optimizer": None, "data": None, "rng": None},
             {"layout": "world=1", "config": {}, "model": "stand-in"})
"""


def _save(root: Path, keep: int, first: int, last: int, fault: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-c", SAVER, str(root), str(keep), str(first), str(last)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_crash_during_rotation_leaves_garbage_not_a_failed_checkpoint(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    assert _save(root, 3, 1, 2).returncode == 0
    killed = _save(root, 1, 3, 3, fault="mid_rotation")  # commits step 3, dies deleting step 1
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    store = CheckpointStore(root, log=lambda m: None)
    assert store.latest_valid() == root / "step_00000003"
    assert main(["checkpoint", "verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "garbage" in out
    for step_dir in store.step_dirs():  # nothing under a step name is half deleted
        assert main(["checkpoint", "verify", str(step_dir)]) == 0 or not (step_dir / "COMMITTED").exists()
    capsys.readouterr()
    assert _save(root, 1, 4, 4).returncode == 0  # the next save removes the leftovers
    assert [p.name for p in store.step_dirs()] == ["step_00000004"]
    assert not list(root.glob(".step_*"))


def _commit_raw(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> Path:
    """A committed checkpoint written without the manager's checks (as an older build did)."""
    store = CheckpointStore(root, keep_last=10)
    tmp = store.prepare(step)
    save_shards({k: GlobalShard(v, tuple(v.shape), (0,) * v.dim()) for k, v in tensors.items()}, tmp, None, 0)
    manifest = Manifest(step=step, world_size=1, layout="world=1", config={})
    manifest.files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in tmp.iterdir()}
    assert DCP_METADATA in manifest.files
    return store.commit(step, manifest)


def test_verify_reports_non_finite_values(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    good = _commit_raw(root, 1, {"model/w": torch.ones(4, 4), "model/b": torch.zeros(4)})
    bad_w = torch.ones(4, 4)
    bad_w[2, 1] = math.nan
    bad = _commit_raw(root, 2, {"model/w": bad_w, "model/b": torch.zeros(4)})
    assert main(["checkpoint", "verify", str(good)]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {bad}: tensor 'model/w' holds NaN or infinite values" in out
    assert main(["checkpoint", "verify", str(root)]) == 1  # the directory: names the bad step
    assert "model/w" in capsys.readouterr().out
    assert main(["checkpoint", "verify", "--checksums-only", str(bad)]) == 0  # the bytes are intact


def test_manager_refuses_to_commit_nan(tmp_path):
    model = torch.nn.Linear(3, 3)
    mgr = CheckpointManager(tmp_path / "checkpoints", log=lambda m: None)
    mgr.save(1, {"model": model, "optimizer": None, "data": None, "rng": None}, {"layout": "l", "config": {}})
    with torch.no_grad():
        model.bias[1] = -math.inf
    try:
        mgr.save(2, {"model": model, "optimizer": None, "data": None, "rng": None}, {"layout": "l", "config": {}})
    except Exception as exc:
        assert "checkpoint step 2 not written: 'model/bias' holds NaN or infinite values" in str(exc)
    else:
        raise AssertionError("a non-finite checkpoint was committed")
    assert [p.name for p in CheckpointStore(tmp_path / "checkpoints").step_dirs()] == ["step_00000001"]
