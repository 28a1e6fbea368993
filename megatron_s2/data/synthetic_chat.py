"""Synthetic multi-turn chat conversations from the verifiable tasks (the tiny SFT data).

Each conversation draws 1-3 task problems (:mod:`.synthetic`) and asks them in turn, with
every role the chat format has: an optional system prompt, user questions, assistant answers
(some with a short ``reasoning_content``), and for arithmetic an assistant tool call to a
``calculator`` tool, the tool's output message and the final answer. About half the
conversations carry a §5.1.4 ``reasoning_effort``. Deterministic in the seed;
``tools/make_chat_data.py`` writes them as jsonl (``recipes/data/tiny_chat.jsonl``).
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from megatron_s2.config.data import TASK_NAMES, TaskDifficulty
from megatron_s2.data.synthetic import sample_problems
from megatron_s2.data.tasks import build_tasks

__all__ = ["CALCULATOR_TOOL", "synthetic_conversations"]

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
