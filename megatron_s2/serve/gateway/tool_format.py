"""Sampled token ids -> text, reasoning and tool calls: the one output format of the gateway.

The declared format is the one the tokenizer's chat template renders (V4-style, report §5.1.4;
:mod:`megatron_s2.data.chat_format`), so a parsed turn renders back into the next prompt through
the same template, whichever protocol carried it (Intern-S2 walkthrough Ch. 6, "Three protocols,
one service")::

    [<think>{reasoning}</think>]{text}[<｜tool▁calls▁begin｜>
        <｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments: a JSON object}<｜tool▁call▁end｜> ...
    <｜tool▁calls▁end｜>]<｜end▁of▁sentence｜>

The markers are single special tokens, so the parser works on ids, one token at a time — the
same code streams (events as tokens arrive) and answers whole responses, and text can never be
mistaken for a marker. A call whose name is empty or whose arguments are not a JSON object is
malformed: it is relayed as text (``<name><arguments>``), never as a call (an annotator of
Ch. 7 sees it as malformed output). Special tokens other than the markers are left out of the
text, as the chat endpoint does. A tokenizer without these specials serves no tool calls
(:func:`OutputParser.supported`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from megatron_s2.serve.text import TextStream

__all__ = ["TextDelta", "ToolCall", "OutputParser", "canonical_arguments", "MARKERS"]

MARKERS = ("think_begin", "think_end", "tool_calls_begin", "tool_call_begin", "tool_sep", "tool_call_end",
           "tool_calls_end")
"""The special tokens of the format, by their ``tokenizer.special_ids`` names."""


@dataclass
class TextDelta:
    """New text of the answer (``kind`` "text") or of its reasoning (``kind`` "reasoning")."""

    kind: str
    text: str


@dataclass
class ToolCall:
    """One complete tool call: ``arguments`` is the canonical JSON text of an object."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or uuid.uuid4().hex[:24]

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


def canonical_arguments(arguments) -> str:
    """The one spelling of a call's arguments in every prompt: ``json.dumps`` of the parsed
    object (Chat Completions and Responses carry a string, Messages an object; all render alike).
    Text that is not JSON is kept as it is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False)


class OutputParser:
    """Incremental parser of one response's token ids (module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = tokenizer.special_ids
        self.marker = {ids[name]: name for name in MARKERS}
        self.state = "text"
        self.stream = TextStream(tokenizer)
        self.name = ""
        self.calls: list[ToolCall] = []
        self.text = {"text": "", "reasoning": ""}

    @staticmethod
    def supported(tokenizer) -> bool:
        ids = getattr(tokenizer, "special_ids", None)
        return isinstance(ids, dict) and all(name in ids for name in MARKERS)

    def push(self, token_ids, last: bool = False) -> list:
        """Events (:class:`TextDelta`, :class:`ToolCall`) of the new tokens; ``last`` flushes."""
        events: list = []
        for token in token_ids:
            marker = self.marker.get(int(token))
            if marker is None:
                self._take(self.stream.push([int(token)]), events)
                continue
            self._take(self.stream.finish(), events)  # a marker ends the run: its text is whole
            self._on_marker(marker, events)
        if last:
            self._take(self.stream.finish(), events)
            events += self._close()
        return events

    # ---- internals ---------------------------------------------------------------------------
    def _take(self, delta: str, events: list) -> None:
        """Relay a run's new text: answer text (also stray text between calls) or reasoning; a
        call's name and arguments stay in the run until the call is complete."""
        if not delta or self.state in ("name", "arguments"):
            return
        events.append(self._emit("reasoning" if self.state == "reasoning" else "text", delta))

    def _emit(self, kind: str, text: str) -> TextDelta:
        self.text[kind] += text
        return TextDelta(kind, text)

    def _new_run(self) -> None:
        self.stream = TextStream(self.tokenizer)

    def _run_text(self) -> str:
        self.stream.finish()
        return self.stream.sent

    def _on_marker(self, marker: str, events: list) -> None:
        if marker == "think_begin" and self.state == "text":
            self.state = "reasoning"
        elif marker == "think_end" and self.state == "reasoning":
            self.state = "text"
        elif marker == "tool_calls_begin" and self.state == "text":
            self.state = "calls"
        elif marker == "tool_call_begin" and self.state in ("calls", "text"):
            self.state = "name"
        elif marker == "tool_sep" and self.state == "name":
            self.name = self._run_text().strip()
            self.state = "arguments"
        elif marker == "tool_call_end" and self.state == "arguments":
            events.append(self._finish_call(self._run_text()))
            self.state = "calls"
        elif marker == "tool_calls_end" and self.state == "calls":
            self.state = "text"
        # any other marker where it does not belong is dropped, as other specials are
        self._new_run()

    def _finish_call(self, arguments: str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not self.name or not isinstance(parsed, dict):
            return self._emit("text", self.name + arguments)
        call = ToolCall(self.name, json.dumps(parsed, ensure_ascii=False))
        self.calls.append(call)
        return call

    def _close(self) -> list:
        """An unfinished call at the end (a length stop) is relayed as text."""
        if self.state == "name":
            return [self._emit("text", self._run_text())] if self._run_text() else []
        if self.state == "arguments":
            return [self._emit("text", self.name + self._run_text())]
        return []
