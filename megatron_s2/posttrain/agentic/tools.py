"""The agent's tools inside its sandbox, and the one tool-call format a policy writes.

**The format** is the chat template's (V4-style, report §5.1.4; :mod:`megatron_s2.data.chat_format`),
the same the gateway parses from sampled token ids (:mod:`megatron_s2.serve.gateway.tool_format`)::

    {text}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments: a JSON object}<｜tool▁call▁end｜>
        ...<｜tool▁calls▁end｜>

so an episode played by the in-process runner (:mod:`.runner`, a ``messages -> text`` policy) and
one played by a third-party harness through the gateway (:mod:`.harnesses`) hold the same tokens
for the same action, and the trainable labels of both are the policy's sampled ids. The runner
reads the text form (:func:`parse_tool_calls`); the gateway reads the same grammar on token ids
and hands harnesses native tool calls; either way the rules are the gateway's: a call whose name
is empty or whose arguments are not a JSON object is malformed. Several calls may follow one
another in one answer; they run in order and each returns an observation as text. The tools,
as JSON-schema function tools (:func:`tool_schemas`) every harness exposes natively:

* ``bash(command)`` — ``/bin/sh -c`` in the workspace (limits: ``sandbox.*``);
* ``read_file(path)`` / ``write_file(path, content)`` — workspace files;
* ``submit()`` — the agent is done; grading follows.

:func:`parse_tool_calls` is deliberately strict because the process annotator (:mod:`.annotator`)
weighs exactly these facts (walkthrough Ch. 7: "either the JSON parsed or it did not; either the
tool name is in the registry or it is not").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megatron_s2.data.chat_format import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP
from megatron_s2.posttrain.agentic.sandbox import Sandbox

__all__ = ["TOOLS", "ToolCall", "ParsedTurn", "ToolResult", "parse_tool_calls", "execute", "format_call",
           "tools_prompt", "tool_schemas", "strip_calls", "malformed_observation"]

TOOLS: dict[str, dict] = {
    "bash": {"description": "Run a shell command in the workspace; returns exit code, stdout and stderr.",
             "parameters": {"command": "string"}},
    "read_file": {"description": "Read a text file of the workspace.", "parameters": {"path": "string"}},
    "write_file": {"description": "Create or overwrite a text file of the workspace.",
                   "parameters": {"path": "string", "content": "string"}},
    "submit": {"description": "Finish the task; your workspace is then graded.", "parameters": {}},
}

_CALL = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_SEP) + r"(.*?)" + re.escape(TOOL_CALL_END),
                   re.DOTALL)
_MARKERS = re.compile("|".join(re.escape(m) for m in (TOOL_CALLS_BEGIN, TOOL_CALLS_END)))


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
    """Why each malformed call (or an answer without any call) is malformed."""


@dataclass
class ToolResult:
    observation: str
    """The text the policy sees next."""
    ok: bool
    """False: unknown tool, bad arguments, non-zero exit, timeout, or an unreadable file."""
    done: bool = False
    """``submit`` was called."""


def parse_tool_calls(text: str) -> ParsedTurn:
    """The calls of an answer in the format of the module docstring (the gateway's rules)."""
    turn = ParsedTurn()
    blocks = _CALL.findall(text)
    if not blocks:
        turn.malformed.append("no tool call" if TOOL_CALL_BEGIN not in text else "unterminated tool call")
        return turn
    for name, body in blocks:
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError as exc:
            turn.malformed.append(f"tool call arguments are not JSON ({exc.msg})")
            continue
        if not name.strip() or not isinstance(arguments, dict):
            turn.malformed.append("a tool call needs a name and a JSON object of arguments")
            continue
        turn.calls.append(ToolCall(name.strip(), arguments))
    return turn


def strip_calls(text: str) -> str:
    """An answer's text without its tool calls (the ``content`` a protocol relays beside them)."""
    return _MARKERS.sub("", _CALL.sub("", text))


def format_call(name: str, arguments: dict) -> str:
    """A tool call in the format :func:`parse_tool_calls` reads — the chat template's rendering of
    an assistant ``tool_calls`` entry, arguments spelled as the gateway spells them."""
    return (f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}{name}{TOOL_SEP}{json.dumps(arguments, ensure_ascii=False)}"
            f"{TOOL_CALL_END}{TOOL_CALLS_END}")


def malformed_observation(reason: str) -> str:
    """What an episode answers to an answer without a well-formed call (no format markers in it:
    an observation never spells the policy's special tokens)."""
    return f"error: {reason}; call one of the tools ({', '.join(TOOLS)}), or submit when you are done"


def tool_schemas() -> list[dict]:
    """The tools as OpenAI function tools (JSON schema): what every harness declares, and what the
    chat template lists in the prompt's ``## Tools`` header."""
    return [{"type": "function", "function": {
        "name": name, "description": spec["description"],
        "parameters": {"type": "object", "properties": {p: {"type": t} for p, t in spec["parameters"].items()},
                       "required": list(spec["parameters"])}}} for name, spec in TOOLS.items()]


def tools_prompt() -> str:
    """The system message of an episode: the situation and the tools (their schemas also reach the
    prompt through the chat template's tools header when a harness declares them)."""
    lines = ["You are working in a sandboxed workspace. Tools:"]
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
