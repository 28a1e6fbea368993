"""Chat conversations -> token ids with per-role loss masks (SFT and post-training data).

A conversation is a list of OpenAI-style messages::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning_content": str (assistant, optional), "tool_calls": [...] (assistant, optional)}

plus, per conversation, optional ``tools`` (JSON schemas) and ``reasoning_effort`` (1..100, the
§5.1.4 system line). :func:`tokenize_conversation` renders it with the tokenizer's chat template
and marks which tokens are training targets: the tokens of every message whose role is in
``loss_roles`` (default: assistant only), except a message with ``"weight": 0`` (OpenAI's fine-tuning
format: an assistant turn kept as context only, e.g. the wrong first answer of a retry
conversation). Another non-negative ``"weight"`` on an assistant message scales its tokens' share
of the loss (e.g. 4: the one decision turn of a tool-call conversation counted four times in the
step's weighted mean, ``sum(w * ce) / sum(w)``, :mod:`megatron_s2.pipeline.losses`); the mask is
then float32 weights instead of bool flags. An assistant message's generation prompt (the
``<｜Assistant｜>`` marker the server appends before sampling) is never a target; its reasoning,
content, tool calls and closing end-of-sentence token are. The bos token and the header are
never targets. A target flag at position *t* means "token *t* is trained as the prediction made
at *t - 1*", the convention of :mod:`megatron_s2.data.packing`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from megatron_s2.data.chat_format import reasoning_effort_line
from megatron_s2.data.errors import DataError

__all__ = ["MAX_MESSAGE_WEIGHT", "ROLES", "check_messages", "header_lines", "tokenize_conversation"]

ROLES = ("system", "user", "assistant", "tool")


MAX_MESSAGE_WEIGHT = 1e6
"""The largest loss weight a chat message may carry: far above any useful one, and float32-safe when
multiplied into a micro-batch's summed loss (a weight of 1e39 would overflow to inf)."""


def _shown(value) -> str:
    """``value`` for an error message, cut short (a 400-digit weight is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_messages(messages: Sequence[dict[str, Any]], reasoning_effort: int | None = None) -> None:
    """Raise DataError naming the first malformed message."""
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"messages[{i}]: expected an object with 'role' and 'content', got {message!r:.60}")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if not (isinstance(content, str) or (role == "assistant" and content is None and message.get("tool_calls"))):
            raise DataError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None and (not isinstance(calls, list)
                                      or not all(isinstance(c, dict) and _call_name(c) for c in calls)):
                raise DataError(f"messages[{i}].tool_calls: expected a list of {{'function': {{'name', "
                                "'arguments'}}} objects")
            reasoning = message.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise DataError(f"messages[{i}].reasoning_content: expected a string")
        weight = message.get("weight", 1)
        if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= MAX_MESSAGE_WEIGHT
                or (weight != 1 and role != "assistant")):
            raise DataError(f"messages[{i}].weight: expected a number from 0 to {MAX_MESSAGE_WEIGHT:g} on an assistant "
                            f"message (0 = context, never trained; 4 = counted four times), got {_shown(weight)} on "
                            f"the message of role {role!r}")
    if reasoning_effort is not None:
        try:
            reasoning_effort_line(reasoning_effort)
        except ValueError as exc:
            raise DataError(str(exc)) from None


def _call_name(call: dict) -> str | None:
    fn = call.get("function", call)
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def header_lines(messages: Sequence[dict[str, Any]], reasoning_effort: int | None,
                 tools: Sequence[dict] | None) -> list[str]:
    """The header of the V4-style layout: effort line, tool schemas, leading system prompt."""
    lines = [reasoning_effort_line(reasoning_effort)] if reasoning_effort is not None else []
    if tools:
        lines += ["## Tools", *(json.dumps(t, ensure_ascii=False) for t in tools)]
    if messages and messages[0]["role"] == "system":
        lines.append(messages[0]["content"])
    return lines


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]], *, loss_roles: Sequence[str] = ("assistant",),
                          reasoning_effort: int | None = None, tools: Sequence[dict] | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, target mask) of a conversation (module docstring): bool flags, or float32
    weights when a message's ``weight`` is neither 0 nor 1."""
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"tools: expected a list of tool objects (JSON schemas), got {type(tools).__name__}")
    ids, owner, body = tokenizer.chat_segments(messages, reasoning_effort=reasoning_effort, tools=tools)
    weights = [messages[i].get("weight", 1) if i >= 0 and messages[i]["role"] in loss_roles else 0 for i in owner]
    target = np.fromiter((w if b else 0 for w, b in zip(weights, body)), dtype=np.float32, count=len(ids))
    weighted = any(m.get("weight", 1) not in (0, 1) for m in messages if m["role"] in loss_roles)
    return np.asarray(ids, dtype=np.int64), target if weighted else target > 0


def load_chat_documents(paths: Sequence[str], tokenizer, *, loss_roles: Sequence[str] = ("assistant",),
                        messages_key: str = "messages", on_bad_record: str = "stop", log=print):
    """One :class:`~megatron_s2.data.documents.InMemoryDocuments` per file of conversations.

    A record is ``{messages_key: [...], "tools": [...]?, "reasoning_effort": int?}``; a malformed
    one (not an object, no message list, an unknown role, a non-string content, nothing to
    train on) is handled by ``on_bad_record`` (:class:`~megatron_s2.data.records.BadRecords`);
    skipped rows are counted and logged per file."""
    from megatron_s2.data.documents import InMemoryDocuments
    from megatron_s2.data.records import BadRecords, iter_records

    stores = []
    for path in paths:
        bad = BadRecords(on_bad_record)
        documents = []
        for where, record in iter_records(path, bad):
            messages = record.get(messages_key)
            if not isinstance(messages, list) or not messages:
                bad.report(where, f"no non-empty '{messages_key}' list")
                continue
            try:
                ids, target = tokenize_conversation(tokenizer, messages, loss_roles=loss_roles,
                                                    reasoning_effort=record.get("reasoning_effort"),
                                                    tools=record.get("tools"))
            except DataError as exc:
                bad.report(where, str(exc))
                continue
            if not target.any():
                bad.report(where, f"no tokens of the trained roles {list(loss_roles)}")
                continue
            documents.append((ids, target))
        if bad.summary():
            log(f"data: {path}: {bad.summary()}")
        if not documents:
            raise DataError(f"{path}: no usable conversations (of {bad.count} records)")
        stores.append(InMemoryDocuments.from_masked(documents))
    return stores
