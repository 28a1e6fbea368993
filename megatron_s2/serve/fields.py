"""Reading request bodies: typed fields with HTTP 400 errors that name the field.

JSON types are checked strictly (``true`` is not an integer, ``"3"`` is not a number), ranges
are checked where the engine would otherwise fail later, and a field the server cannot honour
with a value that would change the result is refused (:meth:`Fields.refuse_unless_default`)
instead of silently ignored. Unknown top-level fields are ignored, as OpenAI and vLLM do;
unknown ``sampling_params`` keys of the token endpoint are refused (:meth:`Fields.only`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from megatron_s2.serve.errors import BadRequest

__all__ = ["Fields", "parse_json_object"]


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: must be a JSON object, got {type(body).__name__}")
    return body


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


class Fields:
    """Typed access to one JSON object; ``prefix`` names it in errors (``sampling_params.``)."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body = body
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, message: str):
        raise BadRequest(f"{self.name(key)}: {message}", param=self.name(key))

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                self.fail(key, f"must be an integer, got {_kind(value)} {value!r}")
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def float(self, key: str, default: float | None = None, *, minimum: float | None = None,
              maximum: float | None = None) -> float | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, f"must be a finite number, got {_kind(value)} {value!r}")
        value = float(value)
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_kind(value)} {value!r}")
        return value

    def str(self, key: str, default: str | None = None) -> str | None:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_kind(value)}")
        return value

    def object(self, key: str) -> "Fields":
        value = self.body.get(key)
        if value is None:
            return Fields({}, f"{self.name(key)}.")
        if not isinstance(value, dict):
            self.fail(key, f"must be an object, got {_kind(value)}")
        return Fields(value, f"{self.name(key)}.")

    def strings(self, key: str) -> tuple[str, ...]:
        """A string or a list of strings (OpenAI ``stop``)."""
        value = self.body.get(key)
        if value is None:
            return ()
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            self.fail(key, "must be a string or a list of strings")
        if any(not v for v in values):
            self.fail(key, "stop strings must not be empty")
        return tuple(values)

    def token_ids(self, key: str, vocab_size: int, *, required: bool = False, where: str | None = None) -> list[int]:
        """A list of token ids, each in ``0..vocab_size-1``."""
        value = self.body.get(key)
        name = where or self.name(key)
        if value is None:
            if required:
                raise BadRequest(f"{name}: required (a list of token ids)", param=name)
            return []
        return check_token_ids(value, vocab_size, name)

    def refuse_unless_default(self, key: str, default: Any, why: str) -> None:
        """Refuse a field this server cannot honour unless it has the value that changes nothing."""
        value = self.body.get(key)
        if value is not None and value != default and not (isinstance(default, list) and value == []):
            self.fail(key, f"not supported by this server ({why})")

    def only(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.body) - allowed)
        if unknown:
            self.fail(unknown[0], f"unknown field; known fields: {', '.join(sorted(allowed))}")


def check_token_ids(value: Any, vocab_size: int, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name}: must be a list of integer token ids", param=name)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{name}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}", param=name)
    return list(value)
