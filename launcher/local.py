"""Local mode: one process per rank on this machine, failing fast and cleanly.

Each rank gets torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1``, a ``MASTER_PORT`` the launcher already listens on — the socket is
handed to rank 0, which serves the rendezvous store on it (:data:`STORE_FD_ENV`), so no other
process can take the port between its choice and rank 0's start), its own session (so the whole process
tree of a rank can be signalled) and a log ``<run_dir>/logs/restart<N>/rank<r>.log``;
rank 0's output is also echoed to the console, each line after a short hold
(:data:`_ECHO_HOLD_S`). The launcher then watches the ranks:

- a rank that exits non-zero (other than :data:`EXIT_PREEMPTED`) or dies by a signal fails
  the job at once: the launcher prints one line — the rank, its exit code or signal, its log
  and that log's last line — the other ranks get SIGTERM, then SIGKILL after
  ``terminate_grace_s``, and the launcher exits 1. Nothing waits on a collective that can
  never complete. The survivors' reactions stay out of the console: rank 0's lines still on
  hold are dropped (they are in its log), and so is everything after its line saying it lost
  a peer (:mod:`megatron_s2.runtime.peer_loss`); a rank that exits ``EXIT_PEER_LOST`` (its
  collective failed because a peer is gone) is never named while the rank that went first can be;
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
from megatron_s2.runtime.peer_loss import EXIT_PEER_LOST, PEER_LOST_NOTE
from megatron_s2.runtime.preemption import EXIT_PREEMPTED, signal_number
from megatron_s2.runtime.store_fd import STORE_FD_ENV

__all__ = ["EXIT_RANK_FAILED", "LocalRun", "describe_exit", "free_port", "listening_socket"]

EXIT_RANK_FAILED = 1
"""The launcher's exit code when a rank failed (the rank's own code is in the failure line)."""

_POLL_S = 0.05
_ECHO_HOLD_S = 0.5
"""How long a line of rank 0 waits before it is echoed: a rank killed by a signal is seen
within one poll, while the survivors' tracebacks arrive later than that."""


def free_port() -> int:
    """A TCP port free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_socket() -> socket.socket:
    """A TCP socket already listening on a port the OS picked (127.0.0.1), for rank 0's store.

    Choosing a free port and letting rank 0 bind it later races every other process on the
    machine (two local jobs, a test suite under xdist: EADDRINUSE); a socket that is listening
    from the start, inherited by rank 0, cannot be taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by SIGKILL (signal 9)"; ``3`` -> "exit code 3"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    if returncode == EXIT_PEER_LOST:
        return f"exit code {returncode} (lost contact with another rank)"
    return f"exit code {returncode}"


