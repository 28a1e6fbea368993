"""The FastAPI application: routes and the error contract.

=========================  =======================================================================
route                      answers
=========================  =======================================================================
GET  /v1/models            the served model, with ``max_model_len`` (vLLM's ModelCard extension,
                           which renderers reads for its over-long-prompt pre-flight)
POST /v1/completions       :func:`megatron_s2.serve.completions_api.completions`
POST /v1/chat/completions  :func:`megatron_s2.serve.chat_api.chat_completions`
POST /inference/v1/generate  :func:`megatron_s2.serve.token_api.generate`
POST /v1/forecast          a series' numerical forecast, :func:`megatron_s2.serve.series.forecast_route`
                           (Intern-S2 §2.2.2; chat takes ``time_series`` parts and ``forecast`` too)
POST /v1/responses         OpenAI Responses, :mod:`megatron_s2.serve.gateway` (also per session:
POST /v1/messages          Anthropic Messages      ``/sessions/<id>/v1/...``, :mod:`~.gateway.routes`)
POST /update_weights       :func:`megatron_s2.serve.weights_api.update_weights` (disaggregated RL)
GET  /health               200 while the engine driver runs, 503 with the reason after it died
GET  /stats                engine and server counters (running / waiting requests, free KV pages,
                           policy version, submitted / finished / aborted / refused requests)
=========================  =======================================================================

Errors are the OpenAI error object (:mod:`megatron_s2.serve.errors`): 400 for a malformed or
unservable request (the message names the field), 413 for a body over
``ServeConfig.max_body_bytes``, 404 for another model name, 429 when the
engine's queue is full, 503 when the engine stopped; an unknown path (404) or method (405) is
the same object with the status phrase as its type, as vLLM answers. Anything unexpected is a
500 with the exception's message (and the traceback in the server log), never a hang, on a
connection that stays open for the client's next request (:class:`ErrorBoundary`). A client
that leaves while its request is still arriving is an INFO line, not an error. On ``/v1/messages``
(and its session route) the same statuses carry Anthropic's error object instead.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as RouteError
from starlette.requests import ClientDisconnect

from megatron_s2.serve.errors import HTTPError, error_body
from megatron_s2.serve.fields import shown_text
from megatron_s2.serve.chat_api import chat_completions
from megatron_s2.serve.completions_api import completions
from megatron_s2.serve.gateway.messages_protocol import anthropic_error
from megatron_s2.serve.gateway.routes import add_gateway_routes
from megatron_s2.serve.state import ServerState
from megatron_s2.serve.token_api import generate
from megatron_s2.serve.weights_api import update_weights

__all__ = ["build_app", "ErrorBoundary"]

log = logging.getLogger("megatron_s2.serve")


class ErrorBoundary:
    """ASGI middleware between Starlette's outermost error layer and the routes.

    Starlette's catch-all ``Exception`` handler answers 500 and then re-raises, and uvicorn
    answers a re-raised exception by dropping the connection without ``Connection: close``: the
    client's next pooled request fails. Here an exception no route handled becomes the 500 error
    object and goes no further, so the connection serves the next request. Once a response has
    started (a stream) it cannot carry another one: the exception goes on and uvicorn closes it.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        response_started = False

        async def tracked_send(message):
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:  # the body stopped arriving: nobody is left to answer
            log.info("client left before its request was read: %s %s", scope["method"], shown_text(scope["path"]))
        except Exception as exc:  # noqa: BLE001 - every unexpected error is answered, once
            if response_started:
                raise
            log.exception("request failed: %s %s", scope["method"], shown_text(scope["path"]))
            body = error_body(f"internal error: {type(exc).__name__}: {shown_text(str(exc), 500)}",
                              "InternalServerError", 500)
            await JSONResponse(body, status_code=500)(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="megatron-s2 serve", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(ErrorBoundary)

    def error_response(request: Request, body: dict, status: int, headers=None) -> JSONResponse:
        if request.url.path.endswith("/v1/messages"):  # Anthropic clients read their own error object
            body = anthropic_error(status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(request, exc.body(), int(exc.status))

    @app.exception_handler(RouteError)
    async def _route_error(request: Request, exc: RouteError):
        """An unknown path (404) or a method the path does not take (405), as vLLM answers them."""
        phrase = HTTPStatus(exc.status_code).phrase
        where = f"{request.method} {shown_text(request.url.path)}"
        hint = {404: "; this server answers /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, "
                     "/v1/messages, /sessions/<id>/v1/..., /inference/v1/generate, /update_weights, /health and /stats",
                405: f"; this path takes {exc.headers.get('Allow', 'another method')}" if exc.headers else ""}
        body = error_body(f"{phrase}: {where}{hint.get(exc.status_code, '')}", phrase, exc.status_code)
        return error_response(request, body, exc.status_code, exc.headers)

    @app.get("/v1/models")
    async def models():  # noqa: F811 - also served per session
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "megatron-s2",
                "root": state.description, "parent": None, "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(state, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat_completions(state, request)

    @app.post("/v1/forecast")
    async def _forecast(request: Request):  # numbers for a series (serve/series.py, Intern-S2 §2.2.2)
        from megatron_s2.serve.series import forecast_route

        return await forecast_route(state, request)

    @app.post("/inference/v1/generate")
    async def _generate(request: Request):
        return await generate(state, request)

    add_gateway_routes(app, state, models)

    @app.post("/update_weights")
    async def _update_weights(request: Request):
        return await update_weights(state, request)

    @app.get("/health")
    async def health():
        if state.backend.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": state.backend.error}, status_code=503)

    @app.get("/stats")
    async def stats():
        return state.backend.stats()

    return app
