"""``tool_choice`` on the agent gateway (:mod:`megatron_s2.serve.gateway.tool_choice`): ``none`` and
``required`` enforced by the engine's token masks through the real ``openai`` / ``anthropic``
clients, a named function refused with a 400 naming the field — never ignored."""

from __future__ import annotations

import anthropic
import openai
import pytest
import torch

from megatron_s2.inference.sampling import SamplingParams, constrain_logits
from tests.serve.test_gateway import TOOL_ANSWER, TOOLS_CHAT, an, oa, start_scripted_server

TOOLS_MESSAGES = [{"name": "read_file", "description": "Read a file",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
USER = [{"role": "user", "content": "Read a"}]


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_scripted_server(loaded)
    yield srv
    srv.stop()


def test_constrain_logits_bans_tokens_and_the_end_until_the_required_token():
    logits = torch.zeros(8)
    banned = constrain_logits(logits, SamplingParams(banned_token_ids=(3, 5)), [], {7})
    assert torch.isneginf(banned[[3, 5]]).all() and torch.isfinite(banned[[0, 1, 2, 4, 6, 7]]).all()
    required = SamplingParams(required_token_id=4, stop_token_ids=(6,))
    assert torch.isneginf(constrain_logits(logits, required, [1, 2], {7})[[6, 7]]).all()
    assert torch.isfinite(constrain_logits(logits, required, [1, 4], {7})).all()  # the call has begun
    assert constrain_logits(logits, SamplingParams(), [], {7}) is logits


def test_none_bans_the_call_even_when_the_model_wants_one(server, tok):
    server.policy.queue.append(tok.encode(TOOL_ANSWER))  # steered towards a call: the mask wins
    chat = oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=40,
                                              tool_choice="none")
    assert not chat.choices[0].message.tool_calls and chat.choices[0].finish_reason != "tool_calls"
    server.policy.queue.append(tok.encode(TOOL_ANSWER))
    msg = an(server).messages.create(model="tiny", max_tokens=40, tools=TOOLS_MESSAGES, messages=USER,
                                     tool_choice={"type": "none"})
    assert "tool_use" not in [b.type for b in msg.content] and msg.stop_reason != "tool_use"
    server.policy.queue.clear()


def test_auto_relays_the_same_steered_call(server, tok):  # the control: the steering does produce a call
    server.policy.queue.append(tok.encode(TOOL_ANSWER))
    chat = oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=40,
                                              tool_choice="auto")
    assert chat.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_required_never_ends_without_a_call(server, tok, protocol):
    # steered to answer "Ok." and stop: the end-of-sequence is masked until a call list begins
    server.policy.queue.append(tok.encode("Ok.<｜end▁of▁sentence｜>"))
    if protocol == "chat":
        chat = oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=10,
                                                  tool_choice="required")
        assert chat.choices[0].finish_reason in ("tool_calls", "length")
    elif protocol == "responses":
        tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
        resp = oa(server).responses.create(model="tiny", input="Read a", tools=tools, max_output_tokens=10,
                                           tool_choice="required")
        assert resp.status == "incomplete" or any(item.type == "function_call" for item in resp.output)
    else:
        msg = an(server).messages.create(model="tiny", max_tokens=10, tools=TOOLS_MESSAGES, messages=USER,
                                         tool_choice={"type": "any"})
        assert msg.stop_reason in ("tool_use", "max_tokens")
    server.policy.queue.clear()


def test_required_lets_a_call_through(server, tok):
    server.policy.queue.append(tok.encode(TOOL_ANSWER))
    chat = oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=40,
                                              tool_choice="required")
    assert chat.choices[0].finish_reason == "tool_calls" and chat.choices[0].message.tool_calls[0].function.name \
        == "read_file"


def test_what_cannot_be_enforced_is_refused_naming_the_field(server):
    named = {"type": "function", "function": {"name": "read_file"}}
    with pytest.raises(openai.BadRequestError, match="tool_choice: a named function"):
        oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=4,
                                           tool_choice=named)
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(openai.BadRequestError, match="tool_choice: a named function"):
        oa(server).responses.create(model="tiny", input="x", tools=tools, max_output_tokens=4,
                                    tool_choice={"type": "function", "name": "read_file"})
    with pytest.raises(openai.BadRequestError, match="tool_choice: requires a tool call but no tools"):
        oa(server).responses.create(model="tiny", input="x", max_output_tokens=4, tool_choice="required")
    with pytest.raises(anthropic.BadRequestError, match="tool_choice: a named tool"):
        an(server).messages.create(model="tiny", max_tokens=4, tools=TOOLS_MESSAGES, messages=USER,
                                   tool_choice={"type": "tool", "name": "read_file"})
    with pytest.raises(openai.BadRequestError, match="tool_choice: must be"):
        oa(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS_CHAT, max_tokens=4,
                                           tool_choice="sometimes")
