"""Isolated sandboxes for agentic episodes (V4.1 report §5.1.3, in miniature; walkthrough Ch. 7).

An episode's tools run in a sandbox of their own: a private copy of the task workspace on a
size-limited tmpfs, no network, the system read-only, and per-command limits on CPU, memory,
wall time, processes and file size (:class:`~megatron_s2.config.posttrain.agentic.SandboxConfig`).
When a command ends — finished, timed out, or crashed — every process it left behind is killed;
when the sandbox closes, its whole pid namespace goes with it. A fork bomb, a full disk, an
infinite loop or a crashed sandbox therefore cost only that command or that episode (the report
treats "an agent crashes its environment" as a failed trajectory).

The interface is :class:`SandboxRuntime` (``open() -> Sandbox``), so a cluster can plug in
containers; here two runtimes implement it, both around the same in-sandbox command server
(:mod:`._sandbox_server`):

* :class:`BwrapRuntime` — bubblewrap: ``--unshare-all`` (user, pid, net, ipc, uts, cgroup
  namespaces), ``/usr`` read-only (the task data hidden if installed there), a private ``/tmp``
  and workspace on tmpfs, nothing else of the host visible;
* :class:`UnshareRuntime` — util-linux ``unshare`` (user, mount, pid, net, ipc, uts namespaces)
  when bwrap is absent: every host mount remounted read-only, private tmpfs workspace and
  ``/tmp``, the task data hidden, capabilities dropped before the server starts; the host file
  system stays visible (read-only).

:func:`detect_runtime` picks one at run time and says what to install when neither works.
Run as root, each open sandbox drops to an unprivileged uid of its own (``sandbox.uid + k``):
root is exempt from the process limit and from file permissions, and the limit counts processes
per uid, so sandboxes sharing one would starve each other. Memory is bounded per process
(RLIMIT_AS) and for the sandbox as a whole (the server's watch of resident memory): no cgroup is
needed, so this runs unprivileged inside an ordinary container.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import io
import json
import os
import resource
import select
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Protocol

from megatron_s2.config.posttrain.agentic import SandboxConfig

__all__ = ["CommandResult", "Sandbox", "SandboxRuntime", "SandboxCrashed", "SandboxUnavailable",
           "BwrapRuntime", "UnshareRuntime", "detect_runtime", "probe", "tar_directory"]

_SERVER = Path(__file__).with_name("_sandbox_server.py")
_REAPER = Path(__file__).with_name("_reaper.py")
# (both are handed to the interpreter as source, ``python3 -c``: the unprivileged sandbox uid may
# not be able to read the repository at all — a clone under /root)
_TASK_DATA = Path(__file__).with_name("tasks")
"""The embedded tasks' folder (references, canonical tests): hidden from ``unshare`` sandboxes."""
_HOST_GRACE_S = 5.0
"""Seconds the host waits beyond a command's own timeout before it declares the sandbox dead."""


class SandboxCrashed(RuntimeError):
    """The sandbox died or stopped answering (the agent killed its server, memory ran out, ...):
    the episode is lost, a failed trajectory — never a reason to stop training."""


class SandboxUnavailable(RuntimeError):
    """No isolation backend works on this machine."""


@dataclass
class CommandResult:
    """What one shell command did."""

    exit_code: int
    """Exit status; negative: killed by that signal (-9 SIGKILL, -24 SIGXCPU, -25 SIGXFSZ)."""
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    memory_exceeded: bool = False
    """The sandbox's processes together held more than ``sandbox.memory_mb`` resident: killed."""

    @property
    def status(self) -> str:
        """'ok', 'error' (non-zero exit), 'timeout', 'memory', or 'killed:<signal>' (a limit or a crash)."""
        if self.timed_out:
            return "timeout"
        if self.memory_exceeded:
            return "memory"
        if self.exit_code < 0:
            try:
                return f"killed:{signal.Signals(-self.exit_code).name}"
            except ValueError:  # a real-time signal has no name
                return f"killed:{-self.exit_code}"
        return "ok" if self.exit_code == 0 else "error"


