"""One run per run directory: an exclusive lock held for the life of the run.

Two runs writing one run directory replace each other's checkpoints and interleave
``metrics.jsonl``. Before anything is written, the run (rank 0 of the trainer, or the local
launcher for the ranks it starts) takes ``<run_dir>/run.lock``:

* the file is created and locked with ``flock`` (released by the kernel when the holder
  exits, however it dies), then filled with the holder's host, pid, process start time,
  command and SLURM job; a clean exit deletes it;
* a second run finds the lock taken and refuses, naming the holder (exit code 2);
* a lock file whose ``flock`` is free was left by a process that is gone: it is taken over
  and the takeover explained (host, pid and start time of the dead holder);
* on file systems without ``flock`` (ENOSYS/ENOLCK, e.g. Lustre mounted without ``-o flock``)
  the file is created exclusively instead; its holder is alive when it is on this host with
  the recorded pid and process start time, and taken to be alive on another host (the
  message says how to remove the file if that run is gone);
* ranks started by ``megatron-s2 launch --local`` inherit the launcher's lock through
  :data:`LOCK_TOKEN_ENV` (a random token that only the holder's children see).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_s2.config.schema import ConfigError

__all__ = ["LOCK_FILE", "LOCK_TOKEN_ENV", "LockHolder", "RunDirLocked", "RunLock", "hold_run_dir"]

LOCK_FILE = "run.lock"
LOCK_TOKEN_ENV = "MEGATRON_S2_RUN_LOCK_TOKEN"
"""Set by the holder for the processes it starts; a rank whose token matches the lock's
holder runs under that lock instead of taking its own."""

_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP}


class RunDirLocked(ConfigError):
    """The run directory is in use by another run (exit code 2, like configuration errors)."""


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    started: str
    """Wall-clock start of the holder, ISO 8601."""
    proc_start: int
    """Start time of the holder process in clock ticks since boot (guards against pid reuse)."""
    command: str
    slurm_job: str
    token: str

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        return f"host {self.host}, pid {self.pid}, started {self.started}{job}: {self.command}"

    def alive_here(self) -> bool | None:
        """Whether the holder process still runs: True/False on its own host, None elsewhere."""
        if self.host != socket.gethostname():
            return None
        return _proc_start(self.pid) == self.proc_start

    @classmethod
    def current(cls, command: str) -> "LockHolder":
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   _proc_start(os.getpid()) or 0, command[:300], os.environ.get("SLURM_JOB_ID", ""),
                   secrets.token_hex(16))

    @classmethod
    def parse(cls, text: str) -> "LockHolder | None":
        try:
            raw = json.loads(text)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError):
            return None


def _proc_start(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime


class RunLock:
    """``with RunLock(run_dir).acquire(): ...`` — see the module docstring."""

    def __init__(self, run_dir: str | Path, log=print) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.log = log
        self.holder: LockHolder | None = None
        self.inherited = False
        self._fd: int | None = None
        self._created = False

    @property
    def token(self) -> str:
        return self.holder.token if self.holder else ""

    # ---- acquire -------------------------------------------------------------------------
    def acquire(self, command: str | None = None, inherited_token: str | None = None) -> "RunLock":
        """Take the lock or raise :class:`RunDirLocked` naming its holder (ConfigError for a
        run directory that cannot hold a lock: a file, not writable)."""
        command = command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"training.run_dir: {self.run_dir} exists and is not a directory; "
                              "choose another --run-dir") from None
        except OSError as exc:
            raise _unwritable(self.run_dir, exc) from None
        me = LockHolder.current(command)
        for _ in range(100):  # retried only when a releasing holder deleted the file under us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise _unwritable(self.run_dir, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = LockHolder.parse(_read(fd))
                os.close(fd)
                if inherited_token and holder is not None and holder.token == inherited_token:
                    self.holder, self.inherited = holder, True
                    return self
                raise self._locked(holder) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                return self._acquire_exclusive(me, inherited_token)
            if not _same_file(fd, self.path):
                os.close(fd)
                continue
            previous = _read(fd)
            if previous.strip():
                self._explain_stale(LockHolder.parse(previous))
            try:
                _write(fd, me)
            except OSError as exc:
                os.close(fd)
                raise _unwritable(self.run_dir, exc) from None
            self._fd, self.holder = fd, me
            return self
        raise ConfigError(f"training.run_dir: could not take {self.path} (it keeps being replaced)")

    def _acquire_exclusive(self, me: LockHolder, inherited_token: str | None) -> "RunLock":
        """Fallback without flock: O_EXCL creation, liveness from host + pid + start time."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                holder = LockHolder.parse(self.path.read_text(errors="replace"))
                if inherited_token and holder is not None and holder.token == inherited_token:
                    self.holder, self.inherited = holder, True
                    return self
                if holder is not None and holder.alive_here() is False:
                    self._explain_stale(holder)
                    self.path.unlink(missing_ok=True)
                    continue
                raise self._locked(holder, remote=holder is not None and holder.alive_here() is None) from None
            except OSError as exc:
                raise _unwritable(self.run_dir, exc) from None
            _write(fd, me)
            self._fd, self.holder = fd, me
            return self
        raise self._locked(LockHolder.parse(self.path.read_text(errors="replace")))

    def _locked(self, holder: LockHolder | None, remote: bool = False) -> RunDirLocked:
        who = holder.describe() if holder else "a process whose lock file is unreadable"
        hint = (f"; if no run is active there any more, delete {self.path}" if remote else
                "; wait for it to finish, stop it, or choose another --run-dir")
        return RunDirLocked(f"training.run_dir: {self.run_dir} is in use by another run ({who}){hint}")

    def _explain_stale(self, holder: LockHolder | None) -> None:
        who = holder.describe() if holder else "an unreadable holder"
        self.log(f"run lock: {self.path} was left by a run that is no longer running ({who}); taking it over")

    # ---- release -------------------------------------------------------------------------
    def release(self) -> None:
        """Delete the lock file (when it is still ours) and drop the lock; a run directory this
        lock created and nothing else filled (a run refused at start-up) goes too. Idempotent."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
        if self._created:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass  # the run wrote something: keep it

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- inspection ----------------------------------------------------------------------
    @staticmethod
    def active_holder(run_dir: str | Path) -> LockHolder | None:
        """The holder of ``run_dir``'s lock if a live process holds it (no side effects)."""
        path = Path(run_dir) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            holder = LockHolder.parse(_read(fd))
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return holder
            except OSError:  # no flock here: judge by the recorded process
                return holder if holder is not None and holder.alive_here() is not False else None
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    @classmethod
    def refuse_if_held(cls, run_dir: str | Path) -> None:
        """Raise :class:`RunDirLocked` when a live run holds ``run_dir`` (submit-time check)."""
        holder = cls.active_holder(run_dir)
        if holder is not None:
            raise cls(run_dir)._locked(holder, remote=holder.alive_here() is None)


