"""A rank whose collective failed because another rank is gone: one line and its own exit code.

When one rank dies (``kill -9``, the OOM killer, an exception), its peers find out inside their
next collective: gloo raises "Connection closed by peer", NCCL aborts the communicator. That
error is a consequence, not a cause: its traceback says nothing about what happened, and a
launcher that reads it as the job's failure names the wrong rank. So a rank that recognises it
(:func:`lost_peer`) prints one line and exits with :data:`EXIT_PEER_LOST`, without the
end-of-run barrier (which could only fail again, or hang under NCCL); the local launcher
(:mod:`megatron_s2.launcher.local`) then names the rank that failed first, not the peers it took
down. No torch import here: the launcher reads the exit code and :data:`PEER_LOST_NOTE`.
"""

from __future__ import annotations

__all__ = ["EXIT_PEER_LOST", "PEER_LOST_NOTE", "lost_peer"]

EXIT_PEER_LOST = 76
"""Exit code of a rank that stopped because another rank is gone (sysexits' EX_PROTOCOL)."""
PEER_LOST_NOTE = "lost contact with another rank"
"""In the one line such a rank prints: the local launcher stops echoing rank 0 when it sees it
(the rank that died may take seconds to exit; the job is failing from this line on)."""

# What the backends say when the other end of a collective has gone away.
_SIGNS = {
    "connection closed by peer": "gloo",
    "connection reset by peer": "gloo",
    "broken pipe": "gloo",
    "remote process exited": "nccl",
    "communicator was aborted": "nccl",
}


def lost_peer(exc: BaseException) -> str | None:
    """A one-line reason when ``exc`` (or an exception it was raised from) is a collective that
    failed because a peer rank is gone; None for any other error. The backends raise
    RuntimeErrors (and the checkpoint layer re-raises their text); an OSError saying "broken
    pipe" or "connection reset" is a socket of this process (a client, a pipe), not a peer."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = "" if isinstance(exc, OSError) else str(exc)
        for sign, backend in _SIGNS.items():
            if sign in text.lower():
                detail = next((line for line in text.splitlines() if sign in line.lower()), sign).strip()
                detail = detail.split("] ", 1)[-1].split(". ", 1)[0][:160]  # gloo: "[file:line] what. advice"
                return f"{PEER_LOST_NOTE} in a collective ({backend}: {detail}); stopping"
        exc = exc.__cause__ or exc.__context__
    return None
