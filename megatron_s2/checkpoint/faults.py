"""Fault injection for the save path (tests only): ``MEGATRON_S2_CKPT_FAULT=<point>[@rank]``.

The save path calls :func:`crash_point` at the moments where a real crash would be most
damaging; when the variable names that point (and this rank, if ``@rank`` is given), the
process sends itself SIGKILL — no cleanup, no ``finally`` blocks, exactly like ``kill -9``.
Points, in save order:

* ``mid_shard`` — inside the write of a tensor shard file, after half of a buffer hit the disk;
* ``before_commit`` — every shard and the manifest written, the commit marker not yet;
* ``before_latest`` — the step directory committed and in place, ``latest`` not yet moved;
* ``mid_rotation`` — ``keep_last`` retention deleting an old checkpoint, one file removed.

``enospc_mid_shard`` is not a crash: the write of a tensor shard file fails with ENOSPC after
half of a buffer hit the disk, as when another writer fills the disk between the free-space
check and the save (:func:`fail_point` raises it).

The variable is read at every call, so a test sets it in the environment of the job it kills.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["FAULT_ENV", "FAULT_POINTS", "crash_point", "fail_point", "fault_armed"]

FAULT_ENV = "MEGATRON_S2_CKPT_FAULT"
FAULT_POINTS = ("mid_shard", "before_commit", "before_latest", "mid_rotation", "enospc_mid_shard")


def fault_armed(point: str, rank: int) -> bool:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return False
    name, _, who = spec.partition("@")
    if name not in FAULT_POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point; use one of {', '.join(FAULT_POINTS)} [@rank]")
    return name == point and (not who or int(who) == rank)


def crash_point(point: str, rank: int) -> None:
    """SIGKILL this process if the fault variable names ``point`` (and ``rank``)."""
    if fault_armed(point, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(point: str, rank: int, path: str) -> None:
    """Raise ENOSPC writing ``path`` if the fault variable names ``point`` (and ``rank``)."""
    if fault_armed(point, rank):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