def _last_line(path: Path) -> str | None:
    """The last non-blank line of a log (None when it is empty or unreadable)."""
    try:
        with open(path, errors="replace") as fh:
            lines = deque((line.strip() for line in fh if line.strip()), maxlen=1)
    except OSError:
        return None
    return lines[0][:300] if lines else None


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
        self._held: deque[tuple[float, str]] = deque()  # rank 0's lines not yet echoed
        self._held_lock = threading.Lock()
        self._failed = False

    # ---- start ---------------------------------------------------------------------------
    def _start_rank(self, rank: int, base_env: dict[str, str], store: socket.socket) -> _Rank:
        n = self.job.nproc_per_node
        env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.getsockname()[1]))
        pass_fds = ()
        if rank == 0:  # rank 0 serves the rendezvous store on the socket the launcher holds
            env[STORE_FD_ENV] = str(store.fileno())
            pass_fds = (store.fileno(),)
        if not self.job.gpus_per_node:  # CPU ranks: a visible GPU must not turn parallel.backend=auto into nccl
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = self.log_dir / f"rank{rank}.log"
        echo = rank == 0
        with open(log, "ab") as sink:
            process = subprocess.Popen(self.job.command, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE if echo else sink, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_rank_preexec, pass_fds=pass_fds)
        return _Rank(rank, process, log)

    def _echo(self, entry: _Rank) -> None:
        """Copy rank 0's output to its log at once and, after a hold, to the console (the
        watcher releases held lines; a failed job drops them)."""
        with open(entry.log, "ab") as sink:
            for line in iter(entry.process.stdout.readline, b""):
                sink.write(line)
                sink.flush()
                text = line.decode(errors="replace")
                with self._held_lock:
                    if PEER_LOST_NOTE in text:  # rank 0 lost a peer: the job is failing from here on
                        self._failed = True
                        self._held.clear()
                    if not self._failed:
                        self._held.append((time.monotonic(), text))

    def _release_console(self, hold_s: float = _ECHO_HOLD_S) -> None:
        """Echo the held lines older than ``hold_s`` (all of them with 0)."""
        now = time.monotonic()
        with self._held_lock:
            lines = []
            while self._held and now - self._held[0][0] >= hold_s:
                lines.append(self._held.popleft()[1])
        if lines:
            try:
                self.console.write("".join(lines))
                self.console.flush()
            except (OSError, ValueError):
                pass  # console gone: the log has it all

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
        store = listening_socket()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            try:
                self._ranks = [self._start_rank(r, base_env, store) for r in range(self.job.nproc_per_node)]
            finally:
                store.close()  # rank 0 holds it now
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
            failed = self._poll()
            if failed:
                return self._fail(self._culprit(failed))
            if all(e.returncode is not None for e in self._ranks):
                return self._finish()
            self._release_console()
            time.sleep(_POLL_S)

    def _poll(self) -> list[_Rank]:
        """Ranks that have failed so far (exited non-zero, not preempted, or killed)."""
        for entry in self._ranks:
            if entry.returncode is None:
                entry.returncode = entry.process.poll()
        return [e for e in self._ranks if e.returncode is not None and e.returncode not in (0, EXIT_PREEMPTED)]

    def _culprit(self, failed: list[_Rank]) -> _Rank:
        """The rank whose failure took the others down: one that did not merely lose a peer,
        killed by a signal before one that exited, lowest rank first. When only lost peers are
        seen yet, the rank that caused it is waited for (up to ``terminate_grace_s``: a rank
        that raised may take seconds to exit after its connections closed)."""
        deadline = time.monotonic() + self.job.launcher.terminate_grace_s
        while (all(e.returncode == EXIT_PEER_LOST for e in failed) and time.monotonic() < deadline
               and any(e.returncode is None for e in self._ranks)):
            time.sleep(_POLL_S)
            failed = self._poll()
        return min(failed, key=lambda e: (e.returncode == EXIT_PEER_LOST, e.returncode >= 0, e.rank))

    def _fail(self, failed: _Rank) -> int:
        with self._held_lock:  # the survivors' reactions to the failure stay in their logs
            self._failed = True
            self._held.clear()
        others = [e for e in self._ranks if e is not failed and e.process.poll() is None]
        if failed.echo_thread is not None:
            failed.echo_thread.join(timeout=5)  # its last words reach its log
        last = _last_line(failed.log)
        stopping = f"stopping the other {len(others)} rank{'s' if len(others) != 1 else ''}; " if others else ""
        self._say(f"job failed: rank {failed.rank} (pid {failed.process.pid}) {describe_exit(failed.returncode)}; "
                  f"{stopping}its log {failed.log} " + (f"ends: {last}" if last else "is empty"))
        self._signal_ranks(signal.SIGTERM, others)
        deadline = time.monotonic() + self.job.launcher.terminate_grace_s
        while any(e.process.poll() is None for e in others) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self._signal_ranks(signal.SIGKILL, others)
        return EXIT_RANK_FAILED

    def _finish(self) -> int:
        for entry in self._ranks:  # every rank has exited: its output ends soon
            if entry.echo_thread is not None:
                entry.echo_thread.join(timeout=5)
        self._release_console(hold_s=0)
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