def tar_directory(root: Path, arcroot: str = "") -> bytes:
    """Regular files under ``root`` as a gzip tar (names relative, under ``arcroot``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=str(Path(arcroot) / path.relative_to(root)), recursive=False)
    return buf.getvalue()


class Sandbox(ABC):
    """One episode's isolated environment; a context manager (closing kills everything in it)."""

    workspace: str
    """The workspace's path inside the sandbox (commands start there)."""
    mounts: dict[str, str]
    """Read-only host files made visible inside: name -> path inside the sandbox."""

    @abstractmethod
    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run ``command`` with ``/bin/sh -c`` in the workspace."""

    @abstractmethod
    def read_file(self, path: str) -> str:
        """A workspace file's text (cut at ``output_chars``); OSError/ValueError if unreadable."""

    @abstractmethod
    def write_file(self, path: str, content: str) -> None:
        """Create or replace a workspace file."""

    @abstractmethod
    def import_tar(self, data: bytes) -> None:
        """Extract a tar (files and folders only) into the workspace; files of the same names are
        replaced, others kept."""

    @abstractmethod
    def export_tar(self) -> bytes:
        """The workspace's regular files as a gzip tar."""

    @abstractmethod
    def close(self) -> None:
        """Kill every process of the sandbox and release it (idempotent)."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxRuntime(Protocol):
    """Something that opens sandboxes (bubblewrap and unshare here; containers on a cluster)."""

    name: str

    def open(self, readonly: Mapping[str, Path] | None = None) -> Sandbox:
        """A fresh sandbox with an empty workspace; ``readonly`` maps names to host files or
        folders to show read-only inside (their paths: ``Sandbox.mounts``)."""


def _processes_of(uid: int) -> int:
    """Processes of ``uid`` on this host (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            count += pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            pass  # exited meanwhile
    return count


class _UidLeases:
    """The sandbox uids in use on this host. RLIMIT_NPROC counts processes per host uid, so a
    fork bomb in one sandbox would starve every other sandbox of the same uid: each open sandbox
    takes a uid of its own from ``sandbox.uid .. uid + uid_pool - 1``. A lease is an exclusive
    ``flock`` on ``<tmp>/megatron-s2-sandbox-uids/<uid>.lock``, held while the sandbox is open and
    dropped by the kernel when its process ends however it ends, so two trainers (or two threads)
    starting sandboxes at the same moment never share a uid; a uid that still has processes on the
    host (a sandbox of a tool that takes no lease) is skipped too."""

    _lock = threading.Lock()
    _held: dict[int, int] = {}
    """uid -> descriptor of its lock file, for this process's open sandboxes."""

    @classmethod
    def take(cls, config: SandboxConfig) -> int:
        folder = Path(tempfile.gettempdir()) / "megatron-s2-sandbox-uids"
        folder.mkdir(mode=0o700, exist_ok=True)
        with cls._lock:
            for uid in range(config.uid, config.uid + config.uid_pool):
                if uid in cls._held:
                    continue
                fd = os.open(folder / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another process's sandbox holds it
                    os.close(fd)
                    continue
                if _processes_of(uid) == 0:
                    cls._held[uid] = fd
                    return uid
                os.close(fd)  # leftovers of an unleased sandbox: not ours to share
        raise SandboxUnavailable(f"all {config.uid_pool} sandbox uids ({config.uid}..{config.uid + config.uid_pool - 1}) "
                                 "are busy; raise sandbox.uid_pool or open fewer sandboxes at once")

    @classmethod
    def give_back(cls, uid: int) -> None:
        with cls._lock:
            fd = cls._held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock


class _ServerSandbox(Sandbox):
    """A sandbox driven through :mod:`._sandbox_server` over pipes."""

    def __init__(self, argv: list[str], config: SandboxConfig, workspace: str, mounts: dict[str, str]):
        self.config, self.workspace, self.mounts = config, workspace, mounts
        self._next_id, self._buffer = 0, b""
        if os.geteuid() == 0:  # root ignores RLIMIT_NPROC and file permissions: an unprivileged uid of its own
            self.uid = _UidLeases.take(config)
            self._nproc = config.max_processes
        else:  # the limit counts the user's own processes too: allow max_processes more than it has
            self.uid = None
            self._nproc = _processes_of(os.getuid()) + config.max_processes
        argv = [_python_inside(), "-I", "-S", "-c", _REAPER.read_text(encoding="utf-8"), *argv]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          preexec_fn=self._drop_privileges, start_new_session=True)
        except OSError as exc:  # the isolation tool is missing or not executable
            self._release_uid()
            raise SandboxUnavailable(f"cannot start {argv[5]}: {exc.strerror or exc}") from None
        try:
            self._reply(timeout=30.0, request_id=0)
        except SandboxCrashed as exc:
            raise SandboxUnavailable(f"sandbox did not start: {exc}") from None

    def _drop_privileges(self) -> None:  # runs in the child before exec
        resource.setrlimit(resource.RLIMIT_NPROC, (self._nproc,) * 2)
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)

    def _release_uid(self) -> None:
        if self.uid is not None:
            _UidLeases.give_back(self.uid)
            self.uid = None

    def _readline(self, deadline: float) -> bytes | None:
        """The server's next line, b"" at end of output, None past ``deadline``. Our own buffer over
        os.read: select() cannot see lines already sitting in a file object's buffer."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 1 << 20)
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _reply(self, timeout: float, request_id: int) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            line = self._readline(deadline)
            if line is None:
                self.close()
                raise SandboxCrashed(f"no answer within {timeout:.0f} s")
            if not line:
                try:
                    self._proc.wait(timeout=2.0)
                    err = self._proc.stderr.read().decode("utf-8", "replace")[-500:]
                except subprocess.TimeoutExpired:
                    err = ""
                self.close()
                raise SandboxCrashed(f"the sandbox exited{': ' + err.strip() if err.strip() else ''}")
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours (a forged or torn line): keep waiting for our id
            if reply.get("id") == request_id:
                return reply

    def _call(self, op: str, wait_s: float = 30.0, **fields) -> dict:
        if self._proc.poll() is not None:
            raise SandboxCrashed("the sandbox is closed")
        self._next_id += 1
        try:
            self._proc.stdin.write((json.dumps({"id": self._next_id, "op": op, **fields}) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            raise SandboxCrashed("the sandbox exited") from None
        reply = self._reply(wait_s, self._next_id)
        if not reply.get("ok"):  # the agent's mistake (a missing file, a path outside the workspace)
            raise (OSError if reply.get("os_error") else ValueError)(reply.get("error", "sandbox error"))
        return reply

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        timeout = self.config.command_timeout_s if timeout is None else timeout
        r = self._call("run", wait_s=timeout + _HOST_GRACE_S, command=command, timeout=timeout)
        return CommandResult(r["exit_code"], r["stdout"], r["stderr"], r["timed_out"], r["seconds"],
                             r["memory_exceeded"])

    def read_file(self, path: str) -> str:
        r = self._call("read", path=path)
        return r["content"] + ("\n[... file truncated]" if r["truncated"] else "")

    def write_file(self, path: str, content: str) -> None:
        self._call("write", path=path, content=content)

    def import_tar(self, data: bytes) -> None:
        self._call("import", tar=base64.b64encode(data).decode())

    def export_tar(self) -> bytes:
        return base64.b64decode(self._call("export")["tar"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:  # orderly first: the server kills everything, the sandbox's init reaps it and exits
                self._proc.stdin.write(b'{"id": -1, "op": "exit"}\n')
                self._proc.stdin.flush()
                self._proc.wait(timeout=2.0)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        if self._proc.poll() is None:  # stuck: the reaper kills the launcher (the pid namespace dies with it)
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if self._proc.poll() is None:
            try:  # last resort: the whole process group
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()
        self._release_uid()
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            stream.close()


def _server_config(config: SandboxConfig, workspace: str, scratch: str) -> str:
    return json.dumps({"workspace": workspace, "scratch": scratch, "cpu_seconds": config.cpu_seconds,
                       "memory_mb": config.memory_mb, "max_file_mb": config.max_file_mb,
                       "output_chars": config.output_chars})


_STAGE_PREFIX = "megatron_s2-sandbox-"
_stage_locks: list[int] = []
"""Open descriptors of this process's stage locks (held until the process ends, however it ends)."""


