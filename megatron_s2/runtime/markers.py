"""The two files through which a run tells its launcher how it ended.

``<run_dir>/FINISHED`` — written by rank 0 when the run reached ``training.train_steps``:
JSON ``{"step": N, "loss": L}``. The run counts as finished only for a target of at most N
steps: raising ``training.train_steps`` extends it (the trainer resumes from the last
checkpoint and removes the marker once that resume is accepted), nothing to delete by hand.

``<run_dir>/PREEMPTED`` — written by rank 0 after a preemption checkpoint is committed on
every rank (or when the stop came before the first step, so the newest checkpoint is
current), before any rank exits: JSON ``{"step": N, "signal": "SIGUSR1", "time": ...}``.
Rank exit codes cannot carry this reliably under SLURM: with ``srun --kill-on-bad-exit`` the
first rank exiting 75 gets the others killed and srun reports their signals, and torchrun
reports any non-zero worker as a failure. The batch script (:mod:`megatron_s2.launcher.
sbatch_script`) removes the marker before starting a step and requeues when it finds it
afterwards, whatever srun's exit code, and whichever process (batch shell or ranks) the
signal reached.

Both files are written atomically (temporary file + rename).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["FINISHED_MARKER", "PREEMPTED_MARKER", "clear_preempted", "extension_hint", "finished_step",
           "is_finished", "read_preempted", "write_finished", "write_preempted"]

FINISHED_MARKER = "FINISHED"
PREEMPTED_MARKER = "PREEMPTED"


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_finished(run_dir: str | Path, step: int, loss: float | None) -> None:
    _write(Path(run_dir) / FINISHED_MARKER, {"step": step, "loss": loss})


def finished_step(run_dir: str | Path) -> int | None:
    """The step recorded in FINISHED; None without the marker. A marker without a readable step
    (e.g. written by hand) counts as finished at any target."""
    path = Path(run_dir) / FINISHED_MARKER
    if not path.exists():
        return None
    step = (_read(path) or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else 2 ** 62


def is_finished(run_dir: str | Path, train_steps: int) -> bool:
    """Whether the run already reached ``train_steps`` (its FINISHED marker says so)."""
    step = finished_step(run_dir)
    return step is not None and step >= train_steps


def extension_hint(step: int) -> str:
    """How to train a finished run further."""
    return (f"to train further, raise training.train_steps above {step} (e.g. the override "
            f"training.train_steps={max(2 * step, step + 1)}); the run resumes from its last checkpoint")


def write_preempted(run_dir: str | Path, step: int, signal_name: str) -> None:
    _write(Path(run_dir) / PREEMPTED_MARKER,
           {"step": step, "signal": signal_name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def read_preempted(run_dir: str | Path) -> dict | None:
    return _read(Path(run_dir) / PREEMPTED_MARKER)


def clear_preempted(run_dir: str | Path) -> None:
    (Path(run_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
