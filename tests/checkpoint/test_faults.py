"""kill -9 during a save never breaks ``latest``; corrupted shards are refused by name.

A base run commits steps 1 and 2. Each fault case copies it and starts a training job (a
subprocess: ``tests/checkpoint/fault_job.py``) that resumes from step 2 and is SIGKILLed by
``MEGATRON_S2_CKPT_FAULT`` while saving step 3: half-way through a shard file (one process,
and on rank 1 of a two-rank job), after the manifest but before the commit marker (in the
background thread of an asynchronous save), and after the commit but before ``latest``
moves. Afterwards ``latest`` still names step 2, the store resolves to it, and a new job
resumes from it and saves step 3 properly (the debris is cleaned up). The jobs run
concurrently.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    CheckpointStore,
)
from megatron_s2.checkpoint.faults import FAULT_ENV
from megatron_s2.config.schema import ConfigError
from tests.checkpoint.fault_job import job_overrides
from tests.checkpoint.runs import train, trainer

# every test reads the module's trained runs (spawned ranks): the whole module is slow
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "mid_shard": ("mid_shard", 1, []),
    "two_ranks_mid_shard_on_rank1": ("mid_shard@1", 2, []),
    "async_before_commit": ("before_commit", 1, ["checkpoint.async_save=true"]),
    "before_latest": ("before_latest", 1, []),
}


def _start_job(run: Path, steps: int, world: int, extra: list[str], fault: str) -> subprocess.Popen:
    env = dict(os.environ, **{FAULT_ENV: fault}, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "tests.checkpoint.fault_job", "--world", str(world), str(run),
                             str(steps), *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "base"
    train(0, 1, run, job_overrides(run, 2, []))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    return run


@pytest.fixture(scope="module")
def killed(base) -> dict[str, tuple[Path, int, str]]:
    jobs = {}
    for name, (fault, world, extra) in CASES.items():
        run = base.parent / name
        shutil.copytree(base, run)
        steps = 4 if extra else 3  # async: step 3's save is the background one, step 4 would wait for it
        jobs[name] = run, _start_job(run, steps, world, extra, fault)
    out = {}
    for name, (run, proc) in jobs.items():
        _, stderr = proc.communicate(timeout=600)
        out[name] = run, proc.returncode, stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kill_during_save_keeps_latest(killed, case):
    run, returncode, stderr = killed[case]
    fault, world, _ = CASES[case]
    if world == 1:
        assert returncode == -signal.SIGKILL, stderr[-3000:]
    else:  # rank 1 was killed; the launcher (mp.spawn) then stops rank 0 and fails
        assert returncode != 0 and "signal SIGKILL" in stderr, stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert CheckpointStore(root, log=lambda m: None).latest_valid() == root / "step_00000002"
    tmp, step3 = root / ".step_00000003.tmp", root / "step_00000003"
    if fault.startswith("mid_shard"):
        assert not step3.exists() and not (tmp / COMMIT).exists()
        assert list(tmp.glob("*.distcp")), "the kill must happen while a shard is on disk"
    elif fault == "before_commit":
        assert (tmp / MANIFEST).is_file() and not (tmp / COMMIT).exists() and not step3.exists()
    else:  # before_latest: step 3 is committed, but latest was never moved to it
        assert (step3 / COMMIT).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mid_shard", "before_latest"])
def test_resume_after_kill(killed, case):
    run, _, _ = killed[case]
    result = train(0, 1, run, job_overrides(run, 3, []))
    assert any("resumed from" in line and "step_00000002" in line for line in result["logs"])
    assert result["losses"] and result["final_step"] == 3
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert CheckpointStore(root).latest_valid() == root / "step_00000003"
    assert not list(root.glob(".step_*")), "debris of the killed save is removed"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_refused_and_train_falls_back(base):
    run = base.parent / "flipped"
    shutil.copytree(base, run)
    shard = run / "checkpoints" / "step_00000002" / "__0_0.distcp"
    _flip_byte(shard)
    with pytest.raises(CheckpointError, match=f"{shard}: checksum mismatch"):
        CheckpointManager(run / "checkpoints").load(shard.parent, torch.nn.Linear(2, 2))
    result = train(0, 1, run, job_overrides(run, 2, []))
    logs = "\n".join(result["logs"])
    assert "skipping step_00000002" in logs and "__0_0.distcp: checksum mismatch" in logs
    assert "'latest' points at step_00000002, which is not valid; using step_00000001 instead" in logs
    assert result["final_step"] == 2 and len(result["losses"]) == 1  # resumed from step 1


def test_no_valid_checkpoint_left_is_an_error(base):
    run = base.parent / "all_flipped"
    shutil.copytree(base, run)
    for step_dir in CheckpointStore(run / "checkpoints").committed():
        _flip_byte(step_dir / "__0_0.distcp")
    t = trainer(0, 1, run, job_overrides(run, 3, []))
    with pytest.raises(ConfigError, match="checkpoint: .*none is valid"):  # exit 2, one line
        t.restore()
