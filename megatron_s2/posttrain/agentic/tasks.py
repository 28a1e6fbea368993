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
properties (``primes_file``, ``make_config``), a terminal chore (``archive_logs``); and three
tiny-model tasks, one file read and one file written (``sum_pair``: the sum of the two numbers of
input.txt; ``copy_word``: the word of word.txt, random letters; ``spot_seven``: ``yes`` when one of
input.txt's four digits is a 7, else ``no`` — a two-way decision, half the instances each, whose
reference writes the answer before the path, nearer the observation), whose inputs are overlaid
last, so an agent that rewrites them earns nothing.

**Variants** (issue 25): a policy trained on one fixed instance learns that instance. The two
tiny-model tasks have seeded instances — :func:`task_variant` draws ``sum_pair``'s operands,
``copy_word``'s word and ``spot_seven``'s digits — as the same task with its input file replaced (in the starting workspace
and in the canonical overlay) and the reference solution rewritten. A variant belongs to the
``train`` or the ``eval`` split by its *content* (:func:`variant_split`: a hash of its files), so
the held-out instances are never trained on, whatever the seeds or counts
(:func:`task_variants`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

__all__ = ["TASKS_DIR", "AgenticTask", "load_task", "task_names", "VARIANT_TASKS", "task_variant", "variant_split",
           "task_variants", "WORD_LENGTH"]

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
    files: dict[str, str] = field(default_factory=dict)
    """A variant's files (workspace path -> text): laid over the starting workspace and, for the
    paths the overlay lands on, used as the canonical copy instead of the grader's (module docstring)."""
    variant: str = ""
    """The variant's key ('' = the task as stored)."""

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


# ---- variants ----------------------------------------------------------------------------------------
# copy_word's words: WORD_LENGTH random lowercase letters. Not dictionary words: a tiny policy can
# memorise a word list's spellings and guess a frequent one without reading word.txt; random letters
# can only be copied, every letter from the observation (issue 25, "a rising curve").
WORD_LENGTH = 3
LETTERS = "abcdefghijklmnopqrstuvwxyz"

VARIANT_TASKS = ("sum_pair", "copy_word", "spot_seven")
"""The tasks with seeded instances (:func:`task_variant`)."""


def _sum_pair(rng: random.Random, max_operand: int) -> tuple[dict[str, str], dict[str, str]]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return {"input.txt": f"{a} {b}\n"}, {"answer.txt": str(a + b)}


def _copy_word(rng: random.Random, max_operand: int) -> tuple[dict[str, str], dict[str, str]]:
    word = "".join(rng.choice(LETTERS) for _ in range(WORD_LENGTH))
    return {"word.txt": f"{word}\n"}, {"answer.txt": word}


SEVEN_DIGITS = 4
NOT_SEVEN = "01234568" + "9"


def _spot_seven(rng: random.Random, max_operand: int) -> tuple[dict[str, str], dict[str, str]]:
    # half the instances hold exactly one 7 (at a random place), half none: answering without
    # reading the file scores 1/2 at best, so a rise above that is read from the observation
    digits = [rng.choice(NOT_SEVEN) for _ in range(SEVEN_DIGITS)]
    seven = rng.random() < 0.5
    if seven:
        digits[rng.randrange(SEVEN_DIGITS)] = "7"
    return {"input.txt": " ".join(digits) + "\n"}, {"answer.txt": "yes" if seven else "no"}


_GENERATORS = {"sum_pair": _sum_pair, "copy_word": _copy_word, "spot_seven": _spot_seven}


def task_variant(name: str, seed: int, *, max_operand: int = 99) -> AgenticTask:
    """Instance ``seed`` of task ``name`` (one of :data:`VARIANT_TASKS`): its input file drawn from
    ``random.Random(seed)`` (``sum_pair``: operands in 0..``max_operand``), the reference's
    ``write_file`` contents set to the instance's answer."""
    if name not in _GENERATORS:
        raise ValueError(f"agentic task {name!r} has no variants; tasks with variants: {', '.join(VARIANT_TASKS)}")
    base = load_task(name)
    files, answers = _GENERATORS[name](random.Random(seed), max_operand)
    reference = tuple({**call, "arguments": {**call["arguments"], "content": answers[call["arguments"]["path"]]}}
                      if call["name"] == "write_file" and call["arguments"].get("path") in answers else call
                      for call in base.reference)
    key = ",".join(f"{k}={v.strip()}" for k, v in sorted(files.items()))
    return replace(base, reference=reference, files=files, variant=key)


def variant_split(task: AgenticTask, eval_fraction: float = 0.2) -> str:
    """'eval' for the instances whose content hashes into the first ``eval_fraction`` of the hash
    range, else 'train': the split is a property of the instance, so no seed draws a held-out
    instance into training."""
    digest = hashlib.sha256(f"{task.name}:{task.variant}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < eval_fraction * 2 ** 64 else "train"


def task_variants(names: list[str] | tuple[str, ...], split: str, count: int, seed: int, *,
                  max_operand: int = 99, distinct: bool = False) -> list[AgenticTask]:
    """``count`` instances of ``split``, the tasks ``names`` taking turns, drawn from seeds
    ``seed, seed + 1, ...`` keeping those of ``split``; ``distinct``: no instance twice (a
    held-out set). Tasks without variants (:data:`VARIANT_TASKS`) appear as stored, in ``train``
    only."""
    out, seen, k = [], set(), 0
    stale = dict.fromkeys(names, 0)  # draws of a task since its last new distinct instance
    fixed = [n for n in names if n not in _GENERATORS]
    if split == "eval" and fixed:
        raise ValueError(f"agentic tasks {fixed} have no variants, so none of their instances is held out")
    space = {"sum_pair": (max_operand + 1) ** 2, "copy_word": len(LETTERS) ** WORD_LENGTH,
             "spot_seven": len(NOT_SEVEN) ** SEVEN_DIGITS + SEVEN_DIGITS * len(NOT_SEVEN) ** (SEVEN_DIGITS - 1)}
    while len(out) < count:
        name = names[len(out) % len(names)]
        if name in fixed:
            out.append(load_task(name))
            continue
        task = task_variant(name, seed * 1_000_003 + k, max_operand=max_operand)
        k += 1
        if variant_split(task) == split and not (distinct and (name, task.variant) in seen):
            seen.add((name, task.variant))
            out.append(task)
            stale[name] = 0
            continue
        stale[name] += 1
        # distinct: 20x the task's space in draws without a new instance of the split leaves one
        # unseen at odds ~e^-20, so the split is exhausted (not 200 draws per asked-for instance)
        if k > 200 * max(count, 1) or (distinct and stale[name] > 20 * space[name]):
            raise ValueError(f"agentic tasks {list(names)}: fewer than {count} distinct {split} instances exist")
    return out
