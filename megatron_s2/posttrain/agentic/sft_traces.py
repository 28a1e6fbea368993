"""Scripted tool-call conversations for a short SFT before agentic RL (issue 25, "a rising curve").

A tiny policy has to know the one tool-call format (:mod:`.tools`) before RL can reward it. This
plays a task's scripted calls (its reference solution by default) with the in-process runner in a
real sandbox, checks that the episode is graded 1, and returns the conversation in the canonical
chat form a ``data.kind: chat`` recipe reads (``{"messages"}``, :mod:`megatron_s2.data.chat`):
the same system prompt (the tools named once, no JSON schemas), ``tool_calls`` and tool
observations the ``builtin`` harness sends through the gateway, so the chat template renders SFT targets with exactly the tokens the
gateway later captures as the policy's (the observations are the sandbox's real outputs).
With ``declare_tools`` each record also carries the tools' JSON schemas (``"tools"``:
:func:`~.tools.tool_schemas`), as the ``anthropic`` and ``openai_agents`` harnesses declare them:
the chat template then lists them in the prompt's ``## Tools`` header, as the gateway renders
those harnesses' requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megatron_s2.posttrain.agentic.runner import run_episode, scripted_policy
from megatron_s2.posttrain.agentic.sandbox import SandboxRuntime
from megatron_s2.posttrain.agentic.tasks import AgenticTask
from megatron_s2.posttrain.agentic.tools import tool_schemas

__all__ = ["scripted_conversation", "write_sft_jsonl"]


def scripted_conversation(task: AgenticTask, runtime: SandboxRuntime, calls: Sequence[dict] | None = None, *,
                          declare_tools: bool = False) -> dict:
    """The conversation of ``calls`` (default: the reference) played on ``task`` (module docstring);
    ValueError when it does not solve the task (SFT must not imitate a failure)."""
    result = run_episode(task, scripted_policy(task.reference if calls is None else calls), runtime)
    if result.reward != 1.0:
        raise ValueError(f"{task.name}: the scripted calls score {result.reward} ({result.status}); SFT traces must "
                         "solve the task")
    record = {"messages": [segment.message() for segment in result.transcript]}
    return {**record, "tools": tool_schemas()} if declare_tools else record


def write_sft_jsonl(path: str | Path, tasks: Sequence[AgenticTask], runtime: SandboxRuntime, copies: int = 1, *,
                    declare_tools: bool = False) -> int:
    """``copies`` scripted conversations of each task, one JSON object a line; returns the count."""
    lines = [json.dumps(scripted_conversation(task, runtime, declare_tools=declare_tools), ensure_ascii=False)
             for task in tasks]
    Path(path).write_text("".join(line + "\n" for line in lines * copies), encoding="utf-8")
    return len(lines) * copies
