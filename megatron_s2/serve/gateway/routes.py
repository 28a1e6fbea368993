"""The gateway's routes: the protocols at ``/v1/...`` and again under ``/sessions/<id>/v1/...``.

=============================================  ===============================================
route                                          answers
=============================================  ===============================================
POST /v1/responses                             OpenAI Responses (:mod:`.responses_protocol`)
POST /v1/messages                              Anthropic Messages (:mod:`.messages_protocol`)
POST /sessions/<id>/v1/chat/completions        Chat Completions in session ``<id>`` (TITO capture)
POST /sessions/<id>/v1/responses               Responses in session ``<id>``
POST /sessions/<id>/v1/messages                Messages in session ``<id>``
GET  /sessions/<id>/v1/models                  the model list, as ``/v1/models``
=============================================  ===============================================

A harness that only knows a base URL is pointed at ``http://host:port/sessions/<id>/v1`` (OpenAI
clients) or ``http://host:port/sessions/<id>`` (the Anthropic client appends ``/v1/messages``)
and is tracked without knowing it (Intern-S2 walkthrough Ch. 6, ``gateway.url(session)``). Session
routes need the trace store (``megatron-s2 serve --gateway-traces DIR``); without it they answer
404 saying so. Ids ``<group>@<member>`` put sessions into one PrefixTree (the G rollouts of a task).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megatron_s2.serve.backend import ClientDisconnected
from megatron_s2.serve.errors import NotFound
from megatron_s2.serve.fields import Fields, read_json_object, shown_text
from megatron_s2.serve.gateway.chat_protocol import chat_answer, chat_turn
from megatron_s2.serve.gateway.messages_protocol import messages_answer, messages_turn
from megatron_s2.serve.gateway.responses_protocol import responses_answer, responses_turn
from megatron_s2.serve.gateway.traces import check_session_id
from megatron_s2.serve.gateway.turn import start_turn
from megatron_s2.serve.state import ServerState

__all__ = ["add_gateway_routes", "gateway_chat", "PROTOCOLS"]

PROTOCOLS = {"chat": (chat_turn, chat_answer), "responses": (responses_turn, responses_answer),
             "messages": (messages_turn, messages_answer)}


async def run_protocol(state: ServerState, request: Request, protocol: str, session: str | None,
                       f: Fields | None = None):
    if f is None:
        f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    parse, answer = PROTOCOLS[protocol]
    turn = parse(f)
    running = await start_turn(state, request, turn, session, state.capture)
    try:
        return await answer(state, running, f)
    except ClientDisconnected:  # a plain call whose client left: nobody to answer (its request is aborted)
        return JSONResponse({}, status_code=499)


async def gateway_chat(state: ServerState, request: Request, f: Fields):
    """``/v1/chat/completions`` with ``tools``: parsed tool calls and reasoning, no session."""
    return await run_protocol(state, request, "chat", None, f)


def _session(state: ServerState, session_id: str) -> str:
    if state.capture is None:
        raise NotFound(f"sessions/{shown_text(session_id)}: session endpoints need the trace store; start the "
                       "server with --gateway-traces DIR", param="session")
    why = check_session_id(session_id)
    if why is not None:
        raise NotFound(f"sessions/{shown_text(session_id)}: {why}", param="session")
    return session_id


def add_gateway_routes(app: FastAPI, state: ServerState, models) -> None:
    @app.post("/v1/responses")
    async def _responses(request: Request):
        return await run_protocol(state, request, "responses", None)

    @app.post("/v1/messages")
    async def _messages(request: Request):
        return await run_protocol(state, request, "messages", None)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def _session_chat(session_id: str, request: Request):
        return await run_protocol(state, request, "chat", _session(state, session_id))

    @app.post("/sessions/{session_id}/v1/responses")
    async def _session_responses(session_id: str, request: Request):
        return await run_protocol(state, request, "responses", _session(state, session_id))

    @app.post("/sessions/{session_id}/v1/messages")
    async def _session_messages(session_id: str, request: Request):
        return await run_protocol(state, request, "messages", _session(state, session_id))

    @app.get("/sessions/{session_id}/v1/models")
    async def _session_models(session_id: str):
        _session(state, session_id)
        return await models()