def _unwritable(run_dir: Path, exc: OSError) -> ConfigError:
    if exc.errno == errno.ENOSPC:
        return ConfigError(f"training.run_dir: {run_dir}: disk full (no space left on device); free space or "
                           "choose another --run-dir")
    if exc.errno == errno.ENOTDIR:
        return ConfigError(f"training.run_dir: {run_dir} is not a directory (or lies under a file); "
                           "choose another --run-dir")
    return ConfigError(f"training.run_dir: {run_dir} is not writable ({exc.strerror or exc}); choose another "
                       "--run-dir or fix its permissions")


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _write(fd: int, holder: LockHolder) -> None:
    data = (json.dumps(asdict(holder), indent=1) + "\n").encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


@contextmanager
def hold_run_dir(run_dir: str | Path, rank: int, world_size: int, log=print):
    """Rank 0 takes the run directory's lock (or runs under its launcher's, via
    :data:`LOCK_TOKEN_ENV`) and every rank learns the outcome (one collective), so that a
    refused run stops on all ranks before anything is written. Released on exit."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(run_dir, log).acquire(inherited_token=os.environ.get(LOCK_TOKEN_ENV))
        except ConfigError as exc:
            error = exc
    if world_size > 1 and _any_rank(error is not None) and error is None:
        error = RunDirLocked(f"training.run_dir: {run_dir}: rank 0 could not take the run lock (its log says why)")
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        if lock is not None and not lock.inherited:
            lock.release()


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
