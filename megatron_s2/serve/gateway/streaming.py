"""Server-sent events of the gateway protocols: ``event: <type>`` + ``data: <json>`` (Responses
and Messages name every event). The stream itself (its end on an error or a client that left) is
:func:`megatron_s2.serve.responses.event_stream` with the protocol's ``error_event``."""

from __future__ import annotations

import json

__all__ = ["named_event"]


def named_event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
