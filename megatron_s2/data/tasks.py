"""Synthetic verifiable tasks: the project's embedded default data (no download).

Every task keeps three things apart, so that the same task serves pretraining, SFT and RL:

* ``sample(rng) -> TaskSample(prompt, answer, task)`` draws one problem from a
  :class:`random.Random` (deterministic for a seed);
* the *answer* is the reference solution the supervised phases train on;
* ``verify(prompt, response) -> bool`` is an exact verifier of a *model response*: it parses
  the prompt and recomputes the solution (the sum, the sorted list, the bracket balance), so
  it does not need the stored answer. Surrounding whitespace of the response is ignored;
  anything else must match exactly (no leading zeros, no extra text).

Prompt formats (a one-turn chat: the answer is the assistant message; ``<sep>`` with the
character tokenizer):

==============  ====================  ==========
task            prompt                answer
==============  ====================  ==========
addition        ``123+4567``          ``4690``
multiplication  ``12*345``            ``4140``
sort            ``sort:31415``        ``11345``
copy            ``copy:aB3``          ``aB3``
reverse         ``reverse:aB3``       ``3Ba``
brackets        ``balanced:([)]``     ``no``
==============  ====================  ==========

Difficulty knobs come from :class:`~megatron_s2.config.data.TaskDifficulty`; tasks are built
by name through :data:`TASK_REGISTRY`.
"""

from __future__ import annotations

import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_s2.config.data import TaskDifficulty
from megatron_s2.data.errors import DataError

__all__ = [
    "TaskSample", "Task", "AdditionTask", "MultiplicationTask", "SortTask", "CopyTask",
    "ReverseTask", "BracketsTask", "TASK_REGISTRY", "build_task", "build_tasks", "is_balanced",
]

_ALPHANUMERIC = string.ascii_letters + string.digits
_BRACKET_PAIRS = {")": "(", "]": "[", "}": "{", ">": "<"}
_BRACKETS = "()[]{}<>"


@dataclass(frozen=True)
class TaskSample:
    """One problem: the prompt shown to the model, its reference answer, the task's name."""

    prompt: str
    answer: str
    task: str


class Task(ABC):
    """A verifiable task: a sampler of problems plus an exact checker of responses."""

    name: str = ""
    """Registry name; also stored in every :class:`TaskSample`."""
    pattern: re.Pattern = re.compile("")
    """Full-match pattern of the prompt; its groups are the problem's operands."""
    prompt_format: str = ""
    """Human-readable prompt format, quoted when a prompt does not parse."""

    @abstractmethod
    def sample(self, rng: random.Random) -> TaskSample:
        """Draw one problem."""

    @property
    @abstractmethod
    def max_prompt_chars(self) -> int:
        """Characters (ASCII) of the longest prompt :meth:`sample` can draw at this difficulty."""

    @abstractmethod
    def solve(self, *operands: str) -> str:
        """The exact answer for the operands parsed from a prompt."""

    def verify(self, prompt: str, response: str) -> bool:
        """True iff ``response`` (whitespace-stripped) solves ``prompt`` exactly."""
        return response.strip() == self.solve(*self.parse(prompt))

    def parse(self, prompt: str) -> tuple[str, ...]:
        match = self.pattern.fullmatch(prompt)
        if match is None:
            raise DataError(f"task '{self.name}': prompt {prompt!r} does not match the format "
                            f"{self.prompt_format!r}; verify only prompts this task generated")
        return match.groups()

    def _make(self, prompt: str, *operands: str) -> TaskSample:
        return TaskSample(prompt=prompt, answer=self.solve(*operands), task=self.name)


def _random_number(rng: random.Random, max_digits: int) -> int:
    """Digit count uniform in 1..max_digits, then a uniform number with that many digits."""
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


class AdditionTask(Task):
    name = "addition"
    pattern = re.compile(r"(\d+)\+(\d+)")
    prompt_format = "A+B"

    def __init__(self, max_digits: int) -> None:
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> TaskSample:
        a, b = (str(_random_number(rng, self.max_digits)) for _ in range(2))
        return self._make(f"{a}+{b}", a, b)

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.max_digits + 1

    def solve(self, a: str, b: str) -> str:
        return str(int(a) + int(b))


class MultiplicationTask(Task):
    name = "multiplication"
    pattern = re.compile(r"(\d+)\*(\d+)")
    prompt_format = "A*B"

    def __init__(self, max_digits: int) -> None:
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> TaskSample:
        a, b = (str(_random_number(rng, self.max_digits)) for _ in range(2))
        return self._make(f"{a}*{b}", a, b)

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.max_digits + 1

    def solve(self, a: str, b: str) -> str:
        return str(int(a) * int(b))


