"""The FastAPI application: routes and the error contract.

=========================  =======================================================================
route                      answers
=========================  =======================================================================
GET  /v1/models            the served model, with ``max_model_len`` (vLLM's ModelCard extension,
                           which renderers reads for its over-long-prompt pre-flight)
POST /v1/completions       :func:`megatron_s2.serve.openai_api.completions`
POST /v1/chat/completions  :func:`megatron_s2.serve.openai_api.chat_completions`
POST /inference/v1/generate  :func:`megatron_s2.serve.token_api.generate`
GET  /health               200 while the engine driver runs, 503 with the reason after it died
GET  /stats                engine and server counters (running / waiting requests, free KV pages,
                           policy version, submitted / finished / aborted / refused requests)
=========================  =======================================================================

Errors are the OpenAI error object (:mod:`megatron_s2.serve.errors`): 400 for a malformed or
unservable request (the message names the field), 404 for another model name, 429 when the
engine's queue is full, 503 when the engine stopped; anything unexpected is a 500 with the
exception's message (and the traceback in the server log), never a hang.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megatron_s2.serve.errors import HTTPError, error_body
from megatron_s2.serve.openai_api import chat_completions, completions
from megatron_s2.serve.state import ServerState
from megatron_s2.serve.token_api import generate

__all__ = ["build_app"]

log = logging.getLogger("megatron_s2.serve")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="megatron-s2 serve", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError):
        return JSONResponse(exc.body(), status_code=int(exc.status))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError", 500),
                            status_code=500)

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "megatron-s2",
                "root": state.description, "parent": None, "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(state, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat_completions(state, request)

    @app.post("/inference/v1/generate")
    async def _generate(request: Request):
        return await generate(state, request)

    @app.get("/health")
    async def health():
        if state.backend.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": state.backend.error}, status_code=503)

    @app.get("/stats")
    async def stats():
        return state.backend.stats()

    return app
