"""The embedded executable tasks: coding and terminal tasks with automatic verifiers.

Each task is a folder of data files under ``tasks/`` (no network, nothing generated):

* ``task.json`` — ``prompt`` (what the agent is told), ``reset`` (workspace files the grader
  deletes before grading: outputs the agent's *program* must produce, so writing them by hand
  earns nothing), ``overlay`` (grader file -> workspace path: canonical copies laid over the
  agent's final workspace, last);
* ``workspace/`` — the files the agent starts from (a bug to fix, a stub to implement, ...);
* ``grader/`` — the canonical ``test_*.py`` files (visible ones and hidden ones) and the data
  they need; never shown to the agent;
* ``reference.json`` — a scripted reference solution: the tool calls an agent would make
  (:mod:`.tools`), scoring 1.

Kinds in the set: fix a bug so that hidden tests pass (``fix_median``, ``fix_wordcount``,
``fix_report``), implement to a spec (``implement_slugify``), produce a file with given
properties (``primes_file``, ``make_config``), a terminal chore (``archive_logs``); and two
tiny-model tasks, one file read and one file written (``sum_pair``: the sum of the two numbers of
input.txt; ``copy_word``: the word of word.txt), whose inputs are overlaid last, so an agent that
rewrites them earns nothing.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = ["TASKS_DIR", "AgenticTask", "load_task", "task_names"]

TASKS_DIR = Path(__file__).with_name("tasks")


@dataclass(frozen=True)
class AgenticTask:
    """One executable task (module docstring)."""

    name: str
    prompt: str
    root: Path
    reset: tuple[str, ...] = ()
    overlay: dict[str, str] = field(default_factory=dict)
    reference: tuple[dict, ...] = ()

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def grader(self) -> Path:
        return self.root / "grader"

    def test_ids(self) -> set[str]:
        """Every canonical test the grade must report, read from the grader's sources (``ast``:
        nothing is imported or run on the host)."""
        ids = set()
        for path in sorted(self.grader.glob("test_*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            ids |= {f"{path.name}::{node.name}" for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        return ids


def task_names() -> list[str]:
    return sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.json").is_file())


@lru_cache(maxsize=None)
def load_task(name: str) -> AgenticTask:
    root = TASKS_DIR / name
    if not (root / "task.json").is_file():
        raise ValueError(f"agentic task {name!r}: no such task; known: {', '.join(task_names())}")
    spec = json.loads((root / "task.json").read_text(encoding="utf-8"))
    reference = json.loads((root / "reference.json").read_text(encoding="utf-8"))
    return AgenticTask(name, spec["prompt"], root, tuple(spec.get("reset", ())), dict(spec.get("overlay", {})),
                       tuple(reference))
