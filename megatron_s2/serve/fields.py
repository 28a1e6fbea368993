"""Reading request bodies: typed fields with HTTP 400 errors that name the field.

JSON types are checked strictly (``true`` is not an integer, ``false`` is not the number 0, ``"3"``
is not a number, an integer no float can hold is not a finite number), ranges are checked where the
engine would otherwise fail later, and a field the server cannot honour with a value that would
change the result is refused (:meth:`Fields.refuse_unless_default`) instead of silently ignored.
Unknown top-level fields are ignored, as OpenAI and vLLM do; unknown ``sampling_params`` keys of
the token endpoint are refused (:meth:`Fields.only`). A value quoted back in an error message is
cut to a few dozen characters (:func:`shown`): a 15 MB wrong value is not echoed whole.
"""

from __future__ import annotations

import json
import math
from typing import Any

from megatron_s2.serve.errors import BadRequest, PayloadTooLarge

__all__ = ["Fields", "parse_json_object", "read_json_object", "shown", "shown_text", "number"]

_SHOWN_CHARS = 40
"""Characters of a string (or digits of an integer) an error message quotes back at most."""


async def read_json_object(request, max_bytes: int) -> dict:
    """The body of ``request`` as a JSON object; 413 once it exceeds ``max_bytes`` (checked on
    ``Content-Length`` before reading, and while a body without one streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(_too_large(int(declared), max_bytes))
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(_too_large(size, max_bytes, at_least=True))
        parts.append(chunk)
    return parse_json_object(b"".join(parts))


def _too_large(size: int, limit: int, at_least: bool = False) -> str:
    return (f"request body: {'more than ' if at_least else ''}{size} bytes exceeds the server's limit of {limit} "
            "bytes (ServeConfig.max_body_bytes); send a shorter prompt, or token ids")


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object whose strings are all valid Unicode."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4,300 digits
        raise BadRequest(f"request body: not valid JSON ({shown_text(str(exc), 200)})") from None
    except RecursionError:
        raise BadRequest("request body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: must be a JSON object, got {type(body).__name__}")
    _check_strings(body, "")
    return body


def _check_strings(value: Any, where: str) -> None:
    """A lone UTF-16 surrogate (``"\\udc80"`` in JSON) cannot be encoded or tokenised: a 400
    naming the field (``prompt[1]``, ``messages[0].content``) instead of a tokenizer's 500."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                name = path or "request body"
                raise BadRequest(f"{name}: contains a lone surrogate (\\ud800-\\udfff), which is not valid UTF-8 "
                                 "text; send well-formed Unicode", param=path or None) from None
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
            for k in item:
                stack.append((k, path or "request body"))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _digits(value: int) -> int:
    """Decimal digits of ``value`` without converting it to text (Python refuses past 4,300)."""
    magnitude = abs(value)
    estimate = max(1, int(magnitude.bit_length() * 0.30102999566398))  # log10(2)
    return estimate + (magnitude >= 10 ** estimate)


def shown_text(text: str, limit: int = _SHOWN_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value: Any) -> str:
    """A request value as an error message quotes it: its JSON kind and a short JSON rendering
    (the first characters of a long string, the size of an array or object)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, int):
        digits = _digits(value)
        return f"integer {value}" if digits <= _SHOWN_CHARS else f"an integer of {digits} digits"
    if isinstance(value, str):
        if len(value) <= _SHOWN_CHARS:
            return f"string {json.dumps(value, ensure_ascii=False)}"
        head = json.dumps(value[:_SHOWN_CHARS], ensure_ascii=False)[:-1]  # without the closing quote
        return f'string {head}..." ({len(value)} characters)'
    if isinstance(value, (list, dict)):
        return f"{_kind(value)} of {len(value)} {'items' if isinstance(value, list) else 'keys'}"
    return f"{_kind(value)} {json.dumps(value)}"


def number(value: int | float) -> str:
    """A number as an error message quotes it (an integer of hundreds of digits by its size)."""
    return shown(value).removeprefix("integer ").removeprefix("number ")


def _same_kind(value: Any, default: Any) -> bool:
    """JSON kinds agree (a boolean is not a number; an integer and a float are both numbers)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


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
                self.fail(key, f"must be an integer, got {shown(value)}")
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {number(value)}")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be <= {maximum}, got {number(value)}")
        return value

    def float(self, key: str, default: float | None = None, *, minimum: float | None = None,
              maximum: float | None = None) -> float | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a finite number, got {shown(value)}")
        try:
            value = float(value)  # an integer beyond float range raises OverflowError
        except OverflowError:
            self.fail(key, f"must be a finite number, got {shown(value)}")
        if not math.isfinite(value):
            self.fail(key, f"must be a finite number, got {shown(value)}")
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
            self.fail(key, f"must be true or false, got {shown(value)}")
        return value

    def str(self, key: str, default: str | None = None) -> str | None:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {shown(value)}")
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
        """Refuse a field this server cannot honour unless it has the value that changes nothing
        (of the same JSON kind: ``false`` is not the neutral ``0``)."""
        value = self.body.get(key)
        if value is None:
            return
        if default is not None and not _same_kind(value, default):
            self.fail(key, f"must be {_ARTICLE_KIND.get(_kind(default), _kind(default))}, got {shown(value)}")
        if value != default and not (isinstance(default, list) and value == []):
            self.fail(key, f"not supported by this server ({why})")

    def only(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.body) - allowed)
        if unknown:
            self.fail(shown_text(unknown[0]), f"unknown field; known fields: {', '.join(sorted(allowed))}")


_ARTICLE_KIND = {"boolean": "true or false", "integer": "a number", "number": "a number", "string": "a string",
                 "array": "an array", "object": "an object"}


def check_token_ids(value: Any, vocab_size: int, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name}: must be a list of integer token ids", param=name)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{name}: token id {number(bad)} is outside the vocabulary "
                         f"0..{vocab_size - 1}", param=name)
    return list(value)
