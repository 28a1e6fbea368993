"""A saved preemption always requeues; a step that ends without saying how is a failure.

On a real SLURM cluster. Reproduced breaks:
* ``scancel --signal=USR1 <job>`` (to the job step, not the batch shell): the ranks saved and
  exited 75, srun (``--kill-on-bad-exit``) killed the slower ones and reported their signal,
  and the job ended FAILED without requeueing;
* srun exiting 0 without the trainer's FINISHED marker ended the job COMPLETED with nothing
  trained;
* a USR1 two seconds after the ranks started killed them (exit 138): the handler was
  installed only after seconds of imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from launcher_helpers import RECIPES, RESUMABLE, expected_loss, payload_job, requires_trainer

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.launcher.job import JobSpec
from megatron_s2.launcher.sbatch_script import render_sbatch_script
from megatron_s2.launcher.slurm import submit


def submit_job(job) -> str:
    job.dir.slurm_dir.mkdir(parents=True, exist_ok=True)
    job.dir.script.write_text(render_sbatch_script(job))
    return submit(job.dir.script)


def events(job) -> list[dict]:
    path = job.run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def batch_log(job, job_id: str) -> str:
    path = job.dir.slurm_dir / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_signal_to_the_job_step_requeues(slurm, tmp_path, mode):
    steps = 40
    job = payload_job(tmp_path / "run", RESUMABLE, "--steps", str(steps), "--step-time", "0.15", max_restarts=2,
                      mode=mode)
    job_id = submit_job(job)
    slurm.wait(job_id, lambda info: bool(events(job)), timeout=120)
    time.sleep(0.5)
    assert slurm.run(["scancel", "--signal=USR1", job_id]).returncode == 0  # the ranks, not the batch shell
    slurm.wait(job_id, lambda info: info.get("Restarts") == "1" and info["JobState"] == "PENDING", timeout=90)
    slurm.start_now(job_id)
    info = slurm.wait_done(job_id, timeout=180)
    log = batch_log(job, job_id)
    assert info["JobState"] == "COMPLETED", log
    assert "PREEMPTED" in log and "requeueing: restart 1" in log
    assert [e["restart"] for e in events(job)] == [0, 1]
    assert json.loads(job.dir.finished.read_text()) == {"step": steps, "loss": expected_loss(steps, job.world_size)}
    assert not (job.run_dir / "PREEMPTED").exists(), "the restart clears the marker before its step"


def test_step_exit_0_without_finished_is_a_failure(slurm, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = JobSpec(name="test-exit0", run_dir=run_dir, command=(sys.executable, "-c", "pass"), nodes=1,
                  nproc_per_node=1, gpus_per_node=0, launcher=LauncherConfig(max_restarts=0))
    job_id = submit_job(job)
    info = slurm.wait_done(job_id, timeout=120)
    log = batch_log(job, job_id)
    assert info["JobState"] == "FAILED", log
    assert "without FINISHED or PREEMPTED" in log


@requires_trainer
@pytest.mark.slow
def test_usr1_right_after_the_ranks_start_requeues(slurm, tmp_path):
    """The real trainer on 2 ranks; USR1 to the step while the ranks are still importing."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "SLURM_CONF": str(slurm.conf)}
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "launch", str(RECIPES / "tiny_4rank.yaml"),
                           "parallel.tp=1", "training.train_steps=2", "checkpoint.save_interval=0", "--slurm",
                           "--run-dir", str(run_dir), "--max-restarts", "2"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split()[-1]
    rank_log = run_dir / "logs" / "restart0" / "rank1.log"
    slurm.wait(job_id, lambda info: rank_log.exists(), timeout=120)
    time.sleep(2)
    assert slurm.run(["scancel", "--signal=USR1", job_id]).returncode == 0
    slurm.wait(job_id, lambda info: info.get("Restarts") == "1" and info["JobState"] == "PENDING", timeout=300)
    first = batch_log_text = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert "exited with code 138" not in first
    slurm.start_now(job_id)
    info = slurm.wait_done(job_id, timeout=600)
    batch_log_text = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", batch_log_text
    logs = "".join((run_dir / "logs" / "restart0" / f"rank{r}.log").read_text() for r in range(2))
    assert "Traceback" not in logs and "preemption requested" in logs
    assert json.loads((run_dir / "FINISHED").read_text())["step"] == 2
