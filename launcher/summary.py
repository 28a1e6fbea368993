"""What each phase measured: the first and last held-out evaluation of every phase, one table.

A pipeline's phases each write ``eval.jsonl`` in their run directory (post-training phases:
``megatron_s2/posttrain/rollout/evaluation.py``; one JSON object per evaluation with its
``step``). Comparing phases — the experts against the distilled student and the joint-RL
baseline of ``recipes/two_experts_tiny.yaml`` (walkthrough Ch. 8) — means reading several of
those files side by side; :func:`summarise` prints them as one table: per phase, per metric, the
value at the first evaluation (before the phase's first update) and at the last. ``megatron-s2
launch <pipeline> --local`` prints it after the last phase; ``--summary`` prints it for whatever
has run (a SLURM pipeline, a stopped one) without starting anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

__all__ = ["METRIC_PREFIXES", "read_evaluations", "summarise"]

METRIC_PREFIXES = ("eval_accuracy", "eval_greedy_accuracy", "eval_kl_to_teacher", "eval_student_logprob_teacher",
                   "eval_teacher_logprob_teacher")
"""The held-out metrics the table shows (per-dataset variants ``<prefix>_<dataset>`` included)."""


def read_evaluations(run_dir: str | Path) -> list[dict]:
    """The evaluations of one run in step order; [] when it has none. A line a killed run left
    half-written is skipped (the run writes it again when it resumes)."""
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _shown(key: str) -> bool:
    return any(key == p or key.startswith(p + "_") for p in METRIC_PREFIXES)


def summarise(phases: Sequence[tuple[str, str | Path]]) -> str:
    """``phases``: (name, run directory) in pipeline order -> the table (one line per phase
    without evaluations)."""
    lines = [f"{'phase':<18} {'metric':<34} {'first':>10} {'(step)':>7} {'last':>10} {'(step)':>7}"]
    for name, run_dir in phases:
        rows = read_evaluations(run_dir)
        keys = sorted({k for r in rows for k in r if _shown(k) and isinstance(r[k], (int, float))})
        if not keys:
            lines.append(f"{name:<18} (no held-out evaluation)")
            continue
        for key in keys:
            have = [r for r in rows if isinstance(r.get(key), (int, float))]
            first, last = have[0], have[-1]
            lines.append(f"{name:<18} {key:<34} {first[key]:>10.4f} {first['step']:>7} "
                         f"{last[key]:>10.4f} {last['step']:>7}")
    return "\n".join(lines)
