"""An agentic episode's transcript: messages labelled policy (trainable) or not.

Only the policy's own answers are trainable; system and user messages and tool observations are
context (walkthrough Ch. 6: "never imitate the environment"). Each assistant segment keeps its
parsed tool calls and their outcomes, which is all the process annotator needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_s2.posttrain.agentic.tools import ParsedTurn, ToolResult

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

    @property
    def trainable(self) -> bool:
        """Policy-generated (label 'policy'); everything else is an observation (label 'observation')."""
        return self.role == "assistant"

    @property
    def label(self) -> str:
        return "policy" if self.trainable else "observation"

    def message(self) -> dict:
        """Chat-format message (``{"role", "content"}``) for the policy's next context."""
        return {"role": self.role, "content": self.text}
