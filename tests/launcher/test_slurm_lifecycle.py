"""Preemption lifecycle on a real SLURM cluster, with the stand-in trainer (payloads/resumable.py).

signal to the batch shell -> forwarded to every rank -> ranks agree, "checkpoint", exit 75 ->
the job requeues itself -> the restart resumes from the checkpoint -> FINISHED -> no requeue.
"""

from __future__ import annotations

import json

import pytest
from launcher_helpers import RESUMABLE, expected_loss, payload_job

from megatron_s2.runtime.preemption import EXIT_PREEMPTED
from megatron_s2.launcher.sbatch_script import render_sbatch_script
from megatron_s2.launcher.slurm import submit


def submit_job(job) -> str:
    job.dir.slurm_dir.mkdir(parents=True, exist_ok=True)
    job.dir.script.write_text(render_sbatch_script(job))
    return submit(job.dir.script)


def events(job) -> list[dict]:
    path = job.run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def preempt_and_finish(cluster, job, steps: int) -> dict:
    """Submit, signal once running, let the requeued job start at once, wait for the end."""
    job_id = submit_job(job)
    cluster.wait(job_id, lambda info: bool(events(job)), timeout=120)  # rank 0 is training
    assert cluster.run(["scancel", "--batch", "--signal=USR1", job_id]).returncode == 0
    cluster.wait(job_id, lambda info: info.get("Restarts") == "1" and info["JobState"] == "PENDING", timeout=90)
    cluster.start_now(job_id)  # a requeued job is otherwise held ~120 s (BeginTime)
    info = cluster.wait_done(job_id, timeout=180)
    batch_log = (job.dir.slurm_dir / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", batch_log
    started = events(job)
    assert [e["restart"] for e in started] == [0, 1], batch_log
    assert started[0]["step"] == 0 and 0 < started[1]["step"] < steps, "restart resumes from the checkpoint"
    assert "received SIGUSR1" in batch_log and "requeueing: restart 1" in batch_log
    assert json.loads(job.dir.finished.read_text()) == {"step": steps, "loss": expected_loss(steps, job.world_size)}
    return {"job_id": job_id, "batch_log": batch_log}


@pytest.mark.slow
def test_signal_requeue_resume_srun_mode(slurm, tmp_path):
    steps = 40
    job = payload_job(tmp_path / "run", RESUMABLE, "--steps", str(steps), "--step-time", "0.15", max_restarts=2)
    preempt_and_finish(slurm, job, steps)
    for restart in (0, 1):
        logs = sorted(p.name for p in job.dir.restart_logs(restart).iterdir())
        assert logs == ["rank0.log", "rank1.log"]
    stops = [line for r in range(2) for line in job.dir.restart_logs(0).joinpath(f"rank{r}.log").read_text()
             .splitlines() if "stopping at step" in line]
    assert len(stops) == 2 and stops[0].split(" on ")[0].split()[-1] == stops[1].split(" on ")[0].split()[-1]


@pytest.mark.slow
def test_signal_requeue_resume_torchrun_two_nodes(slurm2, tmp_path):
    steps = 40
    job = payload_job(tmp_path / "run", RESUMABLE, "--steps", str(steps), "--step-time", "0.15", nodes=2, nproc=1,
                      mode="torchrun")
    result = preempt_and_finish(slurm2, job, steps)
    assert sorted(p.name for p in job.dir.restart_logs(0).iterdir()) == ["node0.log", "node1.log"]
    assert "torchrun" in {e["source"] for e in events(job)}
    assert "exited with code" in result["batch_log"]


@pytest.mark.slow
def test_restart_limit_and_finished_marker(slurm, tmp_path):
    # max_restarts=0: a preempted job saves and stops for good (exit 75), no requeue
    job = payload_job(tmp_path / "limited", RESUMABLE, "--steps", "1000", "--step-time", "0.1", max_restarts=0)
    job_id = submit_job(job)
    slurm.wait(job_id, lambda info: bool(events(job)), timeout=120)
    slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
    info = slurm.wait_done(job_id, timeout=90)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == f"{EXIT_PREEMPTED}:0"
    assert info["Restarts"] == "0"
    assert "restart limit (0) is reached" in (job.dir.slurm_dir / f"job-{job_id}.out").read_text()
    assert (job.run_dir / "checkpoints" / "state.json").exists()
    # a run directory holding FINISHED never starts the ranks again
    done = payload_job(tmp_path / "done", RESUMABLE, "--steps", "3")
    done.dir.finished.write_text('{"step": 3, "loss": 1.0}')
    job_id = submit_job(done)
    info = slurm.wait_done(job_id, timeout=60)
    assert info["JobState"] == "COMPLETED" and events(done) == []
