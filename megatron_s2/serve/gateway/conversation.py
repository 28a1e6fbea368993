"""What every protocol reduces to: a :class:`Turn` (canonical chat messages + tool schemas +
the request's sampling fields), rendered with the tokenizer's own chat template.

Each protocol's envelope implies a different string for the same conversation (Intern-S2
walkthrough Ch. 6, "Three protocols, one service"); here they become one form before the
template sees them, so a conversation renders to the same text whichever harness sent it:

* messages ``{"role": system|user|assistant|tool, "content": str, "reasoning_content"?,
  "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments"}}], "tool_call_id"?}``
  with ``arguments`` in the one canonical JSON spelling (:func:`~.tool_format.canonical_arguments`);
* tools ``{"type": "function", "function": {"name", "description", "parameters"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, shown, shown_text
from megatron_s2.serve.gateway.tool_format import ToolCall, canonical_arguments

__all__ = ["Turn", "function_tool", "assistant_message", "tool_call_entry", "render_prompt", "render_response",
           "text_of"]


@dataclass
class Turn:
    """One model call as a protocol asked for it."""

    protocol: str
    """``chat``, ``responses`` or ``messages``."""
    messages: list[dict]
    tools: list[dict] | None
    fields: Fields
    """The request body: sampling fields are read from it by their protocol names."""
    max_tokens_keys: tuple[str, ...]
    stream: bool
    prompt_field: str
    """The request field that holds the conversation (named in errors)."""


def function_tool(name, description, parameters, where: str) -> dict:
    """A tool schema in the canonical form (module docstring)."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name: a function tool needs a name", param=f"{where}.name")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"{where}: parameters must be a JSON schema object, got {shown(parameters)}", param=where)
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


def tool_call_entry(call_id: str, name, arguments, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name: a tool call needs a name", param=f"{where}.name")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": canonical_arguments(arguments)}}


def assistant_message(text: str, reasoning: str, calls: list[ToolCall]) -> dict:
    """The canonical assistant message of a parsed response (what its protocol relays)."""
    message = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_entry(c.id, c.name, c.arguments, "tool_calls") for c in calls]
    return message


def text_of(content, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or the joined text of a list of ``{"type": <one of kinds>, "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}[{i}]: only text parts ({' / '.join(kinds)}) are supported here, got "
                                 f"{shown(part)}", param=f"{where}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: must be a string or a list of text parts", param=where)


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool, field: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # the template's own refusal
        raise BadRequest(f"{field}: the chat template cannot render this conversation ({shown_text(str(exc), 200)})",
                         param=field) from None


def render_prompt(tokenizer, turn: Turn) -> str:
    """The prompt text: the conversation and the template's generation prompt."""
    return _render(tokenizer, turn.messages, turn.tools, True, turn.prompt_field)


def render_response(tokenizer, turn: Turn, message: dict) -> tuple[str, str | None]:
    """The text the template renders for ``message`` after ``turn``'s prompt — how it reads in
    the next request's prompt —, and the same without its reasoning (None: it has none)."""
    prompt = render_prompt(tokenizer, turn)

    def after_prompt(msg: dict) -> str:
        full = _render(tokenizer, turn.messages + [msg], turn.tools, False, turn.prompt_field)
        if not full.startswith(prompt):
            raise BadRequest(f"{turn.prompt_field}: this model's chat template does not render a conversation's "
                             "beginning as a prefix of the whole; token-in / token-out capture needs one",
                             param=turn.prompt_field)
        return full[len(prompt):]

    plain = {k: v for k, v in message.items() if k != "reasoning_content"}
    return after_prompt(message), (after_prompt(plain) if "reasoning_content" in message else None)
