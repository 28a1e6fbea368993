"""``POST /v1/responses``: the OpenAI Responses API, stateless.

Request: ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call``, ``function_call_output`` and ``reasoning`` items, as the OpenAI Agents SDK
sends a conversation back), ``instructions`` (the system message), ``tools`` (function tools),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``. ``previous_response_id`` is refused:
nothing is stored server-side for a client to point at (send the whole ``input``); ``tool_choice``
``auto`` / ``none`` / ``required`` is enforced by token masks, a named function refused
(:mod:`.tool_choice`). Answer: a ``response`` object whose ``output`` holds a ``reasoning``
item (``reasoning_text`` content), a ``message`` item (``output_text``) and ``function_call``
items; streamed as the API's named events (``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse

from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, shown
from megatron_s2.serve.gateway.conversation import Turn, function_tool, text_of, tool_call_entry
from megatron_s2.serve.gateway.streaming import named_event
from megatron_s2.serve.responses import event_stream
from megatron_s2.serve.gateway.tool_format import TextDelta
from megatron_s2.serve.state import new_id

__all__ = ["responses_turn", "responses_answer"]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _items(value, instructions) -> list[dict]:
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return messages + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input: must be a string or a non-empty list of items", param="input")
    reasoning = ""

    def open_assistant() -> dict:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning:
            last["reasoning_content"], reasoning = reasoning, ""
        return last

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise BadRequest(f"{where}.role: must be user, system, developer or assistant, got "
                                 f"{shown(item.get('role'))}", param=f"{where}.role")
            text = text_of(item.get("content"), f"{where}.content", _TEXT_PARTS)
            if role == "assistant":
                open_assistant()["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            message = open_assistant()
            message.setdefault("tool_calls", []).append(
                tool_call_entry(item.get("call_id", ""), item.get("name"), item.get("arguments", "{}"), where))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_of(output, f"{where}.output", _TEXT_PARTS)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise BadRequest(f"{where}.type: {shown(kind)} items are not supported; send message, function_call, "
                             "function_call_output or reasoning items", param=f"{where}.type")
    return messages


def responses_turn(f: Fields) -> Turn:
    if f.raw("previous_response_id") is not None:
        f.fail("previous_response_id", "this server stores no responses; send the whole conversation as input")
    if f.bool("background"):
        f.fail("background", "background responses are not supported; leave it out")
    text = f.raw("text")
    if text is not None and not isinstance(text, dict):
        f.fail("text", f"must be an object such as {{\"format\": {{\"type\": \"text\"}}}}, got {shown(text)}")
    if (text or {}).get("format") not in (None, {"type": "text"}):  # as response_format on chat: never ignored
        raise BadRequest("text.format: structured output (json_schema / json_object) is not implemented; send "
                         "{\"type\": \"text\"} or leave it out, and validate the JSON client-side", param="text.format")
    instructions = f.str("instructions")
    schemas = []
    tools = f.raw("tools") or []
    if not isinstance(tools, list):
        f.fail("tools", "must be a list of function tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f"tools[{i}].type: only function tools are supported, got "
                             f"{shown(tool.get('type') if isinstance(tool, dict) else tool)}", param=f"tools[{i}].type")
        schemas.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), f"tools[{i}]"))
    return Turn("responses", _items(f.raw("input"), instructions), schemas or None, f, ("max_output_tokens",),
                f.bool("stream"), "input")


def _usage(out) -> dict:
    return {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + out.output_tokens}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": f"call_{call.id}", "name": call.name,
            "arguments": call.arguments, "status": status}


class _Envelope:
    """The response object around the output items (the same in the answer and in events)."""

    def __init__(self, state, f: Fields, turn: Turn):
        self.state, self.f, self.turn = state, f, turn
        self.id, self.created = new_id("resp"), int(time.time())

    def body(self, status: str, output: list[dict], out=None) -> dict:
        incomplete = out is not None and out.finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete else status, "model": self.state.model_name,
                "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": self.f.raw("instructions"), "metadata": self.f.raw("metadata") or {},
                "parallel_tool_calls": True, "tool_choice": self.f.raw("tool_choice") or "auto",
                "tools": self.f.raw("tools") or [], "temperature": self.f.raw("temperature"),
                "top_p": self.f.raw("top_p"), "max_output_tokens": self.f.raw("max_output_tokens"),
                "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
                "text": {"format": {"type": "text"}},
                "usage": _usage(out) if out is not None else None}


def _output_items(out) -> list[dict]:
    items = []
    if out.reasoning:
        items.append(_reasoning_item(_item_id("rs"), out.reasoning))
    if out.text or not out.calls:
        items.append(_message_item(_item_id("msg"), out.text))
    items += [_call_item(_item_id("fc"), call) for call in out.calls]
    return items


async def responses_answer(state, running, f: Fields):
    envelope = _Envelope(state, f, running.turn)
    if not running.turn.stream:
        out = await running.complete()
        return JSONResponse(envelope.body("completed", _output_items(out), out))

    async def events():
        seq = 0

        def event(kind: str, **payload) -> str:
            nonlocal seq
            seq += 1
            return named_event(kind, {"type": kind, "sequence_number": seq - 1, **payload})

        yield event("response.created", response=envelope.body("in_progress", []))
        yield event("response.in_progress", response=envelope.body("in_progress", []))
        done: list[dict] = []
        current: dict | None = None  # the open text or reasoning item
        text = ""

        def close_current():
            nonlocal current, text
            if current is None:
                return []
            at = len(done)
            if current["type"] == "reasoning":
                item = _reasoning_item(current["id"], text)
                closing = [event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                 content_index=0, text=text)]
            else:
                item = _message_item(current["id"], text)
                part = item["content"][0]
                closing = [event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                 text=text, logprobs=[]),
                           event("response.content_part.done", item_id=item["id"], output_index=at,
                                 content_index=0, part=part)]
            closing.append(event("response.output_item.done", output_index=at, item=item))
            done.append(item)
            current, text = None, ""
            return closing

        async for delta in running.events():
            if isinstance(delta, TextDelta):
                kind = "reasoning" if delta.kind == "reasoning" else "message"
                if current is None or current["type"] != kind:
                    for line in close_current():
                        yield line
                    at = len(done)
                    if kind == "reasoning":
                        current = {"type": "reasoning", "id": _item_id("rs")}
                        yield event("response.output_item.added", output_index=at,
                                    item={**_reasoning_item(current["id"], ""), "content": []})
                    else:
                        current = {"type": "message", "id": _item_id("msg")}
                        item = _message_item(current["id"], "", "in_progress")
                        yield event("response.output_item.added", output_index=at, item={**item, "content": []})
                        yield event("response.content_part.added", item_id=current["id"], output_index=at,
                                    content_index=0, part=item["content"][0])
                text += delta.text
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                yield event(name, item_id=current["id"], output_index=len(done), content_index=0, delta=delta.text,
                            **extra)
            else:
                for line in close_current():
                    yield line
                at, item = len(done), _call_item(_item_id("fc"), delta)
                yield event("response.output_item.added", output_index=at,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=at, item=item)
                done.append(item)
        for line in close_current():
            yield line
        out = running.output
        if not done:  # an empty answer is still one message
            item = _message_item(_item_id("msg"), "")
            yield event("response.output_item.added", output_index=0, item={**item, "content": []})
            yield event("response.output_item.done", output_index=0, item=item)
            done.append(item)
        final = envelope.body("completed", done, out)
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)

    def error_event(exc) -> str:
        body = exc.body()["error"]
        return named_event("error", {"type": "error", "code": str(body["code"]), "message": body["message"],
                                     "param": body["param"], "sequence_number": 0})

    return event_stream(running.gen, events(), error_event)
