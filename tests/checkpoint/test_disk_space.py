"""A full disk while checkpointing: refused up front from an estimate of what DCP really writes,
a failed save leaves nothing behind, and leftovers of an interrupted save do not block the next
start.

Reproduced breaks: the free-space estimate counted tensor bytes only (5.5 MiB for the tiny
recipe's 6.4 MiB shard file), so a save on a nearly full disk started, hit ENOSPC and left its
``.step_N.tmp``; that directory then filled the disk, and the resumed run stopped on a "disk
full" message that did not mention it.

The full disks are real: a tmpfs mounted in a private mount namespace (``unshare -m``; skipped
where that is not allowed), with the saves in a subprocess. ENOSPC in the middle of a shard
(another writer filling the disk between the check and the save) is the fault point
``enospc_mid_shard`` of :mod:`megatron_s2.checkpoint.faults`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import CheckpointError, CheckpointManager
from megatron_s2.checkpoint.faults import FAULT_ENV
from megatron_s2.checkpoint.sharded_state import model_shards
from megatron_s2.checkpoint.space import chunk_sizes, save_size

REPO = Path(__file__).resolve().parents[2]
META = {"layout": "world=1", "config": {}, "model": "stand-in"}

# 600 small tensors: 0.3 MiB of values, about 1.3 MiB on disk (DCP's per-chunk records).
MODEL = "torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(300)))"
SAVER = f"""
import json, sys, torch
from megatron_s2.checkpoint import CheckpointError, CheckpointManager
root, steps = sys.argv[1], [int(s) for s in sys.argv[2:]]
notes = []
mgr = CheckpointManager(root, keep_last=3, log=notes.append)
torch.manual_seed(0)
model = {MODEL}
error = None
for step in steps:
    try:
        mgr.save(step, {{"model": model, "optimizer": None, "data": None, "rng": None}},
                 {META!r})
    except CheckpointError as exc:
        error = str(exc)
        break
print(json.dumps({{"error": error, "notes": notes}}))
"""


def _stand_in() -> torch.nn.Module:
    torch.manual_seed(0)
    return eval(MODEL)


def _mount_namespaces() -> bool:
    return (shutil.which("unshare") is not None and
            subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0)


needs_tmpfs = pytest.mark.skipif(not _mount_namespaces(), reason="needs `unshare -m` to mount a small tmpfs")


def _on_tmpfs(size: str, mount: Path, *runs: tuple[list[str], str]) -> list[subprocess.CompletedProcess]:
    """Each (argv, fault) run in turn on one tmpfs of ``size`` mounted at ``mount`` (in a private
    mount namespace that lives as long as the runs); their results, read back from files."""
    mount.mkdir(parents=True, exist_ok=True)
    results = mount.parent / f"{mount.name}.results"
    results.mkdir()
    lines = [f"mount -t tmpfs -o size={size} tmpfs {mount} || exit 97"]
    for i, (argv, fault) in enumerate(runs):
        env = f"{FAULT_ENV}={fault} " if fault else ""
        command = " ".join(f"'{a}'" for a in argv)
        lines.append(f"{env}{command} > {results}/{i}.out 2> {results}/{i}.err; echo $? > {results}/{i}.rc")
    clean_env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    subprocess.run(["unshare", "-m", "sh", "-c", "\n".join(lines)], cwd=REPO, env=clean_env,
                   check=True, timeout=900)
    return [subprocess.CompletedProcess(argv, int((results / f"{i}.rc").read_text()),
                                        (results / f"{i}.out").read_text(), (results / f"{i}.err").read_text())
            for i, (argv, _) in enumerate(runs)]


def _saver(root: Path, *steps: int) -> list[str]:
    script = root.parents[1] / "saver.py"  # beside the tmpfs, not on it
    script.write_text(SAVER)
    return [sys.executable, str(script), str(root), *map(str, steps)]


def test_estimate_covers_what_dcp_writes(tmp_path):
    model, mgr = _stand_in(), CheckpointManager(tmp_path, log=lambda m: None)
    estimate = save_size([chunk_sizes(model_shards(model))])
    path = mgr.save(1, {"model": model, "optimizer": None, "data": None, "rng": None}, META)
    written = sum(p.stat().st_size for p in path.iterdir())
    tensors = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert written > 3 * tensors, "the stand-in is dominated by DCP's per-chunk records"
    assert written <= estimate <= 1.25 * written, (estimate, written)


def test_replicated_chunks_are_counted_once():
    shards = model_shards(_stand_in())
    one = save_size([chunk_sizes(shards)])
    assert save_size([chunk_sizes(shards)] * 4) < one * 1.01, "four data-parallel replicas write one copy"
    assert save_size([chunk_sizes(shards)], previous=10 * one) == 10 * one


@needs_tmpfs
@pytest.mark.slow
def test_save_that_cannot_fit_is_refused_before_writing(tmp_path):
    """1 MiB free, 1.3 MiB to write (0.3 MiB of tensor values): refused up front, nothing left."""
    root = tmp_path / "disk" / "checkpoints"
    (run,) = _on_tmpfs("1m", tmp_path / "disk", (_saver(root, 1), ""))
    assert run.returncode == 0, run.stderr
    error = json.loads(run.stdout)["error"]
    assert error and "disk full" in error and "MiB needed" in error, error
    assert not root.exists() or not list(root.iterdir()), "a refused save writes nothing"


def test_enospc_during_a_save_leaves_no_partial_directory(tmp_path, monkeypatch):
    mgr, model = CheckpointManager(tmp_path, log=lambda m: None), _stand_in()
    state = {"model": model, "optimizer": None, "data": None, "rng": None}
    mgr.save(1, state, META)
    monkeypatch.setenv(FAULT_ENV, "enospc_mid_shard")
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 not written: disk full.*step_00000001"):
        mgr.save(2, state, META)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


@needs_tmpfs
@pytest.mark.slow
def test_leftover_of_a_killed_save_is_removed_and_named(tmp_path):
    """Step 2's save is killed after its shards were written: its 1.3 MiB ``.step_2.tmp`` stays.
    On a 3 MiB disk that already holds step 1, the restarted save of step 2 only fits once the
    leftover is gone: it is removed (and said so) instead of refusing a "full" disk."""
    root = tmp_path / "disk" / "checkpoints"
    first, killed, again = _on_tmpfs("3m", tmp_path / "disk", (_saver(root, 1), ""),
                                     (_saver(root, 2), "before_commit"), (_saver(root, 2), ""))
    assert first.returncode == 0 and json.loads(first.stdout)["error"] is None, first.stdout + first.stderr
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr
    result = json.loads(again.stdout)
    assert result["error"] is None, result
    assert any(".step_00000002.tmp" in note and "removed" in note for note in result["notes"]), result["notes"]
