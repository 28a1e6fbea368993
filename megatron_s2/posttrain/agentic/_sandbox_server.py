"""The command server that runs *inside* an episode's sandbox (stdlib only; ``python3 -I``).

The host (:mod:`.sandbox`) starts one per sandbox and speaks JSON lines over its stdin/stdout:
one request ``{"id", "op", ...}`` -> one reply ``{"id", "ok", ...}``. Ops: ``run`` a shell
command, ``read``/``write`` a file, ``import`` a tar into the workspace, ``export`` the
workspace as a tar, ``exit``. The server holds no privilege the agent lacks — it is only the
shell the agent would have — so an agent that kills it merely crashes its own episode.

Each command runs in its own session with the per-command rlimits (CPU, address space, file
size), and the server watches the resident memory of the whole sandbox (many processes under one
address-space limit each could still exhaust the host); at the end of the command, whether it finished, timed out or crashed, every other process
in the sandbox's private pid namespace is killed, so nothing outlives a tool call.
"""

import base64
import ctypes
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tarfile
import time

PR_SET_DUMPABLE = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
WATCH_S = 0.02
"""Seconds between two looks at a running command's clock and memory."""


def _limits(cfg):
    def apply():
        os.setsid()  # its own process group: a timeout kills the whole tree at once
        resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _kill_all_but_me():
    """SIGKILL every process of the pid namespace except pid 1 (the sandbox's init) and this server;
    repeat until none is left (a fork bomb may still be forking)."""
    for _ in range(200):
        others = _others()
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap our own children
                pass
        except ChildProcessError:
            pass
        time.sleep(0.01)


def _others():
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def _resident_bytes():
    """Resident memory of every process of the sandbox but its init and this server: RLIMIT_AS
    bounds one process, this bounds them all together (no cgroup is needed)."""
    total = 0
    for pid in _others():
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass  # exited meanwhile
    return total


def _tail(path, limit):
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", "replace")
    return text + ("\n[... output truncated]" if len(data) > limit else "")


def _run(req, cfg, ws):
    out_dir = cfg["scratch"]
    out, err = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": ws, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    deadline, memory = start + req["timeout"], cfg["memory_mb"] << 20
    stopped = None  # 'timeout' or 'memory' when the server ended the command
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(["/bin/sh", "-c", req["command"]], cwd=ws, env=env, stdin=subprocess.DEVNULL,
                                stdout=fo, stderr=fe, preexec_fn=_limits(cfg), close_fds=True)
        while True:  # wait in short slices, watching the clock and the sandbox's total memory
            try:
                code = proc.wait(timeout=WATCH_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= deadline:
                stopped = "timeout"
            elif _resident_bytes() > memory:
                stopped = "memory"
            if stopped:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                code = proc.wait()
                break
    _kill_all_but_me()  # background jobs, setsid'd daemons, fork-bomb leftovers
    limit = cfg["output_chars"]
    return {"exit_code": code, "timed_out": stopped == "timeout", "memory_exceeded": stopped == "memory",
            "seconds": time.monotonic() - start, "stdout": _tail(out, limit), "stderr": _tail(err, limit)}


def _inside(ws, path):
    full = os.path.realpath(os.path.join(ws, path))
    if full != ws and not full.startswith(ws + os.sep):
        raise ValueError(f"{path}: outside the workspace")
    return full


def _read(req, cfg, ws):
    with open(_inside(ws, req["path"]), "rb") as f:
        data = f.read(cfg["output_chars"] + 1)
    return {"content": data.decode("utf-8", "replace")[:cfg["output_chars"]], "truncated": len(data) > cfg["output_chars"]}


def _write(req, cfg, ws):
    path = _inside(ws, req["path"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(req["content"])
    return {"bytes": len(req["content"].encode("utf-8"))}


def _import(req, cfg, ws):
    data = base64.b64decode(req["tar"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():  # regular files and folders only, relative, inside
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"{member.name}: only files and folders can be imported")
            _inside(ws, member.name)
        tar.extractall(ws)
    return {"files": len(data)}


def _export(req, cfg, ws):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for root, dirs, files in os.walk(ws):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    info = tar.gettarinfo(full, arcname=os.path.relpath(full, ws))
                    info.type, info.size = tarfile.REGTYPE, os.path.getsize(full)  # a hard link: a file of its own
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
    return {"tar": base64.b64encode(buf.getvalue()).decode()}


OPS = {"run": _run, "read": _read, "write": _write, "import": _import, "export": _export}


def main():
    cfg = json.loads(sys.argv[1])
    ws = os.path.realpath(cfg["workspace"])
    os.makedirs(cfg["scratch"], exist_ok=True)
    try:  # same-uid agent processes cannot open /proc/<server>/fd (no forged replies)
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except OSError:
        pass
    reply = sys.stdout
    sys.stdout = sys.stderr
    reply.write(json.dumps({"id": 0, "ok": True, "ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            _kill_all_but_me()
            break
        try:
            answer = {"ok": True, **OPS[req["op"]](req, cfg, ws)}
        except (OSError, ValueError, tarfile.TarError) as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "os_error": isinstance(exc, OSError)}
        answer["id"] = req["id"]
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
