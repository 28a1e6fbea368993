"""Whether a path named in a recipe can be loaded as a checkpoint, judged from names alone.

Pre-flight checks (``megatron-s2 launch`` before any rank starts, the trainer before it builds a
model) refuse a ``checkpoint.load``, reference or teacher path that cannot hold a checkpoint:
missing, a file, or a directory without a committed ``step_*`` directory. Only names and
markers are read — no checksums, no torch — so this costs a few ``stat`` calls even for a
flagship checkpoint; the full verification happens where the checkpoint is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from megatron_s2.checkpoint.format import COMMIT, MANIFEST, parse_step_name

__all__ = ["checkpoint_problem", "may_be_created"]


def _committed_steps(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if parse_step_name(p.name) is not None and (p / COMMIT).is_file()]


def checkpoint_problem(path: str | os.PathLike, *, hf_export: bool = False) -> str | None:
    """None when ``path`` looks loadable — a committed step directory, or a ``checkpoints/`` or
    run directory holding one (``hf_export``: also a Hugging Face export, a folder with
    ``config.json``) — else why not, as a phrase that starts with the path."""
    p = Path(path)
    if not p.exists():
        return f"{path} does not exist"
    if not p.is_dir():
        return f"{path} is a file, not a checkpoint directory"
    if hf_export and (p / "config.json").is_file():
        return None
    if parse_step_name(p.name) is not None or (p / MANIFEST).exists():  # one step directory
        return None if (p / COMMIT).is_file() else f"{path} is not a committed checkpoint (no {COMMIT} marker)"
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not _committed_steps(root):
        return f"{path} holds no committed checkpoint (a step_* directory with {COMMIT})"
    return None


def may_be_created(path: str | os.PathLike, pending: Iterable[str | os.PathLike]) -> bool:
    """Whether ``path`` lies in one of the ``pending`` directories (run directories of earlier
    phases of a pipeline, written before the phase that names ``path`` starts)."""
    target = Path(os.path.abspath(path))
    for directory in pending:
        root = Path(os.path.abspath(directory))
        if target == root or root in target.parents:
            return True
    return False
