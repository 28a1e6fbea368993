"""Disaggregated RL (``rl.mode: disaggregated``, issue 25) submitted by ``megatron-s2 launch --slurm``
to a real SLURM cluster as one heterogeneous job: component 0 the trainer (one rank), component 1
one inference server, component 2 the orchestrator, each on its own emulated node (n1..n3; the
components of a heterogeneous job never share a node under SLURM 22.05's backfill scheduler).

The RL phase starts from a 4-step SFT checkpoint of ``recipes/phases/sft_addition.yaml``; the RL
batch is one group of 8 samples, so two steps with held-out evaluation through the server (before
and after) take ~25 s on the 2-core test machine. A server killed -9 mid-run is started again as a
new step on its node and the run completes; one whose restarts never serve is given up after 3 in a
row: the batch script writes ``ORCHESTRATOR_FAILED`` and the trainer, waiting for its next batch,
stops with that reason, and the job FAILS."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_helpers import requires_trainer

from megatron_s2.launcher.local import free_port

PHASES = Path(__file__).resolve().parents[2] / "recipes" / "phases"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false"]
RL = ["rl.mode=disaggregated", "rl.disaggregated.num_servers=1", "rl.rollout.max_staleness=1",
      "training.global_batch_size=8", "training.micro_batch_size=4", "rl.rollout.group_size=8",
      "rl.rollout.batch_groups=1", "rl.rollout.max_in_flight=8", "rl.advantage.dynamic_sampling=false", *QUIET]
pytestmark = [requires_trainer, pytest.mark.slow]


def _env(slurm) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(slurm.conf), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hetjob") / "sft"
    result = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "train", str(PHASES / "sft_addition.yaml"),
                             "training.train_steps=4", "checkpoint.save_interval=4", *QUIET, "--run-dir", str(run)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run / "checkpoints"


def _submit(slurm, run_dir: Path, *overrides: str) -> str:
    result = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "launch", str(PHASES / "rl_addition.yaml"),
                             *RL, *overrides, "--slurm", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=120, env=_env(slurm))
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[-1]


def _components(slurm, job_id: str) -> dict[int, dict[str, str]]:
    """HetJobOffset -> ``scontrol show job`` fields of each component of a heterogeneous job."""
    out = slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    return {int(info["HetJobOffset"]): info for info in (dict(re.findall(r"(\w+)=(\S*)", line))
                                                        for line in out.splitlines() if line.strip())}


def _role_processes(run_dir: Path, checkpoint: Path) -> list[int]:
    """This job's processes still alive: the trainer, the orchestrator (their argv holds the run
    directory) and the server (its argv holds the SFT checkpoint), srun included."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.decode(errors="replace") in (str(run_dir), str(checkpoint)) for a in argv):
            found.append(int(entry.name))
    return found


def _assert_nothing_left(slurm, run_dir: Path, checkpoint: Path) -> None:
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""
    deadline = time.monotonic() + 10
    while _role_processes(run_dir, checkpoint) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _role_processes(run_dir, checkpoint) == []


def test_disaggregated_rl_runs_as_one_heterogeneous_job(slurm3, sft, tmp_path):
    run_dir = tmp_path / "rl"
    port = free_port()
    job_id = _submit(slurm3, run_dir, "training.train_steps=2", f"rl.disaggregated.server_port={port}",
                     "rl.eval.interval=2", "rl.eval.at_start=true", "rl.eval.num_prompts=4", f"checkpoint.load={sft}")
    info = slurm3.wait_done(job_id, timeout=600)
    batch_log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    logs = run_dir / "logs" / "restart0"
    assert info["JobState"] == "COMPLETED", batch_log
    components = _components(slurm3, job_id)
    assert sorted(components) == [0, 1, 2] and {c["JobState"] for c in components.values()} == {"COMPLETED"}
    assert len({c["NodeList"] for c in components.values()}) == 3, components   # one node each
    # the servers' URL reached the orchestrator by the node's address (the emulated nodes do not resolve)
    assert f"inference servers (component 1): http://127.0.0.1:{port}" in batch_log
    assert f"listening on http://0.0.0.0:{port}" in (logs / "server0.log").read_text()
    assert "wrote batches 0..1" in (logs / "orchestrator.log").read_text()
    assert "the orchestrator exited 0" in batch_log and "run complete" in batch_log
    assert "stopping the role steps still running" in batch_log   # the server, stopped by SIGTERM
    assert json.loads((run_dir / "FINISHED").read_text())["step"] == 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert all(m["rollout_episodes"] == 8 for m in metrics if "loss" in m)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval_prompts"] == 4 for e in evals), evals
    _assert_nothing_left(slurm3, run_dir, sft)


def _server_pid(checkpoint: Path) -> int:
    """The inference server itself (not srun, which carries the same argv)."""
    for pid in _role_processes(Path("/nonexistent"), checkpoint):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[0] == sys.executable.encode() and b"serve" in argv:
            return pid
    raise AssertionError("no inference server process")


