"""HTTP errors of the server, answered in the OpenAI / vLLM error shape.

Every refusal is one JSON object ``{"error": {"message", "type", "param", "code"}}`` — what the
``openai`` client turns into ``BadRequestError`` / ``NotFoundError`` / ``RateLimitError`` /
``InternalServerError`` with the message intact. Messages start with the request field they
are about (``"max_tokens: ..."``, ``"messages[2].role: ..."``) so a caller knows what to fix.
"""

from __future__ import annotations

from http import HTTPStatus

__all__ = ["HTTPError", "BadRequest", "NotFound", "Overloaded", "EngineUnavailable", "error_body"]


class HTTPError(Exception):
    """An error answered with ``status`` and the OpenAI error body."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    kind = "InternalServerError"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.kind, int(self.status), self.param)


class BadRequest(HTTPError):
    """A malformed or unservable request (400): the message names the field."""

    status = HTTPStatus.BAD_REQUEST
    kind = "BadRequestError"


class NotFound(HTTPError):
    """An unknown model name (404, as vLLM answers)."""

    status = HTTPStatus.NOT_FOUND
    kind = "NotFoundError"


class Overloaded(HTTPError):
    """The engine's bounded queue is full (429): retry later."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    kind = "RateLimitError"


class EngineUnavailable(HTTPError):
    """The engine's driver stopped (it raised, or the server is shutting down): 503."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "ServiceUnavailableError"


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
