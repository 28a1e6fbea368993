"""Local mode: one process per rank on this machine, failing fast and cleanly.

Each rank gets torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), its own session (so the whole process
tree of a rank can be signalled) and a log ``<run_dir>/logs/restart<N>/rank<r>.log``;
rank 0's output is also echoed to the console. The launcher then watches the ranks:

- a rank that exits non-zero (other than :data:`EXIT_PREEMPTED`) or dies by a signal fails
  the job at once: the other ranks get SIGTERM, then SIGKILL after ``terminate_grace_s``,
  and the launcher exits non-zero naming the rank, its exit code or signal and the tail
  of its log. Nothing waits on a collective that can never complete;
- SIGTERM / SIGUSR1 sent to the launcher are forwarded to every rank (their
  :class:`~megatron_s2.runtime.preemption.PreemptionGuard` saves and exits 75); Ctrl-C is
  forwarded as SIGTERM, a second Ctrl-C kills the ranks;
- ranks are started with ``PR_SET_PDEATHSIG``, so they die if the launcher is killed, and with
  the preemption signals blocked until their guard handles them (no window at start-up in
  which a forwarded signal kills a rank).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from megatron_s2.launcher.environment import rank_environment
from megatron_s2.launcher.job import JobSpec
from megatron_s2.config.launcher import PREEMPTION_SIGNALS
from megatron_s2.runtime.preemption import EXIT_PREEMPTED, signal_number

__all__ = ["LocalRun", "describe_exit", "free_port"]

_POLL_S = 0.05
_TAIL_LINES = 20


def free_port() -> int:
    """A TCP port free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by SIGKILL (signal 9)"; ``3`` -> "exit code 3"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    return f"exit code {returncode}"


def _tail(path: Path, lines: int = _TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as fh:
            return list(deque(fh, maxlen=lines))
    except OSError:
        return []


_HELD_SIGNALS = {signal_number(name) for name in PREEMPTION_SIGNALS}


def _rank_preexec() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Preemption signals stay pending (not fatal) until the rank's PreemptionGuard takes them:
    # the mask survives exec, and the guard unblocks what it handles.
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen
    log: Path
    echo_thread: threading.Thread | None = None
    returncode: int | None = field(default=None)


class LocalRun:
    """Run ``job`` on this machine; :meth:`run` returns the job's exit code."""

    def __init__(self, job: JobSpec, *, console: TextIO | None = None, env: dict[str, str] | None = None) -> None:
        if job.nodes != 1:
            raise ValueError("local mode runs on one machine: nodes must be 1")
        self.job = job
        self.console = console if console is not None else sys.stdout
        self.restart = job.dir.next_restart()
        self.log_dir = job.dir.restart_logs(self.restart)
        self._ranks: list[_Rank] = []
        self._pending: list[int] = []
        self._interrupts = 0
        self._extra_env = dict(env or {})

    # ---- start ---------------------------------------------------------------------------
    def _start_rank(self, rank: int, base_env: dict[str, str], port: int) -> _Rank:
        n = self.job.nproc_per_node
        env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if not self.job.gpus_per_node:  # CPU ranks: a visible GPU must not turn parallel.backend=auto into nccl
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = self.log_dir / f"rank{rank}.log"
        echo = rank == 0
        with open(log, "ab") as sink:
            process = subprocess.Popen(self.job.command, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE if echo else sink, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_rank_preexec)
        return _Rank(rank, process, log)

    def _echo(self, entry: _Rank) -> None:
        """Copy rank 0's output to its log and to the console, line by line."""
        with open(entry.log, "ab") as sink:
            for line in iter(entry.process.stdout.readline, b""):
                sink.write(line)
                sink.flush()
                try:
                    self.console.write(line.decode(errors="replace"))
                    self.console.flush()
                except (OSError, ValueError):
                    pass  # console gone: keep logging

    # ---- signals -------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            signum = signal.SIGKILL if self._interrupts > 1 else signal.SIGTERM
        self._pending.append(signum)

    def _signal_ranks(self, signum: int, ranks: list[_Rank]) -> None:
        for entry in ranks:
            if entry.process.poll() is None:
                try:
                    os.killpg(entry.process.pid, signum)
                except ProcessLookupError:
                    pass

    # ---- run -----------------------------------------------------------------------------
    def run(self) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base_env = {**rank_environment(self.job.launcher, os.environ, self.job.nproc_per_node), **self._extra_env}
        port = free_port()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._ranks = [self._start_rank(r, base_env, port) for r in range(self.job.nproc_per_node)]
            for entry in self._ranks:
                if entry.process.stdout is not None:
                    entry.echo_thread = threading.Thread(target=self._echo, args=(entry,), daemon=True)
                    entry.echo_thread.start()
            self._say(f"started {len(self._ranks)} ranks (restart {self.restart}); logs in {self.log_dir}")
            return self._watch()
        finally:
            self._signal_ranks(signal.SIGKILL, self._ranks)
            for entry in self._ranks:
                entry.process.wait()
                if entry.echo_thread is not None:
                    entry.echo_thread.join(timeout=5)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _watch(self) -> int:
        while True:
            while self._pending:
                signum = self._pending.pop(0)
                self._say(f"forwarding {signal.Signals(signum).name} to all ranks")
                self._signal_ranks(signum, self._ranks)
            running = False
            for entry in self._ranks:
                if entry.returncode is not None:
                    continue
                entry.returncode = entry.process.poll()
                if entry.returncode is None:
                    running = True
                elif entry.returncode not in (0, EXIT_PREEMPTED):
                    return self._fail(entry)
            if not running:
                return self._finish()
            time.sleep(_POLL_S)

    def _fail(self, failed: _Rank) -> int:
        others = [e for e in self._ranks if e is not failed and e.process.poll() is None]
        self._say(f"rank {failed.rank} (pid {failed.process.pid}) failed: {describe_exit(failed.returncode)}; "
                  f"stopping {len(others)} other ranks")
        self._signal_ranks(signal.SIGTERM, others)
        deadline = time.monotonic() + self.job.launcher.terminate_grace_s
        while any(e.process.poll() is None for e in others) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self._signal_ranks(signal.SIGKILL, others)
        if failed.echo_thread is not None:
            failed.echo_thread.join(timeout=5)
        tail = _tail(failed.log)
        lines = [f"job failed: rank {failed.rank} {describe_exit(failed.returncode)}",
                 f"last {len(tail)} lines of {failed.log}:"] + ["    " + line.rstrip("\n") for line in tail]
        print("\n".join(lines), file=sys.stderr, flush=True)
        return failed.returncode if failed.returncode > 0 else 128 - failed.returncode

    def _finish(self) -> int:
        codes = [e.returncode for e in self._ranks]
        if all(c == 0 for c in codes):
            self._say(f"all {len(codes)} ranks finished")
            return 0
        preempted = [e.rank for e in self._ranks if e.returncode == EXIT_PREEMPTED]
        self._say(f"ranks {preempted} stopped after saving a checkpoint (exit {EXIT_PREEMPTED}); "
                  "launch the same command again to resume")
        return EXIT_PREEMPTED

    def _say(self, message: str) -> None:
        print(f"[launch] {message}", file=sys.stderr, flush=True)
