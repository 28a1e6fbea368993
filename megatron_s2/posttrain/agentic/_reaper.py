"""Runs a sandbox launcher (bwrap/unshare) and reaps every process it orphans (stdlib only).

bwrap's outer process can exit before the sandbox's init has been reaped; the orphan then waits
for the host's pid 1, which in a container may never reap it — and each such zombie keeps
counting against the sandbox uid's process limit until fork fails for every later episode. As a
child subreaper this process adopts those orphans, reaps them all, and exits with the launcher's
status only when none is left. SIGTERM kills the launcher (and so the sandbox) and reaps it.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def main():
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the host died: so does the sandbox
    launcher = os.fork()
    if launcher == 0:
        try:
            os.execvp(sys.argv[1], sys.argv[1:])
        except OSError as exc:
            sys.stderr.write(f"cannot start {sys.argv[1]}: {exc.strerror}\n")
            os._exit(127)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(launcher, signal.SIGKILL))
    code = 1
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == launcher:
            code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
