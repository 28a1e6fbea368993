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


def _number(value) -> float | None:
    """A metric value as a float; None for what is not a plain number (bools, strings, ints
    beyond float range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def read_evaluations(run_dir: str | Path) -> tuple[list[dict], int]:
    """(the evaluations of one run in step order, how many lines were unreadable). A line a
    killed run left half-written, or anything else that is not one JSON object with an integer
    ``step``, is counted and skipped; lines are read one at a time (a long run's file is not
    loaded whole)."""
    path = Path(run_dir) / "eval.jsonl"
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, int digit limits, deep nesting
                bad += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**15:
                bad += 1
                continue
            rows.append({"step": step, **{k: v for k, v in row.items() if _number(v) is not None}})
    return sorted(rows, key=lambda r: r["step"]), bad


def _shown(key: str) -> bool:
    return any(key == p or key.startswith(p + "_") for p in METRIC_PREFIXES)


def summarise(phases: Sequence[tuple[str, str | Path]]) -> str:
    """``phases``: (name, run directory) in pipeline order -> the table (one line per phase
    without evaluations)."""
    lines = [f"{'phase':<18} {'metric':<34} {'first':>10} {'(step)':>7} {'last':>10} {'(step)':>7}"]
    for name, run_dir in phases:
        if not Path(run_dir).is_dir():
            lines.append(f"{name:<18} (has not run: no {run_dir})")
            continue
        rows, bad = read_evaluations(run_dir)
        note = f"; {bad} unreadable line(s) of eval.jsonl skipped" if bad else ""
        keys = sorted({k for r in rows for k in r if _shown(k)})
        if not keys:
            lines.append(f"{name:<18} (no held-out evaluation{note})")
            continue
        for key in keys:
            have = [r for r in rows if key in r]
            first, last = have[0], have[-1]
            lines.append(f"{name:<18} {key:<34} {_number(first[key]):>10.4f} {first['step']:>7} "
                         f"{_number(last[key]):>10.4f} {last['step']:>7}")
        if bad:
            lines.append(f"{name:<18} ({bad} unreadable line(s) of eval.jsonl skipped)")
    return "\n".join(lines)