class SortTask(Task):
    """Sort a run of digits or of lowercase letters (ASCII order)."""

    name = "sort"
    pattern = re.compile(r"sort:([0-9]+|[a-z]+)")
    prompt_format = "sort:SYMBOLS (digits or lowercase letters)"

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def sample(self, rng: random.Random) -> TaskSample:
        symbols = rng.choice((string.digits, string.ascii_lowercase))
        items = "".join(rng.choice(symbols) for _ in range(rng.randint(1, self.max_length)))
        return self._make(f"sort:{items}", items)

    @property
    def max_prompt_chars(self) -> int:
        return len("sort:") + self.max_length

    def solve(self, items: str) -> str:
        return "".join(sorted(items))


class CopyTask(Task):
    name = "copy"
    pattern = re.compile(r"copy:([A-Za-z0-9]+)")
    prompt_format = "copy:TEXT (letters and digits)"

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def sample(self, rng: random.Random) -> TaskSample:
        text = "".join(rng.choice(_ALPHANUMERIC) for _ in range(rng.randint(1, self.max_length)))
        return self._make(f"{self.name}:{text}", text)

    @property
    def max_prompt_chars(self) -> int:
        return len(self.name) + 1 + self.max_length

    def solve(self, text: str) -> str:
        return text


class ReverseTask(CopyTask):
    name = "reverse"
    pattern = re.compile(r"reverse:([A-Za-z0-9]+)")
    prompt_format = "reverse:TEXT (letters and digits)"

    def solve(self, text: str) -> str:
        return text[::-1]


def is_balanced(brackets: str) -> bool:
    """Whether every bracket of ``()[]{}<>`` is closed by its own kind, properly nested."""
    stack = []
    for char in brackets:
        if char in _BRACKET_PAIRS:
            if not stack or stack.pop() != _BRACKET_PAIRS[char]:
                return False
        else:
            stack.append(char)
    return not stack


class BracketsTask(Task):
    """Classify a bracket string as balanced ('yes') or not ('no'), half of each.

    Unbalanced strings are near misses: a balanced string with one bracket replaced by a
    different one, which always breaks the balance and keeps the length even, so neither
    parity nor counting alone solves the task."""

    name = "brackets"
    pattern = re.compile(r"balanced:([()\[\]{}<>]+)")
    prompt_format = "balanced:BRACKETS (any of ()[]{}<>)"

    def __init__(self, max_length: int) -> None:
        self.max_pairs = max_length // 2

    def sample(self, rng: random.Random) -> TaskSample:
        chars = self._balanced(rng, rng.randint(1, self.max_pairs))
        if rng.random() < 0.5:
            position = rng.randrange(len(chars))
            chars[position] = rng.choice([c for c in _BRACKETS if c != chars[position]])
        text = "".join(chars)
        return self._make(f"balanced:{text}", text)

    @property
    def max_prompt_chars(self) -> int:
        return len("balanced:") + 2 * self.max_pairs

    @staticmethod
    def _balanced(rng: random.Random, pairs: int) -> list[str]:
        out, stack, opens_left = [], [], pairs
        while opens_left or stack:
            if opens_left and (not stack or rng.random() < 0.5):
                opener = rng.choice("([{<")
                stack.append(opener)
                out.append(opener)
                opens_left -= 1
            else:
                out.append(_BRACKETS[_BRACKETS.index(stack.pop()) + 1])
        return out

    def solve(self, brackets: str) -> str:
        return "yes" if is_balanced(brackets) else "no"


TASK_REGISTRY: dict[str, Callable[[TaskDifficulty], Task]] = {
    "addition": lambda d: AdditionTask(d.addition_max_digits),
    "multiplication": lambda d: MultiplicationTask(d.multiplication_max_digits),
    "sort": lambda d: SortTask(d.sort_max_length),
    "copy": lambda d: CopyTask(d.string_max_length),
    "reverse": lambda d: ReverseTask(d.string_max_length),
    "brackets": lambda d: BracketsTask(d.brackets_max_length),
}
"""Task name -> factory from difficulty knobs; keys equal ``config.data.TASK_NAMES``."""


def build_task(name: str, difficulty: TaskDifficulty | None = None) -> Task:
    """The task registered as ``name``, at the given (default) difficulty."""
    if name not in TASK_REGISTRY:
        raise DataError(f"unknown task '{name}'; valid names: {', '.join(TASK_REGISTRY)}")
    return TASK_REGISTRY[name](difficulty or TaskDifficulty())


def build_tasks(names: Sequence[str], difficulty: TaskDifficulty | None = None) -> list[Task]:
    """Tasks for ``names``, in that order."""
    return [build_task(name, difficulty) for name in names]
