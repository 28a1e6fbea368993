"""OpenAI Chat Completions with tools (and every session's ``/v1/chat/completions``).

Request: ``messages`` (system / developer / user / assistant / tool; assistant ``tool_calls`` and
``reasoning_content``), ``tools`` (``{"type": "function", "function": {...}}``), ``tool_choice``
(``auto`` / ``none`` / ``required`` enforced by token masks, a named function refused: :mod:`.tool_choice`), ``max_completion_tokens`` /
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stream`` (+ ``stream_options``).
Answer: ``message.content``, ``message.reasoning_content`` (vLLM's field), ``message.tool_calls``
with ``finish_reason: "tool_calls"``; streamed as ``delta.reasoning_content``, ``delta.content``
and one ``delta.tool_calls`` entry per complete call.
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, shown
from megatron_s2.serve.gateway.conversation import Turn, function_tool, text_of, tool_call_entry
from megatron_s2.serve.gateway.tool_format import TextDelta
from megatron_s2.serve.responses import event_stream, usage
from megatron_s2.serve.state import SSE_DONE, new_id, sse

__all__ = ["chat_turn", "chat_answer"]


def _message(message, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where}: must be an object with role and content", param=where)
    role = {"developer": "system"}.get(message.get("role"), message.get("role"))
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"{where}.role: must be system, developer, user, assistant or tool, got "
                         f"{shown(message.get('role'))}", param=f"{where}.role")
    content = message.get("content")
    out = {"role": role, "content": "" if content is None and role == "assistant" else
           text_of(content, f"{where}.content")}
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls: must be a list", param=f"{where}.tool_calls")
        entries = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise BadRequest(f"{where}.tool_calls[{j}].function: required", param=f"{where}.tool_calls[{j}]")
            entries.append(tool_call_entry(call.get("id", ""), fn.get("name"), fn.get("arguments", "{}"),
                                           f"{where}.tool_calls[{j}].function"))
        if entries:
            out["tool_calls"] = entries
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def chat_turn(f: Fields) -> Turn:
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        f.fail("messages", "must be a non-empty list of {role, content} objects")
    tools = f.raw("tools")
    if tools is not None and not isinstance(tools, list):
        f.fail("tools", "must be a list of function tools")
    schemas = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}]: only {{\"type\": \"function\", \"function\": {{...}}}} tools are supported",
                             param=f"tools[{i}]")
        schemas.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                     f"tools[{i}].function"))
    return Turn("chat", [_message(m, i) for i, m in enumerate(messages)], schemas or None, f,
                ("max_completion_tokens", "max_tokens"), f.bool("stream"), "messages")


def _finish(output) -> str:
    return "tool_calls" if output.calls and output.finish_reason == "stop" else output.finish_reason


def _calls(output) -> list[dict]:
    return [{"id": f"call_{c.id}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in output.calls]


async def chat_answer(state, running, f: Fields):
    rid, created = new_id("chatcmpl"), int(time.time())
    base = {"id": rid, "created": created, "model": state.model_name}
    if not running.turn.stream:
        out = await running.complete()
        message = {"role": "assistant", "content": out.text if out.text or not out.calls else None}
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = _calls(out)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(out)}
        return JSONResponse({**base, "object": "chat.completion", "choices": [choice],
                             "usage": usage(out.prompt_tokens, out.output_tokens)})
    options = f.object("stream_options")
    include_usage = options.bool("include_usage")
    chunk = {**base, "object": "chat.completion.chunk"}

    async def events():
        yield sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        calls = 0
        async for event in running.events():
            if isinstance(event, TextDelta):
                delta = {"content" if event.kind == "text" else "reasoning_content": event.text}
            else:
                delta = {"tool_calls": [{"index": calls, "id": f"call_{event.id}", "type": "function",
                                         "function": {"name": event.name, "arguments": event.arguments}}]}
                calls += 1
            yield sse({**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]})
        out = running.output
        yield sse({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish(out)}]})
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage(out.prompt_tokens, out.output_tokens)})
        yield SSE_DONE

    return event_stream(running.gen, events())
