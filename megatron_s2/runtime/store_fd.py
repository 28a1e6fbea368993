"""The rendezvous socket a local launcher hands to rank 0 (``launcher/local.py``).

The launcher binds and listens on the ``MASTER_PORT`` before any rank starts and passes the
socket's file descriptor to rank 0 in :data:`STORE_FD_ENV`; rank 0 serves its TCPStore on that
socket (``TCPStore(master_listen_fd=...)``) instead of binding the port itself, so no other
process can take the port in between (torchrun's agent store solves the same race). Torch-free,
so the launcher can import it without paying for torch.
"""

from __future__ import annotations

import os
from typing import MutableMapping

__all__ = ["STORE_FD_ENV", "take_store_fd"]

STORE_FD_ENV = "MEGATRON_S2_STORE_FD"


def take_store_fd(env: MutableMapping[str, str] = os.environ) -> int | None:
    """The inherited listening socket's descriptor, removed from ``env`` (a rank's own
    subprocesses must not think they are rank 0); None when the launcher handed none."""
    value = env.pop(STORE_FD_ENV, None)
    if not value:
        return None
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        return None  # not inherited after all (e.g. a re-exec): bind the port as usual
    return fd
