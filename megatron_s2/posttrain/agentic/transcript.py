"""An agentic episode's transcript: messages labelled policy (trainable) or not.

Only the policy's own answers are trainable; system and user messages and tool observations are
context (walkthrough Ch. 6: "never imitate the environment"). Each assistant segment keeps its
parsed tool calls and their outcomes, which is all the process annotator needs.

:meth:`Segment.message` is the canonical chat message (an assistant's calls as ``tool_calls``, an
observation as a ``tool`` message naming its call), so a transcript renders through the chat
template exactly as a harness's conversation does through the gateway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from megatron_s2.posttrain.agentic.tools import ParsedTurn, ToolResult, strip_calls

__all__ = ["Segment"]


@dataclass
class Segment:
    """One message of the transcript."""

    role: str
    """'system', 'user', 'assistant' or 'tool'."""
    text: str
    parsed: ParsedTurn | None = None
    """assistant: its tool calls and malformed blocks."""
    results: list[ToolResult] = field(default_factory=list)
    """assistant: the outcome of each of its calls, in order."""
    stop: str | None = None
    """assistant: 'turn_limit', 'context_limit' or 'session_limit' when the session was cut after it."""
    call_id: str = ""
    """tool: the id of the call this observes ('' for an error about a malformed answer); assistant:
    the prefix of its calls' ids (``<call_id>-<k>``)."""

    @property
    def trainable(self) -> bool:
        """Policy-generated (label 'policy'); everything else is an observation (label 'observation')."""
        return self.role == "assistant"

    @property
    def label(self) -> str:
        return "policy" if self.trainable else "observation"

    def message(self) -> dict:
        """The canonical chat message for the policy's next context (module docstring). An answer
        with a malformed call stays text, as the gateway relays it."""
        parsed = self.parsed
        if self.role == "assistant" and parsed is not None and parsed.calls and not parsed.malformed:
            calls = [{"id": f"{self.call_id}-{k}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for k, c in enumerate(parsed.calls)]
            return {"role": "assistant", "content": strip_calls(self.text), "tool_calls": calls}
        message = {"role": self.role, "content": self.text}
        if self.role == "tool" and self.call_id:
            message["tool_call_id"] = self.call_id
        return message