def _sweep_stale_stages(parent: Path) -> None:
    """Remove the stage folders of processes that are gone without their ``atexit`` (kill -9): a
    live one holds an exclusive lock on its ``.lock``, which the kernel drops with the process."""
    for old in parent.glob(f"{_STAGE_PREFIX}*"):
        try:
            fd = os.open(old / ".lock", os.O_RDONLY)
        except OSError:
            continue  # no lock (yet): not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # its process is alive
        finally:
            os.close(fd)


@lru_cache(maxsize=None)
def _stage_root() -> Path:
    """A root-owned, world-readable folder of this process for the host files sandboxes are shown
    read-only (removed at exit, or by the next process when this one was killed): the unprivileged
    sandbox uid may not reach the repository."""
    parent = Path("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    _sweep_stale_stages(parent)
    root = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=parent))
    root.chmod(0o755)
    # locked before it gets its name, so a sweeper never sees an unlocked lock of a live process
    fd = os.open(root / ".lock.new", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(root / ".lock.new", root / ".lock")
    _stage_locks.append(fd)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@lru_cache(maxsize=None)
def _staged(host: Path) -> Path:
    """``host`` (a file or folder) copied once into :func:`_stage_root`, readable by anyone."""
    target = _stage_root() / f"{len(list(_stage_root().iterdir()))}-{host.name}"
    if host.is_dir():
        shutil.copytree(host, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(host, target)
    for path in (target, *(target.rglob("*") if target.is_dir() else ())):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def _python_inside() -> str:
    """The interpreter the sandbox runs (the system's python3 under /usr, never the host venv)."""
    for path in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    raise SandboxUnavailable("no python3 under /usr/local/bin or /usr/bin to run the sandbox's command server")


class BwrapRuntime:
    """bubblewrap sandboxes (module docstring)."""

    name = "bwrap"

    def __init__(self, config: SandboxConfig = SandboxConfig(), bwrap: str | None = None):
        self.config = config
        self.bwrap = bwrap or shutil.which("bwrap") or "/usr/bin/bwrap"

    def open(self, readonly: Mapping[str, Path] | None = None) -> Sandbox:
        mb = 1 << 20
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
        for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr Debian: /bin -> usr/bin, ...
            if os.path.islink(f"/{link}"):
                argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/passwd", "/etc/group"):
            if os.path.exists(etc):
                argv += ["--ro-bind", etc, etc]
        if _TASK_DATA.resolve().is_relative_to("/usr"):  # installed under /usr: hide references and graders
            argv += ["--tmpfs", str(_TASK_DATA.resolve())]
        argv += ["--size", str(self.config.workspace_mb * mb), "--tmpfs", "/tmp",
                 "--size", str(self.config.workspace_mb * mb), "--tmpfs", "/workspace"]
        mounts = {}
        for name, host in (readonly or {}).items():
            mounts[name] = f"/mnt/{name}"
            argv += ["--ro-bind", str(_staged(Path(host))), mounts[name]]
        argv += ["--chdir", "/workspace", "--", _python_inside(), "-I", "-c", _SERVER.read_text(encoding="utf-8"),
                 _server_config(self.config, "/workspace", "/tmp/.sandbox")]
        return _ServerSandbox(argv, self.config, "/workspace", mounts)


class UnshareRuntime:
    """util-linux ``unshare`` + rlimits (module docstring). ``hide``: host folders made invisible
    inside (empty read-only tmpfs over them) — the task data with its solutions by default."""

    name = "unshare"

    def __init__(self, config: SandboxConfig = SandboxConfig(), hide: tuple[Path, ...] | None = None):
        self.config = config
        self.hide = tuple(Path(h) for h in ((_TASK_DATA,) if hide is None else hide))

    def open(self, readonly: Mapping[str, Path] | None = None) -> Sandbox:
        size = f"{self.config.workspace_mb}m"
        # run as the userns's root (mapped onto the unprivileged uid): mounts first, then drop every
        # capability for good before the server starts (no remounting, no writing host files)
        lines = [  # every host mount read-only first (a non-root runner's own files, /var/tmp, ...)
            'while read -r dev mp rest; do case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) ;; '
            '*) mount -o remount,bind,ro "$mp" || { echo "cannot make $mp read-only" >&2; exit 1; } ;; esac; '
            'done < /proc/self/mounts',
            f"mount -t tmpfs -o size={size},mode=1777 tmpfs /tmp", "mkdir -p /tmp/.ro /tmp/workspace",
                 f"mount -t tmpfs -o size={size} tmpfs /tmp/workspace",
                 "mount -t tmpfs -o size=1m tmpfs /dev/shm 2>/dev/null || true"]
        mounts = {}
        for name, host in (readonly or {}).items():
            target, staged = f"/tmp/.ro/{name}", shlex.quote(str(_staged(Path(host))))
            mounts[name] = target
            lines += [f"{'mkdir -p' if Path(host).is_dir() else 'touch'} {target}",
                      f"mount --bind {staged} {target}", f"mount -o remount,bind,ro {target}"]
        # after the binds: hide the task data and the stage (tmpfs over them; a folder the sandbox
        # cannot even reach, such as one under /root, is hidden already)
        for hidden in (*self.hide, _stage_root()):
            if hidden.exists():
                path = shlex.quote(str(hidden))
                lines.append(f"mount -t tmpfs -o size=4k,ro tmpfs {path} 2>/dev/null || ! ls {path} >/dev/null 2>&1")
        server = _server_config(self.config, "/tmp/workspace", "/tmp/.sandbox")
        lines.append(f"cd /tmp/workspace && exec setpriv --no-new-privs --bounding-set=-all --inh-caps=-all "
                     f"{_python_inside()} -I -c {shlex.quote(_SERVER.read_text(encoding='utf-8'))} {shlex.quote(server)}")
        argv = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
                "--kill-child", "--mount-proc", "--", "/bin/sh", "-ec", "\n".join(lines)]
        return _ServerSandbox(argv, self.config, "/tmp/workspace", mounts)


def probe(runtime: SandboxRuntime) -> str | None:
    """None if ``runtime`` runs a trivial command here, else why not."""
    try:
        with runtime.open() as box:
            result = box.run("echo ok", timeout=10)
        return None if result.stdout.strip() == "ok" else f"probe printed {result.stdout!r} {result.stderr!r}"
    except (SandboxUnavailable, SandboxCrashed, OSError) as exc:
        return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__


def detect_runtime(config: SandboxConfig = SandboxConfig(), bwrap: str | None = None) -> SandboxRuntime:
    """The runtime ``config.backend`` asks for, checked to work here; 'auto': bwrap, else unshare.
    ``bwrap``: its path (default: found on PATH). Raises :class:`SandboxUnavailable` (one line
    naming the fix) when none works."""
    candidates = {"bwrap": [BwrapRuntime], "unshare": [UnshareRuntime],
                  "auto": [BwrapRuntime, UnshareRuntime]}[config.backend]
    reasons = []
    for make in candidates:
        runtime = make(config, bwrap) if make is BwrapRuntime else make(config)
        if make is BwrapRuntime and not os.access(runtime.bwrap, os.X_OK):
            reasons.append(f"bwrap: not installed ({runtime.bwrap})")
            continue
        why = probe(runtime)
        if why is None:
            return runtime
        reasons.append(f"{runtime.name}: {why}")
    raise SandboxUnavailable(f"sandbox.backend={config.backend}: no isolation backend works here ({'; '.join(reasons)}); "
                             "install bubblewrap (apt-get install bubblewrap) or allow unprivileged user namespaces "
                             "(sysctl kernel.unprivileged_userns_clone=1)")
