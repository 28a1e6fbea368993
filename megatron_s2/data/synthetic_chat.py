"""Synthetic multi-turn chat conversations from the verifiable tasks (the tiny SFT data).

Each conversation draws 1-3 task problems (:mod:`.synthetic`) and asks them in turn, with
every role the chat format has: an optional system prompt, user questions, assistant answers
(some with a short ``reasoning_content``), and for arithmetic an assistant tool call to a
``calculator`` tool, the tool's output message and the final answer. About half the
conversations carry a §5.1.4 ``reasoning_effort``. Deterministic in the seed;
``tools/make_chat_data.py`` writes them as jsonl (``recipes/data/tiny_chat.jsonl``).

:func:`retry_conversations` writes the SFT data of a retry environment instead (the verifiers
``megatron_s2_retry`` taskset): one task asked (under its system prompt, if any), answered right, or —
in a ``retry_fraction`` of the conversations — first with a near miss kept as context only
(``"weight": 0``), the environment's feedback, then the right answer
(``recipes/data/addition_retry_chat.jsonl``).
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from megatron_s2.config.data import TASK_NAMES, TaskDifficulty
from megatron_s2.data.synthetic import sample_problems
from megatron_s2.data.tasks import build_tasks

__all__ = ["CALCULATOR_TOOL", "retry_conversations", "synthetic_conversations"]

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an integer expression with + and *.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_SYSTEM = ("You are a careful assistant. Answer with the result only.", "Solve the task.", "")


def synthetic_conversations(count: int, seed: int) -> Iterator[dict[str, Any]]:
    """``count`` chat records ``{"messages", "tools"?, "reasoning_effort"?}``."""
    rng = random.Random(seed)
    problems = iter(sample_problems(build_tasks(TASK_NAMES, TaskDifficulty(addition_max_digits=3)), 3 * count, seed))
    for _ in range(count):
        messages: list[dict[str, Any]] = []
        system = rng.choice(_SYSTEM)
        if system:
            messages.append({"role": "system", "content": system})
        record: dict[str, Any] = {"messages": messages}
        for _ in range(rng.randint(1, 3)):
            problem = next(problems)
            messages.append({"role": "user", "content": problem.prompt})
            arithmetic = any(op in problem.prompt for op in "+*") and ":" not in problem.prompt
            if arithmetic and rng.random() < 0.5:
                record["tools"] = [CALCULATOR_TOOL]
                call = {"type": "function", "function": {"name": "calculator",
                                                         "arguments": {"expression": problem.prompt}}}
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": problem.answer}]
            answer = {"role": "assistant", "content": problem.answer}
            if rng.random() < 0.3:
                answer["reasoning_content"] = f"{problem.prompt} gives {problem.answer}"
            messages.append(answer)
        if rng.random() < 0.5:
            record["reasoning_effort"] = rng.choice((25, 50, 75, 100))
        yield record


def _near_miss(answer: str, rng: random.Random) -> str:
    """A plausible wrong integer answer: off by one, two, ten or a dropped carry."""
    value = int(answer)
    for _ in range(16):
        wrong = value + rng.choice((1, 2, 10, 9, 11)) * rng.choice((-1, 1))
        if wrong >= 0 and wrong != value:
            return str(wrong)
    return str(value + 1)


def retry_conversations(task: str, difficulty: TaskDifficulty, count: int, seed: int, *, retry_fraction: float,
                        system_prompt: str, feedback: str) -> Iterator[dict[str, Any]]:
    """``count`` records ``{"messages"}`` of ``task`` (integer answers): ``[system, user, assistant]``,
    or with probability ``retry_fraction`` ``[system, user, assistant (a near miss, weight 0), user
    (feedback), assistant (the answer)]`` (no system message when ``system_prompt`` is '').
    Deterministic in ``seed``."""
    if not 0.0 <= retry_fraction <= 1.0:
        raise ValueError(f"retry_fraction: must be in [0, 1], got {retry_fraction}")
    rng = random.Random(1_000_003 * seed + 17)  # not the problems' own stream (sample_problems(seed))
    (built,) = build_tasks((task,), difficulty)
    for problem in sample_problems([built], count, seed):
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": problem.prompt})
        if rng.random() < retry_fraction:
            messages += [{"role": "assistant", "content": _near_miss(problem.answer, rng), "weight": 0},
                         {"role": "user", "content": feedback}]
        messages.append({"role": "assistant", "content": problem.answer})
        yield {"messages": messages}
