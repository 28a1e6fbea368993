"""Local mode: per-rank logs, fail-fast when a rank dies, preemption agreed by all ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_helpers import PAYLOADS, RESUMABLE, expected_loss

from megatron_s2.runtime.peer_loss import PEER_LOST_NOTE
from megatron_s2.runtime.preemption import EXIT_PREEMPTED

DRIVER = PAYLOADS / "local_driver.py"


def start(run_dir: Path, nproc: int, *payload_args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(DRIVER), str(run_dir), str(nproc), sys.executable, str(RESUMABLE),
                             str(run_dir), *payload_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def rank_pid(log: Path) -> int | None:
    match = re.search(r"pid (\d+)", log.read_text()) if log.exists() else None
    return int(match.group(1)) if match else None


def test_ranks_run_with_logs_and_rank0_echo(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, 2, "--steps", "4", "--step-time", "0.05")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    logs = run_dir / "logs" / "restart0"
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    assert "rank 1/2" in (logs / "rank1.log").read_text()
    assert "rank 0/2" in out and "rank 1/2" not in out, "only rank 0 is echoed to the console"
    assert json.loads((run_dir / "FINISHED").read_text()) == {"step": 4, "loss": expected_loss(4, 2)}


def failure_line(out: str, err: str) -> str:
    """The launcher's one line about a failed job; nothing else on the console but its progress
    lines and rank 0's output from before the failure (no survivor's traceback)."""
    assert "Traceback" not in out + err, out + err
    assert PEER_LOST_NOTE not in out + err, "a survivor's note stays in its log"
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[launch] started")]
    assert len(lines) == 1 and lines[0].startswith("[launch] job failed: "), err
    return lines[0]


def test_killed_rank_fails_the_job_fast_and_is_named(tmp_path):
    """kill -9 of one rank: the launcher exited 137 and echoed the survivor's gloo traceback
    (rank 0's console) plus 20 lines of the dead rank's log. Now: exit 1, one line naming the
    dead rank, how it died, its log and that log's last line; the other rank stopped."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, 2, "--steps", "1000", "--step-time", "0.1", "--die-rank", "1", "--die-at-step", "3")
    log = run_dir / "logs" / "restart0" / "rank1.log"
    wait_for(lambda: log.exists() and "killing myself" in log.read_text(), 120, "rank 1 to die")
    died = time.monotonic()
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - died
    assert elapsed < 15, f"the job took {elapsed:.1f} s to fail after rank 1 died"
    assert proc.returncode == 1, err
    line = failure_line(out, err)
    assert "rank 1 " in line and "SIGKILL" in line and str(log) in line and "killing myself at step 3" in line
    survivor = rank_pid(run_dir / "logs" / "restart0" / "rank0.log")
    assert survivor is not None and not Path(f"/proc/{survivor}").exists(), "rank 0 was left running"
    assert PEER_LOST_NOTE in (run_dir / "logs" / "restart0" / "rank0.log").read_text()


@pytest.mark.slow
def test_the_failed_rank_is_named_not_the_peers_it_took_down(tmp_path):
    """Rank 1 raises; rank 0, waiting for it in an all-reduce, loses its peer and exits with
    EXIT_PEER_LOST a moment later. Whichever exit the launcher sees first, it names rank 1 and
    its error, not the peer it took down."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, 2, "--steps", "1000", "--step-time", "0.1", "--fail-rank", "1", "--fail-at-step", "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    line = failure_line(out, err)
    assert "rank 1 " in line and "exit code 1" in line and "simulated failure at step 3" in line, line
    assert "Traceback" in (run_dir / "logs" / "restart0" / "rank1.log").read_text(), "the log keeps the details"


@pytest.mark.slow
def test_signal_to_one_rank_stops_all_at_the_same_step_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    steps = 40
    proc = start(run_dir, 2, "--steps", str(steps), "--step-time", "0.1")
    rank1_log = run_dir / "logs" / "restart0" / "rank1.log"
    wait_for(lambda: "step 3 " in (rank1_log.read_text() if rank1_log.exists() else ""), 120, "step 3")
    pid = rank_pid(rank1_log)
    assert pid is not None, "rank 1 did not log its pid"
    os.kill(pid, signal.SIGUSR1)  # only rank 1 hears it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    stops = [re.search(r"stopping at step (\d+)", (run_dir / "logs" / "restart0" / f"rank{r}.log").read_text())
             for r in range(2)]
    assert all(stops) and stops[0].group(1) == stops[1].group(1), "ranks must agree on the stop step"
    saved = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert saved["step"] == int(stops[0].group(1)) < steps
    # relaunching the same command resumes (restart1 logs) and ends where an uninterrupted run would
    proc = start(run_dir, 2, "--steps", str(steps), "--step-time", "0.01")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"from step {saved['step']}" in (run_dir / "logs" / "restart1" / "rank0.log").read_text()
    assert json.loads((run_dir / "FINISHED").read_text()) == {"step": steps, "loss": expected_loss(steps, 2)}


@pytest.mark.slow
def test_sigterm_to_the_launcher_is_forwarded(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, 2, "--steps", "1000", "--step-time", "0.1")
    log = run_dir / "logs" / "restart0" / "rank0.log"
    wait_for(lambda: "step 2 " in (log.read_text() if log.exists() else ""), 120, "step 2")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "forwarding SIGTERM" in err
    assert "on SIGTERM" in log.read_text()



def test_peer_loss_is_told_from_other_errors():
    """What the backends raise when a peer is gone (also wrapped, as the checkpoint layer does);
    a broken pipe or reset connection of the process's own sockets (OSError) is not a peer."""
    from megatron_s2.runtime.peer_loss import lost_peer

    gloo = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1215. This is "
                        "typically caused by a remote worker crashing.")
    assert lost_peer(gloo) == (f"{PEER_LOST_NOTE} in a collective (gloo: Connection closed by peer "
                               "[127.0.0.1]:1215); stopping")
    try:
        try:
            raise RuntimeError("NCCL error: remote process exited or there was a network error")
        except RuntimeError as exc:
            raise ValueError("checkpoint step 4 not written") from exc
    except ValueError as wrapped:
        assert "nccl" in lost_peer(wrapped)
    assert lost_peer(BrokenPipeError(32, "Broken pipe")) is None
    assert lost_peer(ConnectionResetError(104, "Connection reset by peer")) is None
    assert lost_peer(RuntimeError("CUDA out of memory")) is None
