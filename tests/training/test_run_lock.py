"""One run per run directory: a second run refuses naming the holder; stale locks are explained.

Reproduced break: two `megatron-s2 train` on one run directory both ran, the second replacing
the first's checkpoints and interleaving metrics.jsonl.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_s2.cli import main
from megatron_s2.runtime.run_lock import LOCK_FILE, RunDirLocked, RunLock

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32",
          "training.global_batch_size=4", "training.micro_batch_size=2", "data.num_documents=200",
          "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_interval=1"]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}: {proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_train_refuses_then_stale_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SINGLE,
                              "training.train_steps=100000", "--run-dir", str(run_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the lock (or, without one, the first run's metrics) shows the first run is under way
        _wait_for(lambda: (run_dir / LOCK_FILE).is_file() or (run_dir / "metrics.jsonl").is_file(),
                  300, "the first run to start", first)
        code = main(["train", str(RECIPE), *SINGLE, "training.train_steps=1", "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"pid {first.pid}" in err and f"host {socket.gethostname()}" in err and "in use by another run" in err
        assert len(err.strip().splitlines()) == 1
        assert not (run_dir / "checkpoints").exists(), "the refused run wrote a checkpoint"
        assert not (run_dir / "FINISHED").exists()
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: the file stays, the flock goes
        first.wait()
    assert (run_dir / LOCK_FILE).is_file()
    code = main(["train", str(RECIPE), *SINGLE, "training.train_steps=1", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert code == 0
    assert "no longer running" in out and f"pid {first.pid}" in out
    assert not (run_dir / LOCK_FILE).exists(), "released on exit"


def test_lock_in_one_process(tmp_path):
    logs = []
    with RunLock(tmp_path / "run", log=logs.append).acquire("first") as lock:
        holder = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "first"
        with pytest.raises(RunDirLocked, match=rf"in use by another run \(host .*pid {os.getpid()}.*: first\)"):
            RunLock(tmp_path / "run").acquire("second")
        assert RunLock.active_holder(tmp_path / "run").token == lock.token
        # a child started with the token runs under the holder's lock
        child = RunLock(tmp_path / "run").acquire("rank 0", inherited_token=lock.token)
        assert child.inherited and child.holder.pid == os.getpid()
        child.release()  # an inherited lock is not released by the child
        assert (tmp_path / "run" / LOCK_FILE).is_file()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert RunLock.active_holder(tmp_path / "run") is None and logs == []


def test_file_system_without_flock_falls_back_to_pid_liveness(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "started": "2026-01-01T00:00:00", "proc_start": 1,
             "command": "old run", "slurm_job": "", "token": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    logs = []
    lock = RunLock(tmp_path, log=logs.append).acquire("new")
    assert any("no longer running" in m and f"pid {dead.pid}" in m for m in logs)
    with pytest.raises(RunDirLocked, match="in use by another run"):
        RunLock(tmp_path).acquire("third")  # this process is alive and holds it
    lock.release()
    remote = dict(stale, host="elsewhere.invalid")
    (tmp_path / LOCK_FILE).write_text(json.dumps(remote))
    with pytest.raises(RunDirLocked, match=f"if no run is active there any more, delete {tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).acquire("fourth")
