"""The agent's tools inside its sandbox, and the tool-call format a policy writes.

A policy answers in text; each tool call is a Hermes-style block (the format of Qwen/Hermes
chat templates and of most open tool-calling models)::

    <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>

Several blocks may follow one another in one answer; they run in order and each returns an
observation as text. Tools:

* ``bash(command)`` — ``/bin/sh -c`` in the workspace (limits: ``sandbox.*``);
* ``read_file(path)`` / ``write_file(path, content)`` — workspace files;
* ``submit()`` — the agent is done; grading follows.

:func:`parse_tool_calls` is deliberately strict — a block that is not a JSON object with a string
``name`` and an object ``arguments`` is *malformed* — because the process annotator
(:mod:`.annotator`) weighs exactly these facts (walkthrough Ch. 7: "either the JSON parsed or it
did not; either the tool name is in the registry or it is not").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megatron_s2.posttrain.agentic.sandbox import Sandbox

__all__ = ["TOOLS", "ToolCall", "ParsedTurn", "ToolResult", "parse_tool_calls", "execute", "format_call",
           "tools_prompt"]

TOOLS: dict[str, dict] = {
    "bash": {"description": "Run a shell command in the workspace; returns exit code, stdout and stderr.",
             "parameters": {"command": "string"}},
    "read_file": {"description": "Read a text file of the workspace.", "parameters": {"path": "string"}},
    "write_file": {"description": "Create or overwrite a text file of the workspace.",
                   "parameters": {"path": "string", "content": "string"}},
    "submit": {"description": "Finish the task; your workspace is then graded.", "parameters": {}},
}

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def key(self) -> str:
        """Identity of the call (name + canonical arguments): what "the same call again" means."""
        return json.dumps([self.name, self.arguments], sort_keys=True)


@dataclass
class ParsedTurn:
    """The tool calls of one assistant answer, and whether any part of it was malformed."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """Why each malformed block (or an answer without any block) is malformed."""


@dataclass
class ToolResult:
    observation: str
    """The text the policy sees next."""
    ok: bool
    """False: unknown tool, bad arguments, non-zero exit, timeout, or an unreadable file."""
    done: bool = False
    """``submit`` was called."""


def parse_tool_calls(text: str) -> ParsedTurn:
    turn = ParsedTurn()
    blocks = _BLOCK.findall(text)
    if not blocks:
        turn.malformed.append("no <tool_call> block" if "<tool_call>" not in text else "unterminated <tool_call>")
        return turn
    for body in blocks:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            turn.malformed.append(f"tool call is not JSON ({exc.msg})")
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            turn.malformed.append('tool call must be {"name": <string>, "arguments": <object>}')
            continue
        turn.calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return turn


def format_call(name: str, arguments: dict) -> str:
    """A tool call in the format :func:`parse_tool_calls` reads."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tools_prompt() -> str:
    """The system message that tells a policy its tools and the call format."""
    lines = ["You are working in a sandboxed workspace. Call tools with",
             '<tool_call>{"name": <tool>, "arguments": {...}}</tool_call>', "Tools:"]
    for name, spec in TOOLS.items():
        params = ", ".join(f"{k}: {v}" for k, v in spec["parameters"].items())
        lines.append(f"- {name}({params}): {spec['description']}")
    lines.append("Call submit when you are done.")
    return "\n".join(lines)


def _missing(call: ToolCall) -> str | None:
    for param in TOOLS[call.name]["parameters"]:
        if not isinstance(call.arguments.get(param), str):
            return f"error: {call.name} needs a string argument '{param}'"
    return None


def execute(call: ToolCall, box: Sandbox) -> ToolResult:
    """Run one tool call in ``box``; the observation is text, errors included (never raises for
    the agent's mistakes; a dead sandbox raises :class:`~.sandbox.SandboxCrashed`)."""
    if call.name not in TOOLS:
        return ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(TOOLS)}", ok=False)
    if (problem := _missing(call)) is not None:
        return ToolResult(problem, ok=False)
    if call.name == "submit":
        return ToolResult("submitted", ok=True, done=True)
    if call.name == "bash":
        r = box.run(call.arguments["command"])
        text = f"exit: {r.exit_code} ({r.status})\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        return ToolResult(text, ok=r.status == "ok")
    try:
        if call.name == "read_file":
            return ToolResult(box.read_file(call.arguments["path"]), ok=True)
        box.write_file(call.arguments["path"], call.arguments["content"])
        return ToolResult(f"wrote {call.arguments['path']}", ok=True)
    except (OSError, ValueError) as exc:
        return ToolResult(f"error: {exc}", ok=False)
