"""``POST /v1/messages``: the Anthropic Messages API.

Request: ``system`` (a string or text blocks), ``messages`` (``user`` / ``assistant``; content a
string or blocks: ``text``, ``thinking``, ``tool_use`` on the assistant's side, ``tool_result``
on the user's), ``tools`` (``{"name", "description", "input_schema"}``), ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``stream``; ``tool_choice`` (``auto`` / ``any`` / ``none``
enforced by token masks, a named tool refused: :mod:`.tool_choice`); ``thinking``, ``metadata`` are
accepted (not enforced). Answer: a ``message`` whose ``content`` holds ``thinking``, ``text`` and
``tool_use`` blocks, ``stop_reason`` ``end_turn`` / ``tool_use`` / ``max_tokens``; streamed as
``message_start``, ``content_block_start`` / ``_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``_stop``, ``message_delta``, ``message_stop``. Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}`` with the same HTTP statuses as the OpenAI
endpoints (:func:`anthropic_error`).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from megatron_s2.serve.errors import BadRequest, HTTPError
from megatron_s2.serve.fields import Fields, shown
from megatron_s2.serve.gateway.conversation import Turn, function_tool, text_of, tool_call_entry
from megatron_s2.serve.gateway.streaming import named_event
from megatron_s2.serve.responses import event_stream
from megatron_s2.serve.gateway.tool_format import TextDelta
from megatron_s2.serve.state import new_id

__all__ = ["messages_turn", "messages_answer", "anthropic_error"]

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def _user(content, where: str, messages: list[dict]) -> None:
    if isinstance(content, str):
        messages.append({"role": "user", "content": content})
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where}: must be a string or a list of content blocks", param=where)
    text = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(text_of(block.get("text"), f"{at}.text"))
        elif kind == "tool_result":
            if text:  # text before a tool result stays before it
                messages.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.get("content", "")
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                             "content": text_of(result, f"{at}.content")})
        else:
            raise BadRequest(f"{at}.type: user blocks may be text or tool_result, got {shown(kind)}", param=f"{at}.type")
    if text or not content:
        messages.append({"role": "user", "content": "".join(text)})


def _assistant(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise BadRequest(f"{where}: must be a string or a list of content blocks", param=where)
    message = {"role": "assistant", "content": ""}
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            message["content"] += text_of(block.get("text"), f"{at}.text")
        elif kind == "thinking":
            message["reasoning_content"] = message.get("reasoning_content", "") + str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append(
                tool_call_entry(block.get("id", ""), block.get("name"), block.get("input", {}), at))
        else:
            raise BadRequest(f"{at}.type: assistant blocks may be text, thinking or tool_use, got {shown(kind)}",
                             param=f"{at}.type")
    return message


def messages_turn(f: Fields) -> Turn:
    if f.raw("max_tokens") is None:  # required by the protocol: without it a call would run to the context's end
        f.fail("max_tokens", "required by the Messages API: the most tokens to generate, e.g. 1024")
    system = f.raw("system")
    messages = [{"role": "system", "content": text_of(system, "system")}] if system else []
    raw = f.raw("messages")
    if not isinstance(raw, list) or not raw:
        f.fail("messages", "must be a non-empty list of {role, content} objects")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            _user(message.get("content"), f"{where}.content", messages)
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), f"{where}.content"))
        else:
            raise BadRequest(f"{where}.role: must be user or assistant, got {shown(role)}", param=f"{where}.role")
    schemas = []
    tools = f.raw("tools") or []
    if not isinstance(tools, list):
        f.fail("tools", "must be a list of tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise BadRequest(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported",
                             param=f"tools[{i}]")
        schemas.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                                     f"tools[{i}]"))
    return Turn("messages", messages, schemas or None, f, ("max_tokens",), f.bool("stream"), "messages")


def _stop_reason(out) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if out.calls else "end_turn"


def _usage(out, output_tokens: int | None = None) -> dict:
    return {"input_tokens": out.prompt_tokens, "output_tokens": out.output_tokens if output_tokens is None
            else output_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": call.input}


async def messages_answer(state, running, f: Fields):
    base = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": state.model_name}
    if not running.turn.stream:
        out = await running.complete()
        content = [{"type": "thinking", "thinking": out.reasoning, "signature": ""}] if out.reasoning else []
        if out.text or not (out.calls or out.reasoning):
            content.append({"type": "text", "text": out.text})
        content += [_tool_use(call) for call in out.calls]
        return JSONResponse({**base, "content": content, "stop_reason": _stop_reason(out), "stop_sequence": None,
                             "usage": _usage(out)})

    async def events():
        start = {**base, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(running.plan.ids), "output_tokens": 0}}
        yield named_event("message_start", {"type": "message_start", "message": start})
        index, open_kind = -1, None

        def block_stop():
            return named_event("content_block_stop", {"type": "content_block_stop", "index": index})

        async for delta in running.events():
            kind = delta.kind if isinstance(delta, TextDelta) else "tool_use"
            if kind != open_kind or kind == "tool_use":
                if open_kind is not None:
                    yield block_stop()
                index, open_kind = index + 1, kind
                block = {"text": {"type": "text", "text": ""},
                         "reasoning": {"type": "thinking", "thinking": "", "signature": ""}}.get(kind)
                if block is None:
                    block = {**_tool_use(delta), "input": {}}
                yield named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                          "content_block": block})
            if kind == "text":
                body = {"type": "text_delta", "text": delta.text}
            elif kind == "reasoning":
                body = {"type": "thinking_delta", "thinking": delta.text}
            else:
                body = {"type": "input_json_delta", "partial_json": delta.arguments}
            yield named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": body})
        if open_kind is not None:
            yield block_stop()
        out = running.output
        yield named_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": _stop_reason(out), "stop_sequence": None},
                                            "usage": {"output_tokens": out.output_tokens}})
        yield named_event("message_stop", {"type": "message_stop"})

    def error_event(exc: HTTPError) -> str:
        return named_event("error", anthropic_error(int(exc.status), exc.message))

    return event_stream(running.gen, events(), error_event)
