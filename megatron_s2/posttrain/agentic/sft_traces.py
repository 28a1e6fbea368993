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
those harnesses' requests. ``answer_weight`` (other than 1) gives every assistant turn that calls
``write_file`` (the turn that writes the answer, e.g. spot_seven's yes/no) that chat ``"weight"``:
its tokens count that many times in the SFT loss (:mod:`megatron_s2.data.chat`), so the one decision
token is not drowned by the protocol tokens around it.
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


ANSWER_TOOL = "write_file"
"""The tool whose calls write a task's answer (the turns ``answer_weight`` weights)."""


def scripted_conversation(task: AgenticTask, runtime: SandboxRuntime, calls: Sequence[dict] | None = None, *,
                          declare_tools: bool = False, answer_weight: float = 1) -> dict:
    """The conversation of ``calls`` (default: the reference) played on ``task`` (module docstring);
    ValueError when it does not solve the task (SFT must not imitate a failure)."""
    result = run_episode(task, scripted_policy(task.reference if calls is None else calls), runtime)
    if result.reward != 1.0:
        raise ValueError(f"{task.name}: the scripted calls score {result.reward} ({result.status}); SFT traces must "
                         "solve the task")
    messages = [segment.message() for segment in result.transcript]
    if answer_weight != 1:
        messages = [{**m, "weight": answer_weight} if _calls(m, ANSWER_TOOL) else m for m in messages]
    record = {"messages": messages}
    return {**record, "tools": tool_schemas()} if declare_tools else record


def _calls(message: dict, tool: str) -> bool:
    return message["role"] == "assistant" and any(c["function"]["name"] == tool for c in message.get("tool_calls") or ())


def write_sft_jsonl(path: str | Path, tasks: Sequence[AgenticTask], runtime: SandboxRuntime, copies: int = 1, *,
                    declare_tools: bool = False, answer_weight: float = 1) -> int:
    """``copies`` scripted conversations of each task, one JSON object a line; returns the count."""
    from megatron_s2.data.chat import MAX_MESSAGE_WEIGHT

    if isinstance(answer_weight, bool) or not 0 <= answer_weight <= MAX_MESSAGE_WEIGHT:
        raise ValueError(f"answer_weight: expected a number from 0 to {MAX_MESSAGE_WEIGHT:g} (the answer turns' loss "
                         f"weight), got {answer_weight!r}")
    lines = [json.dumps(scripted_conversation(task, runtime, declare_tools=declare_tools, answer_weight=answer_weight),
                        ensure_ascii=False) for task in tasks]
    Path(path).write_text("".join(line + "\n" for line in lines * copies), encoding="utf-8")
    return len(lines) * copies