def _batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"job-{job_id}.out").read_text()


def _after_first_step(slurm, run_dir: Path, job_id: str) -> None:
    metrics = run_dir / "metrics.jsonl"
    slurm.wait(job_id, lambda info: metrics.exists() and metrics.read_text().count("\n") >= 1, timeout=600)


def test_a_server_that_dies_is_restarted_and_the_run_goes_on(slurm3, sft, tmp_path):
    """Issue 25's elasticity on SLURM: the server killed -9 after the first step is started again
    as a new step on its node, the orchestrator loads the current weights into it, and the run
    completes with every step trained once."""
    run_dir = tmp_path / "rl"
    job_id = _submit(slurm3, run_dir, "training.train_steps=5", f"rl.disaggregated.server_port={free_port()}",
                     "rl.eval.interval=0", "rl.eval.at_start=false", f"checkpoint.load={sft}")
    _after_first_step(slurm3, run_dir, job_id)
    os.kill(_server_pid(sft), signal.SIGKILL)
    info = slurm3.wait_done(job_id, timeout=600)
    batch_log = _batch_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED", batch_log
    assert "inference server 0 (component 1) exited with code" in batch_log and "restarting it on n" in batch_log
    assert "inference server 0 is serving again" in batch_log, batch_log
    # the server's log is appended to across its restarts
    assert (run_dir / "logs" / "restart0" / "server0.log").read_text().count("listening on") == 2
    assert json.loads((run_dir / "FINISHED").read_text())["step"] == 5
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5]
    assert not (run_dir / "disaggregated" / "ORCHESTRATOR_FAILED").exists()
    _assert_nothing_left(slurm3, run_dir, sft)


def test_a_server_that_cannot_come_back_ends_the_whole_job(slurm3, sft, tmp_path):
    """A server whose restarts never serve (here its port is taken, so each one exits at once) is
    given up after 3 restarts in a row: the job FAILS within a bounded time with that reason, which
    the trainer, waiting for its next batch, stops on."""
    run_dir = tmp_path / "rl"
    port = free_port()
    job_id = _submit(slurm3, run_dir, "training.train_steps=30", f"rl.disaggregated.server_port={port}",
                     "rl.eval.interval=0", "rl.eval.at_start=false", f"checkpoint.load={sft}")
    _after_first_step(slurm3, run_dir, job_id)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.kill(_server_pid(sft), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:   # the port frees as soon as the killed server's socket is gone
            try:
                squatter.bind(("0.0.0.0", port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        squatter.listen()
        killed = time.monotonic()
        info = slurm3.wait_done(job_id, timeout=300)
        assert time.monotonic() - killed < 240, "the job must end within a bounded time"
    batch_log = _batch_log(run_dir, job_id)
    assert info["JobState"] == "FAILED", batch_log
    assert batch_log.count("restarting it on n") == 3, batch_log
    assert "in use" in (run_dir / "logs" / "restart0" / "server0.log").read_text()
    reason = "inference server 0 (component 1) exited with code 2 after 3 restarts that never served"
    assert reason in batch_log, batch_log
    assert reason in (run_dir / "logs" / "restart0" / "rank0.log").read_text()   # the trainer stopped on it
    assert "requeueing" not in batch_log
    assert not (run_dir / "FINISHED").exists()
    _assert_nothing_left(slurm3, run_dir, sft)


def test_a_preempted_heterogeneous_job_requeues_whole_and_resumes(slurm3, sft, tmp_path):
    """SIGUSR1 to the batch shell (as ``--signal=B:USR1@N`` before the time limit): the trainer saves
    and exits 75, the role steps are stopped, the whole job is requeued; the next attempt starts new
    servers and the orchestrator, which continues after its last batch; every step is trained once.
    (Was: ``wait -n -p`` leaves its variable unset when a trapped signal interrupts it, and the
    script's ``set -u`` ended the job FAILED.)"""
    run_dir = tmp_path / "rl"
    job_id = _submit(slurm3, run_dir, "training.train_steps=12", "checkpoint.save_interval=4",
                     f"rl.disaggregated.server_port={free_port()}", "rl.eval.interval=0", "rl.eval.at_start=false",
                     f"checkpoint.load={sft}")
    metrics = run_dir / "metrics.jsonl"
    slurm3.wait(job_id, lambda info: metrics.exists() and metrics.read_text().count("\n") >= 3, timeout=600)
    slurm3.run(["scancel", "--batch", "--signal=USR1", job_id])
    slurm3.wait(job_id, lambda info: info.get("Restarts") == "1" and info["JobState"] == "PENDING", timeout=180)
    slurm3.start_now(job_id)
    info = slurm3.wait_done(job_id, timeout=600)
    batch_log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", batch_log
    assert "requeueing: restart 1" in batch_log and "unbound variable" not in batch_log, batch_log
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 13)), steps
    assert "wrote batches" in (run_dir / "logs" / "restart1" / "orchestrator.log").read_text()
    _assert_nothing_left(slurm3, run_dir, sft)
